"""The Qwen GDN layer with one state slot per request (HybridSpec, parallel GDN verification and
accepted-state reconstruction): whether it is on (``enable``), the rounds a step verifies (``layout``),
the layer (``layer``), the lazy commit's host side (``pending``) and its runner patches (``runner``),
the commits outside a verification (``commit``); ``vllm_path`` loads vLLM's own per-token-state
kernel, the baseline the layer replaces. Its reaches into vLLM are rows of ``engine/patches/table.py``:
every ``QwenGatedDeltaNetAttention`` becomes :class:`~vllm_hybridspec.engine.gdn.layer.HSpecQwenGDN`,
which decides per engine whether it is on (``enable.gdn_kernel_enabled``) and otherwise is vLLM's layer."""
