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


# --- tools.profile.host_functions: where the host is blocked -----------------------------------------


class _Clocks:
    """Stands in for the ``time`` module inside ``tools.profile``: a wall clock and the main thread's CPU
    clock that only the fake engine's functions advance, so cProfile's timings are exact."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu


class _Engine:
    def __init__(self, clocks: _Clocks):
        self.clocks = clocks

    def _blocks(self, seconds: float) -> None:  # a device sync: wall time, no CPU time
        self.clocks.wall += seconds

    def _computes(self, seconds: float) -> None:  # host work: wall time that is CPU time
        self.clocks.wall += seconds
        self.clocks.cpu += seconds

    def step(self) -> None:
        self._computes(0.004)
        self._blocks(0.006)
        self._computes(0.001)


def test_host_functions_name_the_call_that_blocks(tmp_path, monkeypatch):
    from vllm_hybridspec.tools import profile

    clocks = _Clocks()
    monkeypatch.setattr(profile, "time", clocks)
    host = profile.host_functions(_Engine(clocks), steps=5, path=tmp_path / "host.txt", clock=clocks.perf_counter)
    waits = host["waits"]
    by_self = {r["where"].rsplit("(", 1)[-1].rstrip(")"): r for r in waits["by_self"]}
    by_cum = {r["where"].rsplit("(", 1)[-1].rstrip(")"): r for r in waits["by_cum"]}
    # 6 ms of each 11 ms step are blocked, in _blocks, called from step; the 5 ms of host work block nothing
    assert by_self["_blocks"]["self_wait_ms"] == 6.0 and by_self["_blocks"]["self_wall_ms"] == 6.0
    assert set(by_self["_blocks"]["callers"]) == {next(c for c in by_self["_blocks"]["callers"] if c.endswith("(step)"))}
    assert "_computes" not in by_self and "_computes" not in by_cum
    assert by_cum["step"]["cum_wait_ms"] == 6.0 and by_cum["step"]["cum_wall_ms"] == 11.0
    assert waits["total_wait_ms_per_step"] == 6.0 and host["wall_ms_per_step"] == 11.0
    assert waits["unprofiled"] == {"wall_ms_per_step": 11.0, "cpu_ms_per_step": 5.0, "blocked_ms_per_step": 6.0}
    text = (tmp_path / "host.txt").read_text()
    assert "## where the host is blocked" in text and "<- " in text.split("## where the host is blocked")[1]
