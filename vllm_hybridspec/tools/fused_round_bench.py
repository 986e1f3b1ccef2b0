"""One speculative round of every GDN layer as one CUDA graph: the fused lazy commit + verification
(``gdn_commit_verify``) against the unfused ``gdn_verify`` + ``gdn_commit``, with two floors.

At the Qwen3.6-35B-A3B shape (30 GDN layers, 16 key heads, 32 value heads, 128 x 128 fp32 states,
bf16 projections as inputs), for B in {1, 4} sequences and round lengths w in {1, 2, 4, 8, 16}, in a
steady state where every round commits m = w tokens:

* fused: ``gdn_commit_verify`` for each layer, applying the previous round's commit (pending in one
  half of double-buffered slab entries) and writing this round's factors to the other half;
* unfused: ``gdn_verify`` for each layer, then one ``gdn_commit`` for all layers;
* bandwidth floor: the bytes a fused round must move (each state read and written once, the inputs,
  the factors read and written, the outputs) over the device-to-device copy bandwidth measured in
  the same run;
* launch floor: ``layers + 1`` launches of an empty kernel captured in one CUDA graph.

Both methods of each path are timed ("chunk", "recurrent"); the fused and unfused columns are the
method ``method="auto"`` picks at that (w, B). Each variant is one captured round, timed as the median
of ``samples`` samples of ``replays`` graph replays. Before timing, both paths run three rounds
(committing w, ceil(w / 2), then w by a final ``gdn_commit`` flush of the slabs) of two layers at
the same head shape, for every (B, w), method and fp32 and bf16 inputs, and are checked against the
float64 token-by-token recurrence (HybridSpec paper, Eq. 1) over exactly the committed tokens; a
failed check stops the run. Nothing from vLLM is imported.

    python -m vllm_hybridspec.tools.fused_round_bench --json fused_round.json

Without CUDA only the accuracy check runs (through Triton's interpreter; ``--shape tiny`` takes
seconds, the 35B shape a long time) and the command says that timing needs a CUDA device.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton

from vllm_hybridspec.kernels.gdn import (
    MAX_VERIFY_LEN,
    StatePointers,
    VerifyFactors,
    gdn_commit,
    gdn_commit_verify,
    gdn_gating,
    gdn_verify,
    recurrent_gated_delta_rule,
)
from vllm_hybridspec.kernels.gdn.verify import recurrent_up_to

SLAB_LEN = MAX_VERIFY_LEN  # a layer's slab entries hold its longest round
METHODS = ("chunk", "recurrent")
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-3}


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    HK: int
    HV: int
    K: int
    V: int


SHAPES = {"35b": Shape(layers=30, HK=16, HV=32, K=128, V=128),
          "tiny": Shape(layers=2, HK=2, HV=4, K=32, V=32)}


class Round:
    """Random inputs of one round for every layer: q, k ``[T, HK, K]``, v ``[T, HV, V]``, raw gates
    a, b ``[T, HV]`` in ``dtype``; A_log, dt_bias ``[HV]`` fp32 (Qwen3-Next's initial ranges); B
    sequences of w tokens each."""

    def __init__(self, shape: Shape, B: int, w: int, dtype: torch.dtype, gen: torch.Generator):
        dev = gen.device
        T, L = B * w, shape.layers
        self.B, self.w = B, w

        def rn(*size, std=1.0):
            return [(torch.randn(*size, generator=gen, device=dev) * std).to(dtype) for _ in range(L)]

        self.q, self.k = rn(T, shape.HK, shape.K), rn(T, shape.HK, shape.K)
        self.v, self.a, self.b = rn(T, shape.HV, shape.V), rn(T, shape.HV), rn(T, shape.HV, std=2.0)
        self.A_log = [torch.log(1 + 15 * torch.rand(shape.HV, generator=gen, device=dev)) for _ in range(L)]
        self.dt_bias = [torch.randn(shape.HV, generator=gen, device=dev) * 0.5 - 2 for _ in range(L)]
        self.cu = torch.arange(0, T + 1, w, dtype=torch.int32, device=dev)

    def layer(self, i: int) -> dict:
        """Layer ``i``'s arguments of ``gdn_verify`` / ``gdn_commit_verify`` (fused gating)."""
        return dict(q=self.q[i], k=self.k[i], v=self.v[i], g=self.a[i], beta=self.b[i], A_log=self.A_log[i],
                    dt_bias=self.dt_bias[i], cu_seqlens=self.cu, max_len=self.w)

    def reference(self, i: int, seq: int, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 outputs ``[w, HV, V]`` and per-token states of sequence ``seq`` in layer ``i``."""
        s = slice(seq * self.w, (seq + 1) * self.w)
        g, beta = gdn_gating(self.A_log[i].double(), self.a[i][s].double(), self.dt_bias[i].double(),
                             self.b[i][s].double())
        return recurrent_gated_delta_rule(self.q[i][s].double(), self.k[i][s].double(), self.v[i][s].double(),
                                          g, beta, S)


def random_pools(shape: Shape, B: int, device, seed: int) -> list[torch.Tensor]:
    """Each layer's fp32 state pool ``[B + 1, HV, V, K]``; the sequences sit in slots 1..B."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(B + 1, shape.HV, shape.V, shape.K, generator=gen, device=device) * 0.2
            for _ in range(shape.layers)]


class Fused:
    """The lazy-commit round: per layer, slabs of 2B entries (two halves of B, double-buffered);
    each round commits the pending round from one half and writes its own factors to the other."""

    def __init__(self, shape: Shape, B: int, method: str, device, seed: int):
        self.shape, self.B, self.method = shape, B, method
        self.pools = random_pools(shape, B, device, seed)
        self.slabs = VerifyFactors.empty(2 * B * SLAB_LEN, shape.HK, shape.HV, shape.K, shape.V, device,
                                         num_layers=shape.layers)
        self.slots = torch.arange(1, B + 1, dtype=torch.int32, device=device)
        self.halves = [torch.arange(h * B, (h + 1) * B, dtype=torch.int32, device=device) for h in (0, 1)]
        self.pending_entry = torch.full((B,), -1, dtype=torch.int32, device=device)
        self.pending_m = torch.zeros(B, dtype=torch.int32, device=device)
        self.target = self.halves[0]

    def round(self, r: Round, out: list[torch.Tensor], **launch) -> None:
        for i in range(self.shape.layers):
            gdn_commit_verify(**r.layer(i), state=self.pools[i], state_indices=self.slots,
                              slabs=self.slabs.layer(i), slab_len=SLAB_LEN, pending_entry=self.pending_entry,
                              pending_m=self.pending_m, target_entry=self.target, out=out[i],
                              method=self.method, **launch)

    def accept(self, m: torch.Tensor) -> None:
        """After rejection sampling: the round just verified becomes the pending one, ``m`` ``[B]``."""
        self.pending_entry, self.pending_m = self.target, m
        self.target = self.halves[1] if self.target is self.halves[0] else self.halves[0]

    def flush(self) -> None:
        """Apply the pending round with ``gdn_commit`` over the slabs, one "sequence" per entry."""
        E = 2 * self.B
        slots = torch.zeros(E, dtype=torch.int32, device=self.slots.device)
        num_commit = torch.zeros_like(slots)
        slots[self.pending_entry.long()] = self.slots
        num_commit[self.pending_entry.long()] = self.pending_m
        gdn_commit(StatePointers(self.pools), self.slabs,
                   torch.arange(E + 1, dtype=torch.int32, device=slots.device) * SLAB_LEN, slots, num_commit)


class Unfused:
    """Today's round: ``gdn_verify`` per layer into packed factors, then one ``gdn_commit``."""

    def __init__(self, shape: Shape, B: int, method: str, device, seed: int):
        self.shape, self.method = shape, method
        self.pools = random_pools(shape, B, device, seed)
        self.ptrs = StatePointers(self.pools)
        self.slots = torch.arange(1, B + 1, dtype=torch.int32, device=device)
        self.factors = VerifyFactors.empty(B * MAX_VERIFY_LEN, shape.HK, shape.HV, shape.K, shape.V, device,
                                           num_layers=shape.layers)

    def round(self, r: Round, out: list[torch.Tensor], m: torch.Tensor) -> None:
        for i in range(self.shape.layers):
            gdn_verify(**r.layer(i), state=self.pools[i], state_indices=self.slots, out=out[i],
                       factors=self.factors.layer(i), method=self.method)
        gdn_commit(self.ptrs, self.factors, r.cu, self.slots, m)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def check_accuracy(shape: Shape, B: int, w: int, method: str, dtype: torch.dtype, device,
                   seed: int = 0) -> dict:
    """Largest relative errors of both paths (outputs of every round, final states) against the
    float64 recurrence over three rounds that commit w, ceil(w / 2) and w tokens."""
    fused, unfused = Fused(shape, B, method, device, seed), Unfused(shape, B, method, device, seed)
    S = [[p[1 + b].double() for b in range(B)] for p in fused.pools]  # [layer][sequence]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    errs = dict(fused_out=0.0, fused_state=0.0, unfused_out=0.0, unfused_state=0.0)
    for m in (w, math.ceil(w / 2), w):
        r = Round(shape, B, w, dtype, gen)
        m_dev = torch.full((B,), m, dtype=torch.int32, device=device)
        out_f, out_u = [torch.empty_like(v) for v in r.v], [torch.empty_like(v) for v in r.v]
        fused.round(r, out_f)
        fused.accept(m_dev)
        unfused.round(r, out_u, m_dev)
        for i in range(shape.layers):
            for b in range(B):
                o_ref, states = r.reference(i, b, S[i][b])
                S[i][b] = states[m - 1]
                s = slice(b * w, (b + 1) * w)
                errs["fused_out"] = max(errs["fused_out"], rel_err(out_f[i][s], o_ref))
                errs["unfused_out"] = max(errs["unfused_out"], rel_err(out_u[i][s], o_ref))
    fused.flush()
    for i in range(shape.layers):
        for b in range(B):
            errs["fused_state"] = max(errs["fused_state"], rel_err(fused.pools[i][1 + b], S[i][b]))
            errs["unfused_state"] = max(errs["unfused_state"], rel_err(unfused.pools[i][1 + b], S[i][b]))
    return errs


def graph_ms(fn, samples: int, replays: int) -> float:
    """Median ms of one replay of ``fn`` captured as a CUDA graph (``samples`` samples of ``replays``
    back-to-back replays each)."""
    fn()  # compiles the kernels; a capture cannot
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(samples + 1)]
    marks[0].record()
    for i in range(samples):
        for _ in range(replays):
            graph.replay()
        marks[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / replays for a, b in itertools.pairwise(marks))


