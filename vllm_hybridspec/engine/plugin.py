"""The vLLM general plugin (entry point ``vllm.general_plugins: hspec``), loaded by vLLM in every
process (``vllm.plugins.load_general_plugins``): after it, ``--speculative-config
'{"method": "hspec", "model": "<H-Spec checkpoint>"}'`` works, and so does an H-Spec checkpoint served
as the model. See ``docs/architecture.md``."""

from __future__ import annotations

import logging

from vllm_hybridspec.engine.compat import HSPEC_METHOD, check_vllm_version, installed_vllm_version
from vllm_hybridspec.engine.config import patch_create_speculative_config

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """Idempotent; vLLM may call it several times per process."""
    global _registered
    if _registered:
        return
    try:
        check_vllm_version()
    except RuntimeError as error:
        # A wrong vLLM must not break vLLM for users who do not ask for H-Spec: install only the
        # config hook, which raises this error when "hspec" is requested.
        logger.warning("%s; H-Spec speculative decoding is disabled", error)
        _install_version_guard(error)
        _registered = True
        return

    from vllm_hybridspec.engine import config, cpu, drafting, gdn, length, replay

    config.install()
    drafting.install()
    length.install()
    replay.install()
    cpu.install()
    gdn.install()
    _registered = True


def _install_version_guard(error: RuntimeError) -> None:
    def refuse_hspec(spec: dict, target_model_config) -> dict:
        if spec.get("method") == HSPEC_METHOD:
            raise RuntimeError(f"{error} (vLLM {installed_vllm_version()})")
        return spec, {}

    try:
        patch_create_speculative_config(refuse_hspec)
    except Exception:  # an unknown vLLM: nothing more we can do than the warning
        logger.exception("vllm-hybridspec could not install its version guard")
