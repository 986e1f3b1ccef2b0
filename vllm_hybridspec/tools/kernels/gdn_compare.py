"""GDN verification + commit at the Qwen3.6-35B-A3B shape: ours vs vLLM 0.26 vs fla.

All 30 GDN layers (16 key heads, 32 value heads, 128 x 128 fp32 states), batch 1 and 4, round
lengths w in {2, 3, 4, 8, 12, 16}, committed tokens m = w and m = ceil(w / 2).  Variants, each
captured as one CUDA graph of a whole round and timed as the median of >= 30 samples of 10 replays
(:mod:`.timing`):

* ours: ``gdn_verify`` for each of the 30 layers, then one ``gdn_commit`` for all layers, with both
  verify kernels ("chunk", all w tokens in one set of matrix products, HybridSpec paper Eq. 3;
  "recurrent", the recurrence of Eq. 1 stepped on a register copy of ``S_0``), and the chunkwise
  round with fp32-accurate products ("tf32x3");
* vLLM: ``fused_sigmoid_gating_delta_rule_update`` as vLLM 0.26's Qwen GDN layer calls it on its
  spec-decode path (state slots ``[B, w]``, one state written per token, the round starting from
  the slot of the previously accepted token); vLLM's default (no prefix caching) needs no copy
  after it; "vLLM + copy" adds the copy of the accepted slot that prefix-caching "align" mode makes;
* fla: ``chunk_gated_delta_rule`` (fla-core), final state only (no rollback), gates precomputed.

In the same run: device-to-device copy bandwidth, and each variant's time against the bandwidth
floor of a verifier that must read ``S_0`` once and write ``S_m`` once (verify: read; commit: read
+ write); and the launch floor: 31 launches of a kernel that stores one float (one verify per layer
and one commit, in one CUDA graph), what any design with a kernel per layer pays however little each
kernel does.  Before timing, our outputs and committed states are checked against vLLM's kernel and
a float64 torch reference (fp32 and bf16 inputs; two rounds that commit w then ceil(w / 2) and the
reverse).  Unless ``--no-tune``, the launch configuration of verify and commit is chosen in the
same run (:func:`.tune.tune_compare`).

    hybridspec kernels compare --out docs/benchmarks/gdn_kernels.md --json out.json
    hybridspec kernels render out.json --out docs/benchmarks/gdn_kernels.md   # again, from the JSON

Without CUDA only the accuracy check runs: ours against the float64 reference and against vLLM's
kernel, both through Triton's interpreter (``--shape tiny`` takes seconds; ``--ours-only`` leaves
vLLM out), and the command says that timing needs a CUDA device.
"""

from __future__ import annotations

import json
import math
import time

import torch

from vllm_hybridspec.engine.gdn.vllm_path import load_vllm_spec_decode_gdn_kernel
from vllm_hybridspec.kernels.gdn import gdn_gating

from .shapes import Round, Shape, Unfused, random_pools, rel_err
from .timing import copy_bandwidth, graph_ms, launch_floor_ms, log

# largest relative errors passed: fp32 inputs, everything; bf16 inputs, against the float64 reference
FP32_TOL, BF16_TOL = 1e-4, 5e-3
ERRORS = ("out_vs_fp64", "state_vs_fp64", "out_vs_vllm", "state_vs_vllm")