def copy_bandwidth(samples: int, replays: int) -> float:
    """Device-to-device copy bandwidth of a 1 GiB copy in bytes/s, bytes read plus bytes written."""
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (graph_ms(lambda: dst.copy_(src), samples, replays) * 1e-3)


@triton.jit
def _empty_kernel(ptr):
    pass


def launch_floor_ms(launches: int, samples: int, replays: int) -> float:
    """One CUDA graph of ``launches`` launches of a kernel that does nothing."""
    buf = torch.empty(1, device="cuda")

    def chain():
        for _ in range(launches):
            _empty_kernel[(1,)](buf)

    return graph_ms(chain, samples, replays)


def fused_round_bytes(shape: Shape, B: int, w: int, m: int, dtype_bytes: int = 2) -> int:
    """Bytes a fused round must move over all layers: each state read and written once, q, k, v
    and the raw gates read, the pending round's ``m`` factor rows read and this round's written
    (fp32), the outputs written (in the inputs' dtype), A_log and dt_bias read."""
    T = B * w
    factor_row = (shape.HV * shape.V + shape.HK * shape.K + shape.HV) * 4
    per_layer = (2 * B * shape.HV * shape.V * shape.K * 4
                 + T * (2 * shape.HK * shape.K + 2 * shape.HV * shape.V + 2 * shape.HV) * dtype_bytes
                 + (B * m + T) * factor_row + 2 * shape.HV * 4)
    return shape.layers * per_layer


