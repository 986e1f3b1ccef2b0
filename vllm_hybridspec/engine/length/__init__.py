"""Throughput-aware verification lengths inside vLLM 0.26 (HybridSpec): the per-round selector
(``selector``), the step that verifies only the selected drafts, cut on the device (``cut``), the
batch gate in vLLM's scheduler (``gate``) or, where that cannot reach, a gated step's drafts taken
out of what vLLM schedules (``trimming``), full CUDA graphs for the gated step
(``graphs``), calibration records from a serving engine (``capture``) and switching a running
server's selector (``control``)."""


def install() -> None:
    from vllm_hybridspec.engine.compat import patch_runner_after_sampling
    from vllm_hybridspec.engine.length.capture import capture_after_sampling
    from vllm_hybridspec.engine.length.cut import patch_device_cut
    from vllm_hybridspec.engine.length.gate import patch_scheduler_gate
    from vllm_hybridspec.engine.length.graphs import patch_full_graphs_per_length
    from vllm_hybridspec.engine.length.trimming import patch_runner_length_trimming

    patch_runner_length_trimming()
    patch_device_cut()
    patch_scheduler_gate()
    patch_full_graphs_per_length()
    patch_runner_after_sampling(capture_after_sampling)