class VllmPath:
    """vLLM 0.26's spec-decode GDN call for every layer, with state slots [B, w] per layer."""

    def __init__(self, shape: Shape, r: Round, m: int, with_copy: bool):
        self.kernel = load_vllm_spec_decode_gdn_kernel()
        B, w, dev = r.B, r.w, r.device
        self.shape, self.r = shape, r
        self.pools = random_pools(shape, B * w + 1, dev, 100)
        self.idx = torch.arange(1, B * w + 1, dtype=torch.int32, device=dev).view(B, w)
        # the round starts from the slot of the token accepted last round
        self.num_accepted = torch.full((B,), m, dtype=torch.int32, device=dev)
        self.src = self.idx[:, m - 1].long()
        self.dst = self.idx[:, 0].long()
        self.with_copy = with_copy

    def round(self):
        r = self.r
        for i in range(self.shape.layers):
            self.kernel(A_log=r.A_log[i], a=r.a[i], b=r.b[i], dt_bias=r.dt_bias[i],
                        q=r.q[i][None], k=r.k[i][None], v=r.v[i][None], initial_state=self.pools[i],
                        inplace_final_state=True, cu_seqlens=r.cu, ssm_state_indices=self.idx,
                        num_accepted_tokens=self.num_accepted, use_qk_l2norm_in_kernel=True)
            if self.with_copy:
                self.pools[i].index_copy_(0, self.dst, self.pools[i].index_select(0, self.src))


class FlaChunk:
    """fla's ``chunk_gated_delta_rule`` for every layer: outputs and final states, no rollback."""

    def __init__(self, shape: Shape, r: Round):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        self.fn, self.shape = chunk_gated_delta_rule, shape
        B, w, L = r.B, r.w, shape.layers
        self.gates = [gdn_gating(r.A_log[i], r.a[i], r.dt_bias[i], r.b[i]) for i in range(L)]
        per_seq = lambda t: t.view(B, w, *t.shape[1:])
        self.q = [per_seq(t) for t in r.q]
        self.k = [per_seq(t) for t in r.k]
        self.v = [per_seq(t) for t in r.v]
        self.g = [per_seq(g) for g, _ in self.gates]
        self.beta = [per_seq(b.to(torch.bfloat16)) for _, b in self.gates]
        # fla keeps states as [B, H, K, V]
        self.h0 = [torch.randn(B, shape.HV, shape.K, shape.V, device=r.device) * 0.2 for _ in range(L)]
        try:  # grouped value heads, if this fla supports them; else expand q, k to HV heads
            self._call(0)
        except Exception:  # noqa: BLE001
            g = shape.HV // shape.HK
            self.q = [t.repeat_interleave(g, dim=2) for t in self.q]
            self.k = [t.repeat_interleave(g, dim=2) for t in self.k]
            self._call(0)

    def _call(self, i):
        return self.fn(self.q[i], self.k[i], self.v[i], self.g[i], self.beta[i],
                       initial_state=self.h0[i], output_final_state=True,
                       use_qk_l2norm_in_kernel=True)

    def round(self):
        for i in range(self.shape.layers):
            self._call(i)


def check_accuracy(shape: Shape, w: int, B: int, verify_cfg: dict, commit_cfg: dict, device,
                   with_vllm: bool = True) -> dict:
    """Largest relative errors of our outputs and committed states (layer 0) over two consecutive
    rounds (commit w then ceil(w/2), and the reverse), against the float64 recurrence and vLLM's
    kernel (``None`` where vLLM is not run), per input dtype: ``{"fp32": {...}, "bf16": {...}}``."""
    one = shape.with_layers(1)
    kernel = load_vllm_spec_decode_gdn_kernel() if with_vllm else None
    res = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        worst = {e: (0.0 if with_vllm or e.endswith("fp64") else None) for e in ERRORS}
        for order in ((w, math.ceil(w / 2)), (math.ceil(w / 2), w)):
            ours = Unfused(one, B, device, seed=7, verify=verify_cfg, commit=commit_cfg)
            pool = ours.pools[0]
            ref_states = [pool[1 + b].double() for b in range(B)]
            idx = torch.arange(1, B * w + 1, dtype=torch.int32, device=device).view(B, w)
            vllm_pool = torch.zeros(B * w + 1, one.HV, one.V, one.K, device=device)
            vllm_pool[idx[:, 0].long()] = pool[1:B + 1]
            prev_accepted = torch.ones(B, dtype=torch.int32, device=device)
            for rnd, m in enumerate(order):
                r = Round(one, B, w, dtype, gen=1000 * rnd + w, device=device)
                out, m_dev = r.outputs(), torch.full((B,), m, dtype=torch.int32, device=device)
                ours.round(r, out, m_dev)
                if with_vllm:
                    o_v, _ = kernel(
                        A_log=r.A_log[0], a=r.a[0], b=r.b[0], dt_bias=r.dt_bias[0], q=r.q[0][None],
                        k=r.k[0][None], v=r.v[0][None], initial_state=vllm_pool, inplace_final_state=True,
                        cu_seqlens=r.cu, ssm_state_indices=idx, num_accepted_tokens=prev_accepted,
                        use_qk_l2norm_in_kernel=True)
                    _note(worst, "out_vs_vllm", rel_err(out[0], o_v[0]))
                prev_accepted = m_dev
                for b in range(B):
                    o_ref, states = r.reference(0, b, ref_states[b])
                    ref_states[b] = states[m - 1]
                    _note(worst, "out_vs_fp64", rel_err(out[0][b * w:(b + 1) * w], o_ref))
                    _note(worst, "state_vs_fp64", rel_err(pool[1 + b], states[m - 1]))
                    if with_vllm:
                        _note(worst, "state_vs_vllm", rel_err(pool[1 + b], vllm_pool[int(idx[b, m - 1])]))
        res[name] = worst
    return res