def time_rounds(shape: Shape, B: int, w: int, samples: int, replays: int, bandwidth: float,
                launch_ms: float) -> dict:
    """One table row: both paths and both methods at (B, w), steady state m = w, bf16 inputs."""
    r = Round(shape, B, w, torch.bfloat16, torch.Generator(device="cuda").manual_seed(1000 * B + w))
    m = torch.full((B,), w, dtype=torch.int32, device="cuda")
    out = [torch.empty_like(v) for v in r.v]
    row = dict(B=B, w=w, m=w)
    for method in METHODS:
        fused = Fused(shape, B, method, "cuda", seed=7)
        fused.round(r, out)  # the first round has nothing pending and fills one half of the slabs
        fused.accept(m)
        row[f"fused_{method}"] = graph_ms(functools.partial(fused.round, r, out), samples, replays)
        unfused = Unfused(shape, B, method, "cuda", seed=7)
        row[f"unfused_{method}"] = graph_ms(functools.partial(unfused.round, r, out, m), samples, replays)
    row["method"] = "recurrent" if w <= recurrent_up_to(B) else "chunk"
    row["fused"], row["unfused"] = row[f"fused_{row['method']}"], row[f"unfused_{row['method']}"]
    row["bandwidth_floor"] = fused_round_bytes(shape, B, w, w) / bandwidth * 1e3
    row["launch_floor"] = launch_ms
    return row


