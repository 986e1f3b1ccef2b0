"""The Qwen GDN layer with one state slot per request (HybridSpec, parallel GDN verification and
accepted-state reconstruction): whether it is on (``enable``), the rounds a step verifies (``layout``),
the layer (``layer``), the lazy commit's host side (``pending``) and its runner patches (``runner``),
the commits outside a verification (``commit``); ``vllm_path`` loads vLLM's own per-token-state
kernel, the baseline the layer replaces."""


def install() -> None:
    """Every ``QwenGatedDeltaNetAttention`` becomes :class:`~vllm_hybridspec.engine.gdn.layer.HSpecQwenGDN`,
    which decides per engine whether it is on (``enable.gdn_kernel_enabled``) and otherwise is vLLM's
    layer."""
    from vllm_hybridspec.engine.gdn.enable import one_slot_page_shape, patch_gdn_page_size
    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN, register_gdn_layer
    from vllm_hybridspec.engine.gdn.runner import patch_runner_pending_rounds

    register_gdn_layer(HSpecQwenGDN)
    patch_gdn_page_size(one_slot_page_shape)
    patch_runner_pending_rounds()