def _note(worst: dict, key: str, err: float) -> None:
    worst[key] = max(worst[key], err)


def accurate(acc: dict) -> bool:
    """fp32 inputs: every error <= 1e-4; bf16 inputs: outputs and states against float64 <= 5e-3."""
    fp32 = [e for e in acc["fp32"].values() if e is not None]
    return max(fp32) <= FP32_TOL and max(acc["bf16"]["out_vs_fp64"], acc["bf16"]["state_vs_fp64"]) <= BF16_TOL


def time_row(shape: Shape, r: Round, m: int, configs: dict, samples: int, with_vllm: bool,
             fla_ms: float | None, floors: dict) -> dict:
    """One table row at (w, B, m): our rounds (both verify kernels, the tf32x3 chunkwise round, the
    parts alone), vLLM with and without the copy, fla (timed by the caller: it has no m), floors."""
    chunk, rec, commit = configs["chunk"], configs["recurrent"], configs["commit"]

    def ours(verify, parts):
        o = Unfused(shape, r.B, r.device, seed=100, verify=verify, commit=commit)
        return o.timings(r, m, samples, parts)

    t_chunk = ours(chunk, ("round", "verify", "commit"))
    t_exact = ours(dict(chunk, precision="tf32x3", BK=64), ("round",))  # what fp32 inputs get
    t_rec = ours(rec, ("round", "verify"))
    nan = (float("nan"), float("nan"))
    t_vllm = t_vllm_copy = nan
    if with_vllm:
        t_vllm = graph_ms(VllmPath(shape, r, m, with_copy=False).round, samples)
        t_vllm_copy = graph_ms(VllmPath(shape, r, m, with_copy=True).round, samples)
    return dict(w=r.w, B=r.B, m=m, chunk=t_chunk["round"][0], chunk_iqr=t_chunk["round"][1],
                ours_tf32x3=t_exact["round"][0], chunk_verify=t_chunk["verify"][0],
                ours_commit=t_chunk["commit"][0], recurrent=t_rec["round"][0],
                recurrent_iqr=t_rec["round"][1], recurrent_verify=t_rec["verify"][0], vllm=t_vllm[0],
                vllm_iqr=t_vllm[1], vllm_copy=t_vllm_copy[0], fla=fla_ms, **floors)


