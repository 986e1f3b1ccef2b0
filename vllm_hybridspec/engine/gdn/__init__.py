"""The Qwen GDN layer with one state slot per request (HybridSpec, parallel GDN verification and
accepted-state reconstruction): whether it is on (``enable``), the batch layout it verifies
(``layout``), the layer (``layer``), the commit (``commit``) and its CUDA graphs (``graphs``);
``vllm_path`` loads vLLM's own per-token-state kernel, the baseline it replaces."""


def install() -> None:
    """Every ``QwenGatedDeltaNetAttention`` becomes :class:`~vllm_hybridspec.engine.gdn.layer.HSpecQwenGDN`,
    which decides per engine whether it is on (``enable.gdn_kernel_enabled``) and otherwise is vLLM's
    layer."""
    from vllm_hybridspec.engine.compat import patch_runner_after_sampling
    from vllm_hybridspec.engine.gdn.commit import commit_rounds
    from vllm_hybridspec.engine.gdn.enable import one_slot_page_shape, patch_gdn_page_size
    from vllm_hybridspec.engine.gdn.graphs import patch_plain_decode_full_graphs
    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN, register_gdn_layer, runner_has_one_slot_layers

    register_gdn_layer(HSpecQwenGDN)
    patch_gdn_page_size(one_slot_page_shape)
    patch_runner_after_sampling(commit_rounds)
    patch_plain_decode_full_graphs(runner_has_one_slot_layers)
