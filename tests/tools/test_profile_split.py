"""``tools.profile.graph_split``: a trace's kernels grouped by the CUDA-graph replay that launched them
(by correlation id), each graph told apart by its kernel count, and the eager rest per step."""

from __future__ import annotations

from vllm_hybridspec.tools.profile import graph_split


def trace(steps: int) -> list[dict]:
    events, corr = [], 0
    for s in range(steps):
        for n_kernels, dur in ((3, 10.0), (2, 50.0)):  # the target's graph, then the drafter's
            corr += 1
            events.append({"cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": corr}})
            events += [{"cat": "kernel", "name": f"void at::native::k{i}", "dur": dur, "args": {"correlation": corr}}
                       for i in range(n_kernels)]
        corr += 1
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"correlation": corr}})
        events.append({"cat": "kernel", "name": "lm_head", "dur": 250.0, "args": {"correlation": corr}})
        events.append({"cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 2.0, "args": {"correlation": corr + 1000}})
        events.append({"cat": "cpu_op", "name": "aten::mm", "dur": 5.0, "args": {}})
    return events


def test_kernels_split_by_graph_replay_and_eager():
    split = graph_split(trace(4), steps=4)
    drafter, target = split["graphs"]  # by time, largest first
    assert (drafter["kernels_per_replay"], drafter["replays_per_step"], drafter["ms_per_replay"]) == (2, 1.0, 0.1)
    assert (target["kernels_per_replay"], target["replays_per_step"], target["ms_per_replay"]) == (3, 1.0, 0.03)
    assert target["top"][0] == {"kernel": "k0", "us": 10.0, "calls": 1.0}
    assert split["eager"]["kernels_per_step"] == 2 and split["eager"]["ms_per_step"] == 0.252
    assert [row["kernel"] for row in split["eager"]["top"]] == ["lm_head", "Memcpy HtoD"]
