"""CUDA timing of the GDN-kernel benchmarks: every timed variant is one CUDA graph, replayed.

* :func:`capture` runs a callable once (its Triton kernels compile, which a capture cannot) and
  captures it as one CUDA graph;
* :func:`replay_ms` is the median and interquartile spread of ``samples`` samples of ``replays``
  back-to-back calls, between CUDA events recorded without a host sync in between (the GPU never
  waits for the host, so a sample is the device time of its calls);
* :func:`graph_ms` is both: the time of one replay of the captured callable;
* :func:`copy_bandwidth`: the device-to-device copy bandwidth of a 1 GiB copy (bytes read plus
  bytes written), the denominator of every bandwidth floor;
* :func:`read_bandwidth`: the bandwidth of reading a 1 GiB buffer once (a kernel that sums it), the
  denominator of a floor made of weight reads;
* :func:`launch_floor_ms`: ``launches`` dependent launches of a kernel that stores one float, in one
  CUDA graph: what a design with a kernel per layer pays however little each kernel does.

CUDA only; the benchmarks call these after their accuracy checks, which also run on the CPU.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Timing(NamedTuple):
    ms: float  # median of the samples, ms per call
    iqr: float  # interquartile spread of the samples, ms


def log(*parts) -> None:
    """A progress line, flushed (the GPU sessions tail the logs while a run goes on)."""
    print(*parts, flush=True)


def capture(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run once on a side stream (it compiles its kernels), then captured as one CUDA graph;
    returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def replay_ms(fn: Callable[[], None], samples: int, replays: int = 10, warmup: int = 3) -> Timing:
    """Median and interquartile spread (ms per call) of ``samples`` samples of ``replays`` calls."""
    for _ in range(warmup):
        fn()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(samples + 1)]
    marks[0].record()
    for mark in marks[1:]:
        for _ in range(replays):
            fn()
        mark.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) / replays for a, b in itertools.pairwise(marks)]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return Timing(statistics.median(times), q[2] - q[0])


def graph_ms(fn: Callable[[], None], samples: int, replays: int = 10) -> Timing:
    """One replay of ``fn`` captured as a CUDA graph (:func:`capture`, :func:`replay_ms`)."""
    return replay_ms(capture(fn), samples, replays)


def copy_bandwidth(samples: int, replays: int = 5) -> float:
    """Device-to-device copy bandwidth of a 1 GiB copy in bytes/s, bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (graph_ms(lambda: dst.copy_(src), samples, replays).ms * 1e-3)


@triton.jit
def _sum_blocks(src, out, BLOCK: tl.constexpr, TILES: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * TILES
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(TILES):
        acc += tl.load(src + base + j * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc))


def read_bandwidth(samples: int, replays: int = 5) -> float:
    """Bytes/s of reading a 1 GiB bf16 buffer once (each program sums 64 KiB)."""
    BLOCK, TILES = 2048, 16
    src = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
    programs = src.numel() // (BLOCK * TILES)
    out = torch.empty(programs, dtype=torch.float32, device="cuda")
    ms = graph_ms(lambda: _sum_blocks[(programs,)](src, out, BLOCK=BLOCK, TILES=TILES), samples, replays).ms
    return src.numel() * src.element_size() / (ms * 1e-3)


@triton.jit
def _store_one(ptr):
    tl.store(ptr + tl.program_id(0), 1.0)


def launch_floor_ms(launches: int, samples: int, replays: int = 10) -> float:
    """Median replay time of one CUDA graph of ``launches`` launches of a kernel that stores one float."""
    buf = torch.zeros(1, device="cuda")

    def chain():
        for _ in range(launches):
            _store_one[(1,)](buf)

    return graph_ms(chain, samples, replays).ms
