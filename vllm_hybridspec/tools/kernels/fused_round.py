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
* launch floor: ``layers + 1`` launches of a kernel that stores one float, captured in one CUDA graph.

Both methods of each path are timed ("chunk", "recurrent"); the fused and unfused columns are the
method ``method="auto"`` picks at that (w, B). Each variant is one captured round, timed as the median
of ``samples`` samples of ``replays`` graph replays (:mod:`.timing`). Before timing, both paths run
three rounds (committing w, ceil(w / 2), then w by a final ``gdn_commit`` flush of the slabs) of two
layers at the same head shape, for every (B, w), method and fp32 and bf16 inputs, and are checked
against the float64 token-by-token recurrence (HybridSpec paper, Eq. 1) over exactly the committed
tokens; a failed check stops the run. Nothing from vLLM is imported.

    hybridspec kernels fused --json fused_round.json

Without CUDA only the accuracy check runs (through Triton's interpreter; ``--shape tiny`` takes
seconds, the 35B shape a long time) and the command says that timing needs a CUDA device. The
launch sweep of the fused round is ``hybridspec kernels fused --tune`` (:func:`.tune.tune_fused`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton

from vllm_hybridspec.kernels.gdn import (
    MAX_VERIFY_LEN,
    StatePointers,
    VerifyFactors,
    gdn_commit,
    gdn_commit_verify,
)
from vllm_hybridspec.kernels.gdn.verify import recurrent_up_to

from .shapes import Round, Shape, Unfused, random_pools, rel_err
from .timing import copy_bandwidth, graph_ms, launch_floor_ms, log

SLAB_LEN = MAX_VERIFY_LEN  # a layer's slab entries hold its longest round
METHODS = ("chunk", "recurrent")
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-3}


class Fused:
    """The lazy-commit round: per layer, slabs of 2B entries (two halves of B, double-buffered);
    each round commits the pending round from one half and writes its own factors to the other."""

    def __init__(self, shape: Shape, B: int, method: str, device, seed: int):
        self.shape, self.B, self.method = shape, B, method
        self.pools = random_pools(shape, B + 1, device, seed)
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


def steady_state(shape: Shape, B: int, w: int, method: str,
                 launch: dict | None = None) -> tuple[Fused, Round, list]:
    """A fused round at (B, w) on CUDA, bf16 inputs, with a pending round of m = w (the first round
    has nothing pending and fills one half of the slabs); ``functools.partial(fused.round, r, out)``
    is the steady-state round."""
    r = Round(shape, B, w, torch.bfloat16, gen=1000 * B + w, device="cuda")
    out = r.outputs()
    fused = Fused(shape, B, method, "cuda", seed=7)
    fused.round(r, out, **(launch or {}))
    fused.accept(torch.full((B,), w, dtype=torch.int32, device="cuda"))
    return fused, r, out


def check_accuracy(shape: Shape, B: int, w: int, method: str, dtype: torch.dtype, device,
                   seed: int = 0) -> dict:
    """Largest relative errors of both paths (outputs of every round, final states) against the
    float64 recurrence over three rounds that commit w, ceil(w / 2) and w tokens."""
    fused = Fused(shape, B, method, device, seed)
    unfused = Unfused(shape, B, device, seed, verify=dict(method=method))
    S = [[p[1 + b].double() for b in range(B)] for p in fused.pools]  # [layer][sequence]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    errs = dict(fused_out=0.0, fused_state=0.0, unfused_out=0.0, unfused_state=0.0)
    for m in (w, math.ceil(w / 2), w):
        r = Round(shape, B, w, dtype, gen)
        m_dev = torch.full((B,), m, dtype=torch.int32, device=device)
        out_f, out_u = r.outputs(), r.outputs()
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


def fused_round_bytes(shape: Shape, B: int, w: int, m: int, dtype_bytes: int = 2) -> int:
    """Bytes a fused round must move over all layers: each state read and written once, q, k, v
    and the raw gates read, the pending round's ``m`` factor rows read and this round's written
    (fp32), the outputs written (in the inputs' dtype), A_log and dt_bias read."""
    T = B * w
    factor_row = (shape.HV * shape.V + shape.HK * shape.K + shape.HV) * 4
    per_layer = (2 * B * shape.state_bytes
                 + T * (2 * shape.HK * shape.K + 2 * shape.HV * shape.V + 2 * shape.HV) * dtype_bytes
                 + (B * m + T) * factor_row + 2 * shape.HV * 4)
    return shape.layers * per_layer


def time_rounds(shape: Shape, B: int, w: int, samples: int, replays: int, bandwidth: float,
                launch_ms: float) -> dict:
    """One table row: both paths and both methods at (B, w), steady state m = w, bf16 inputs."""
    m = torch.full((B,), w, dtype=torch.int32, device="cuda")
    row = dict(B=B, w=w, m=w)
    for method in METHODS:
        fused, r, out = steady_state(shape, B, w, method)
        row[f"fused_{method}"] = graph_ms(functools.partial(fused.round, r, out), samples, replays).ms
        unfused = Unfused(shape, B, "cuda", seed=7, verify=dict(method=method))
        row[f"unfused_{method}"] = graph_ms(functools.partial(unfused.round, r, out, m), samples, replays).ms
    row["method"] = "recurrent" if w <= recurrent_up_to(B) else "chunk"
    row["fused"], row["unfused"] = row[f"fused_{row['method']}"], row[f"unfused_{row['method']}"]
    row["bandwidth_floor"] = fused_round_bytes(shape, B, w, w) / bandwidth * 1e3
    row["launch_floor"] = launch_ms
    return row


def format_table(rows: list[dict]) -> str:
    """The timed rows as a ``|``-separated table, ms."""
    head = ("B", "w", "method", "fused", "unfused", "speedup", "fused chunk", "fused rec.", "unfused chunk",
            "unfused rec.", "bw floor", "launch floor", "fused / bw floor")
    lines = [" | ".join(head)]
    for r in rows:
        vals = [r["fused"], r["unfused"], r["unfused"] / r["fused"], r["fused_chunk"], r["fused_recurrent"],
                r["unfused_chunk"], r["unfused_recurrent"], r["bandwidth_floor"], r["launch_floor"],
                r["fused"] / r["bandwidth_floor"]]
        lines.append(" | ".join([str(r["B"]), str(r["w"]), r["method"]] + [f"{x:.4f}" for x in vals]))
    return "\n".join(lines)


def run(shape: Shape, batches, lengths, samples: int = 30, replays: int = 10, device=None) -> dict:
    """The accuracy check on ``device`` (CUDA if there is one), then, on CUDA only, the timings.
    Returns ``{"accuracy": {...}, "failed": [...], "meta": {...}, "rows": [...]}`` (no rows without
    CUDA or after a failed check); ms throughout."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    accuracy, failed = {}, []
    check_shape = shape.with_layers(min(2, shape.layers))  # every layer runs the same kernels
    for B in batches:
        for w in lengths:
            for method in METHODS:
                for dtype, tol in TOL.items():
                    key = f"B{B}_w{w}_{method}_{str(dtype).split('.')[-1]}"
                    accuracy[key] = errs = check_accuracy(check_shape, B, w, method, dtype, device)
                    ok = max(errs.values()) <= tol
                    log(f"accuracy {key}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
                        + ("" if ok else " FAILED"))
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