def run(shape: Shape, lengths, batches, samples: int = 30, tune: bool = True, tune_recurrent: bool = False,
        ours_only: bool = False, device=None) -> dict:
    """The accuracy check on ``device`` (CUDA if there is one), then, on CUDA only, the launch
    tuning (``tune``, ``tune_recurrent``) and the timings. Returns ``{"meta", "accuracy", "results",
    "tune", "failed"}``: ``results`` are the rows of :func:`time_row` with what
    :func:`.report.with_default` derives (no rows without CUDA); ms throughout."""
    from .report import with_default
    from .tune import tune_compare, tune_recurrent_verify

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device == "cuda"
    t0 = time.time()
    meta = dict(device=torch.cuda.get_device_name() if on_cuda else "cpu", layers=shape.layers, HK=shape.HK,
                HV=shape.HV, K=shape.K, V=shape.V, samples=samples, torch=torch.__version__)
    vcfg, rcfg, ccfg, tune_rows = {}, {}, {}, []
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        bw = copy_bandwidth(samples)
        log(f"device: {meta['device']}; copy bandwidth (read + write) {bw / 1e12:.2f} TB/s")
        launch_ms = launch_floor_ms(shape.layers + 1, samples)
        log(f"launch floor: {shape.layers + 1} one-store kernels in one graph {launch_ms:.4f} ms")
        meta.update(copy_bandwidth_TBps=bw / 1e12, launch_floor_ms=launch_ms)
        if tune:
            vcfg, ccfg, tune_rows = tune_compare(shape, max(10, samples // 3))
        if tune_recurrent:
            rcfg, rec_rows = tune_recurrent_verify(shape, max(10, samples // 3))
            tune_rows += rec_rows
    configs = dict(chunk=dict(vcfg, method="chunk"), recurrent=dict(rcfg, method="recurrent"), commit=ccfg)
    meta.update(verify_config=vcfg, recurrent_config=rcfg, commit_config=ccfg)
    log(f"verify config {vcfg} (chunk), {rcfg} (recurrent), commit config {ccfg}")

    accuracy, results, failed = {}, [], []
    for w in lengths:
        for B in batches:
            for method in ("chunk", "recurrent"):
                acc = check_accuracy(shape, w, B, configs[method], ccfg, device, with_vllm=not ours_only)
                accuracy[f"w{w}_B{B}_{method}"] = acc
                ok = accurate(acc)
                log(f"accuracy {method} w={w} B={B}: {json.dumps(acc)} -> {'ok' if ok else 'FAILED'}")
                if not ok:
                    failed.append((method, w, B))
    fla_ok = not ours_only
    for w in lengths if on_cuda else ():
        for B in batches:
            r = Round(shape, B, w, gen=0, device=device)
            floor_verify = shape.layers * B * shape.state_bytes / bw * 1e3
            floor_commit = 2 * floor_verify
            floors = dict(floor=floor_verify + floor_commit, floor_verify=floor_verify,
                          floor_commit=floor_commit, launch_floor=launch_ms)
            fla_ms = None
            if fla_ok:
                try:
                    fla_ms = graph_ms(FlaChunk(shape, r).round, samples)[0]
                except Exception as e:  # noqa: BLE001 - reported, not hidden
                    log(f"fla failed at w={w} B={B}: {type(e).__name__}: {str(e)[:300]}")
                    fla_ok = False
            for m in sorted({w, math.ceil(w / 2)}, reverse=True):
                row = with_default(time_row(shape, r, m, configs, samples, not ours_only, fla_ms, floors))
                results.append(row)
                log(f"w={w:2d} B={B} m={m:2d}: ours {row['ours']:.4f} ms ({row['method']}; verify chunk "
                    f"{row['chunk_verify']:.4f} / recurrent {row['recurrent_verify']:.4f}"
                    f" + commit {row['ours_commit']:.4f}), vLLM {row['vllm']:.4f} "
                    f"({row['speedup_vs_vllm']:.2f}x), vLLM+copy {row['vllm_copy']:.4f}, fla "
                    f"{row['fla'] if row['fla'] is None else round(row['fla'], 4)}, floor "
                    f"{row['floor']:.4f} ({row['x_floor']:.2f}x floor)")
            torch.cuda.empty_cache()
    meta["seconds"] = time.time() - t0
    return dict(meta=meta, accuracy=accuracy, results=results, tune=tune_rows, failed=failed)
