"""H-Spec drafting inside vLLM 0.26 (H-Spec paper): the proposer that replaces vLLM's DFlash proposer
in the V1 runner (``proposer``), the drafter as a vLLM model that reads the target's KV cache in
place (``model``), and the CUDA graphs of its round (``graphs``)."""

from vllm_hybridspec.engine.compat import HSPEC_ARCHITECTURE, HSPEC_METHOD


def install() -> None:
    """Register the drafter model and its speculators format, and route the runner's DFlash
    proposer through :class:`~vllm_hybridspec.engine.drafting.proposer.RunnerDFlashProposer`."""
    from vllm import ModelRegistry

    import vllm_hybridspec.drafter  # noqa: F401  (registers "hspec" with speculators)
    from vllm_hybridspec.engine.config import is_hspec_speculative_config, speculators_to_vllm
    from vllm_hybridspec.engine.drafting.model import register_speculators_algorithm
    from vllm_hybridspec.engine.drafting.proposer import (
        RunnerDFlashProposer,
        patch_runner_dflash_proposer,
        patch_v2_runner_unsupported,
    )

    ModelRegistry.register_model(HSPEC_ARCHITECTURE, "vllm_hybridspec.engine.drafting.model:HSpecForVLLM")
    register_speculators_algorithm(HSPEC_METHOD, speculators_to_vllm)
    patch_v2_runner_unsupported(is_hspec_speculative_config)
    patch_runner_dflash_proposer(RunnerDFlashProposer)
