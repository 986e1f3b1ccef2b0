"""The vLLM general plugin (entry point ``vllm.general_plugins: hspec``), loaded by vLLM in every
process (``vllm.plugins.load_general_plugins``): after it, ``--speculative-config
'{"method": "hspec", "model": "<H-Spec checkpoint>"}'`` works, and so does an H-Spec checkpoint served
as the model. Every reach into vLLM is a row of ``engine/patches/table.py``; ``register`` installs them.
See ``docs/architecture.md``."""

from __future__ import annotations

import logging

from vllm_hybridspec.engine.compat import (
    ANY_VLLM_ENV,
    HSPEC_METHOD,
    any_vllm,
    check_vllm_version,
    installed_vllm_version,
)

logger = logging.getLogger(__name__)

_registered = False
_version_error: RuntimeError | None = None


def register() -> None:
    """Idempotent; vLLM may call it several times per process."""
    global _registered, _version_error
    if _registered:
        return
    from vllm_hybridspec.engine import patches

    porting = False
    try:
        check_vllm_version()
    except RuntimeError as error:
        if not any_vllm():
            # A wrong vLLM must not break vLLM for users who do not ask for H-Spec: install only the
            # config guard, which raises this error when "hspec" is requested.
            logger.warning("%s; H-Spec speculative decoding is disabled", error)
            _version_error = error
            try:
                patches.apply(("other_vllm",))
            except Exception:  # an unknown vLLM: nothing more we can do than the warning
                logger.exception("vllm-hybridspec could not install its version guard")
            _registered = True
            return
        logger.warning("%s; installing anyway (%s=1)", error, ANY_VLLM_ENV)
        porting = True

    from vllm.platforms import current_platform

    import vllm_hybridspec.drafter  # noqa: F401  (registers "hspec" with speculators)

    when = ("always", "cpu") if current_platform.is_cpu() else ("always",)
    if porting:
        for name, problems in patches.apply_what_fits(when):
            logger.warning("vllm-hybridspec: row %r of engine/patches/table.py left out: %s", name, "; ".join(problems))
    else:
        patches.apply(when)

    from vllm_hybridspec.engine.drafting.proposer import register_substitute
    from vllm_hybridspec.engine.replay.proposer import ReplayHSpecProposer, is_replay_engine

    register_substitute(is_replay_engine, ReplayHSpecProposer)  # benchmarking only (engine/replay/)
    _registered = True


def refusing_hspec(original):
    """The wrapper of ``EngineArgs.create_speculative_config`` on an unsupported vLLM (``engine/patches/table.py``,
    ``when="other_vllm"``): "hspec" is refused with the version error, anything else passes."""
    def create_speculative_config(self, target_model_config, target_parallel_config):
        if self.speculative_config is not None and dict(self.speculative_config).get("method") == HSPEC_METHOD:
            raise RuntimeError(f"{_version_error} (vLLM {installed_vllm_version()})")
        return original(self, target_model_config, target_parallel_config)

    return create_speculative_config