def print_table(rows: list[dict]) -> None:
    head = ("B", "w", "method", "fused", "unfused", "speedup", "fused chunk", "fused rec.", "unfused chunk",
            "unfused rec.", "bw floor", "launch floor", "fused / bw floor")
    print(" | ".join(head))
    for r in rows:
        vals = [r["fused"], r["unfused"], r["unfused"] / r["fused"], r["fused_chunk"], r["fused_recurrent"],
                r["unfused_chunk"], r["unfused_recurrent"], r["bandwidth_floor"], r["launch_floor"],
                r["fused"] / r["bandwidth_floor"]]
        print(" | ".join([str(r["B"]), str(r["w"]), r["method"]] + [f"{x:.4f}" for x in vals]))


def run(shape: Shape, batches, lengths, samples: int = 30, replays: int = 10, device=None) -> dict:
    """The accuracy check on ``device`` (CUDA if there is one), then, on CUDA only, the timings.
    Returns ``{"accuracy": {...}, "failed": [...], "meta": {...}, "rows": [...]}`` (no rows without
    CUDA or after a failed check); ms throughout."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    accuracy, failed = {}, []
    check_shape = dataclasses.replace(shape, layers=min(2, shape.layers))  # every layer runs the same kernels
    for B in batches:
        for w in lengths:
            for method in METHODS:
                for dtype, tol in TOL.items():
                    key = f"B{B}_w{w}_{method}_{str(dtype).split('.')[-1]}"
                    accuracy[key] = errs = check_accuracy(check_shape, B, w, method, dtype, device)
                    ok = max(errs.values()) <= tol
                    print(f"accuracy {key}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
                          + ("" if ok else " FAILED"), flush=True)
                    if not ok:
                        failed.append(key)
    result = dict(accuracy=accuracy, failed=failed, rows=[], meta=dict(shape=dataclasses.asdict(shape)))
    if failed or device != "cuda":
        return result
    bandwidth = copy_bandwidth(samples, replays)
    launch_ms = launch_floor_ms(shape.layers + 1, samples, replays)
    result["meta"].update(device=torch.cuda.get_device_name(), copy_bandwidth_TBps=bandwidth / 1e12,
                          launch_floor_ms=launch_ms, samples=samples, replays=replays,
                          torch=torch.__version__, triton=triton.__version__)
    for B in batches:
        for w in lengths:
            result["rows"].append(time_rounds(shape, B, w, samples, replays, bandwidth, launch_ms))
            torch.cuda.empty_cache()
    return result


# launch candidates of the fused round (--tune): value rows per program and warps, per method
TUNE = {"chunk": [dict(BV=BV, num_warps=nw, BK=BK) for BV in (16, 32, 64) for nw in (2, 4, 8) for BK in (64, 128)],
        "recurrent": [dict(BV=BV, num_warps=nw) for BV in (4, 8, 16) for nw in (1, 2, 4)]}


def tune(shape: Shape, batches, lengths, samples: int, replays: int) -> list[dict]:
    """The fused round at every launch candidate of :data:`TUNE` (bf16 inputs, steady state m = w):
    one dict per (B, w, method, BV, num_warps) with its ms; the fastest per (B, w) is printed."""
    rows = []
    for B in batches:
        for w in lengths:
            r = Round(shape, B, w, torch.bfloat16, torch.Generator(device="cuda").manual_seed(1000 * B + w))
            m = torch.full((B,), w, dtype=torch.int32, device="cuda")
            out = [torch.empty_like(v) for v in r.v]
            here = []
            for method, candidates in TUNE.items():
                fused = Fused(shape, B, method, "cuda", seed=7)
                fused.round(r, out)
                fused.accept(m)
                for launch in candidates:
                    ms = graph_ms(functools.partial(fused.round, r, out, **launch), samples, replays)
                    here.append(dict(B=B, w=w, method=method, **launch, ms=ms))
            best = min(here, key=lambda x: x["ms"])
            print(f"tune B={B} w={w}: best {best} ; " + ", ".join(
                f"{x['method'][0]}{x['BV']}/{x['num_warps']}/{x.get('BK', '-')}:{x['ms']:.3f}" for x in here), flush=True)
            rows += here
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="35b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--json", type=Path, help="where to write the accuracy, the timings and the run's meta")
    p.add_argument("--tune", action="store_true", help="time the fused round at every launch candidate "
                   "(no accuracy check, CUDA only)")
    args = p.parse_args(argv)
    if args.tune:
        rows = tune(SHAPES[args.shape], args.batches, args.lengths, args.samples, args.replays)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    bad = [w for w in args.lengths if not 1 <= w <= MAX_VERIFY_LEN]
    if bad:
        p.error(f"--lengths must be in 1..{MAX_VERIFY_LEN}, got {bad}")
    result = run(SHAPES[args.shape], args.batches, args.lengths, args.samples, args.replays)
    result["meta"]["command"] = " ".join(["python -m vllm_hybridspec.tools.fused_round_bench"]
                                         + (sys.argv[1:] if argv is None else list(argv)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if result["failed"]:
        print(f"accuracy check FAILED for {result['failed']}; nothing timed", file=sys.stderr)
        return 1
    if not result["rows"]:
        print("accuracy check passed; timing needs a CUDA device, none here", flush=True)
        return 0
    print(f"{result['meta']['device']}: copy bandwidth {result['meta']['copy_bandwidth_TBps']:.2f} TB/s, "
          f"launch floor {result['meta']['launch_floor_ms']:.4f} ms; times in ms per round of "
          f"{args.shape} ({SHAPES[args.shape].layers} layers)")
    print_table(result["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
