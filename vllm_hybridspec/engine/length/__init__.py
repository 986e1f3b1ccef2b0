"""Throughput-aware verification lengths inside vLLM 0.26 (HybridSpec): the per-round selector
(``selector``), the runner patches that make the target verify only the selected drafts
(``trimming``), full CUDA graphs for every verification length (``graphs``), calibration records from a serving engine (``capture``) and switching a running
server's selector (``control``)."""


def install() -> None:
    from vllm_hybridspec.engine.compat import patch_runner_after_sampling
    from vllm_hybridspec.engine.length.capture import capture_after_sampling
    from vllm_hybridspec.engine.length.graphs import patch_full_graphs_per_length
    from vllm_hybridspec.engine.length.trimming import patch_runner_length_trimming

    patch_runner_length_trimming()
    patch_full_graphs_per_length()
    patch_runner_after_sampling(capture_after_sampling)
