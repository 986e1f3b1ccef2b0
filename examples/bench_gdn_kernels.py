"""GDN verification + commit at the Qwen3.6-35B-A3B shape: ours vs vLLM 0.26 vs fla (GPU only).

All 30 GDN layers (16 key heads, 32 value heads, 128 x 128 fp32 states), batch 1 and 4, round
lengths w in {2, 3, 4, 8, 12, 16}, committed tokens m = w and m = ceil(w / 2).  Variants, each
captured as one CUDA graph of a whole round and timed as the median of >= 30 samples of 10 replays:

* ours: ``gdn_verify`` for each of the 30 layers, then one ``gdn_commit`` for all layers;
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
a float64 torch reference (fp32 and bf16 inputs).

    python examples/bench_gdn_kernels.py --out docs/benchmarks/gdn_kernels.md --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from vllm_hybridspec.kernels.gdn import (
    StatePointers,
    VerifyFactors,
    gdn_commit,
    gdn_gating,
    gdn_verify,
    recurrent_gated_delta_rule,
)
from vllm_hybridspec.engine.gdn.vllm_path import load_vllm_spec_decode_gdn_kernel

LAYERS, HK, HV, K, V = 30, 16, 32, 128, 128
STATE_BYTES = HV * V * K * 4  # one layer's state of one sequence


def log(*a):
    print(*a, flush=True)


def median_time_ms(fn, samples: int, replays: int = 10) -> tuple[float, float]:
    """Median and interquartile spread (ms per call) of ``samples`` samples of ``replays`` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(replays):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[2] - q[0]


def graph_of(fn):
    """Capture ``fn`` (already warmed up) as a CUDA graph and return its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def copy_bandwidth(samples: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms, _ = median_time_ms(lambda: dst.copy_(src), samples, replays=5)
    return 2 * n / (ms * 1e-3)


@triton.jit
def _store_one(ptr):
    tl.store(ptr + tl.program_id(0), 1.0)


def launch_floor_ms(launches: int, samples: int) -> float:
    """Median replay time of one CUDA graph of ``launches`` dependent launches of a Triton kernel that
    stores one float."""
    buf = torch.zeros(1, device="cuda")

    def chain():
        for _ in range(launches):
            _store_one[(1,)](buf)

    chain()
    return median_time_ms(graph_of(chain), samples)[0]


class Round:
    """Random per-layer inputs of one verification round (bf16 projections, as in the model)."""

    def __init__(self, B: int, w: int, dtype=torch.bfloat16, gen_seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(gen_seed)
        T = B * w
        self.B, self.w, self.T = B, w, T

        def rn(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen, device="cuda") * std).to(dtype)

        self.q = [rn(T, HK, K) for _ in range(LAYERS)]
        self.k = [rn(T, HK, K) for _ in range(LAYERS)]
        self.v = [rn(T, HV, V) for _ in range(LAYERS)]
        self.a = [rn(T, HV) for _ in range(LAYERS)]
        self.b = [rn(T, HV, std=2.0) for _ in range(LAYERS)]
        self.A_log = [torch.log(1 + 15 * torch.rand(HV, generator=gen, device="cuda")) for _ in range(LAYERS)]
        self.dt_bias = [torch.randn(HV, generator=gen, device="cuda") * 0.5 - 2 for _ in range(LAYERS)]
        self.cu = torch.arange(0, T + 1, w, dtype=torch.int32, device="cuda")


def random_pool(slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(slots, HV, V, K, generator=gen, device="cuda") * 0.2


class Ours:
    def __init__(self, r: Round, m: int, verify_cfg: dict, commit_cfg: dict):
        B = r.B
        self.r = r
        self.pools = [random_pool(B + 1, 100 + i) for i in range(LAYERS)]
        self.ptrs = StatePointers(self.pools)
        self.slots = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
        self.m = torch.full((B,), m, dtype=torch.int32, device="cuda")
        self.factors = VerifyFactors.empty(r.T, HK, HV, K, V, "cuda", num_layers=LAYERS)
        self.out = [torch.empty_like(r.v[0]) for _ in range(LAYERS)]
        self.vc, self.cc = verify_cfg, commit_cfg

    def verify(self):
        r = self.r
        for i in range(LAYERS):
            gdn_verify(r.q[i], r.k[i], r.v[i], g=r.a[i], beta=r.b[i], A_log=r.A_log[i],
                       dt_bias=r.dt_bias[i], state=self.pools[i], state_indices=self.slots,
                       cu_seqlens=r.cu, max_len=r.w, out=self.out[i],
                       factors=self.factors.layer(i), **self.vc)

    def commit(self):
        gdn_commit(self.ptrs, self.factors, self.r.cu, self.slots, self.m, **self.cc)

    def round(self):
        self.verify()
        self.commit()


class VllmPath:
    """vLLM 0.26's spec-decode GDN call, 30 layers, with state slots [B, w] per layer."""

    def __init__(self, r: Round, m: int, with_copy: bool):
        self.kernel = load_vllm_spec_decode_gdn_kernel()
        B, w = r.B, r.w
        self.r = r
        self.pools = [random_pool(B * w + 1, 100 + i) for i in range(LAYERS)]
        self.idx = torch.arange(1, B * w + 1, dtype=torch.int32, device="cuda").view(B, w)
        # the round starts from the slot of the token accepted last round
        self.num_accepted = torch.full((B,), m, dtype=torch.int32, device="cuda")
        self.src = self.idx[:, m - 1].long()
        self.dst = self.idx[:, 0].long()
        self.with_copy = with_copy
        self.out = [None] * LAYERS

    def round(self):
        r = self.r
        for i in range(LAYERS):
            self.out[i], _ = self.kernel(
                A_log=r.A_log[i], a=r.a[i], b=r.b[i], dt_bias=r.dt_bias[i],
                q=r.q[i][None], k=r.k[i][None], v=r.v[i][None], initial_state=self.pools[i],
                inplace_final_state=True, cu_seqlens=r.cu, ssm_state_indices=self.idx,
                num_accepted_tokens=self.num_accepted, use_qk_l2norm_in_kernel=True)
            if self.with_copy:
                self.pools[i].index_copy_(0, self.dst, self.pools[i].index_select(0, self.src))


class FlaChunk:
    def __init__(self, r: Round):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        self.fn = chunk_gated_delta_rule
        B, w = r.B, r.w
        self.gates = [gdn_gating(r.A_log[i], r.a[i], r.dt_bias[i], r.b[i]) for i in range(LAYERS)]
        shape = lambda t: t.view(B, w, *t.shape[1:])  # noqa: E731
        self.q = [shape(t) for t in r.q]
        self.k = [shape(t) for t in r.k]
        self.v = [shape(t) for t in r.v]
        self.g = [shape(g) for g, _ in self.gates]
        self.beta = [shape(b.to(torch.bfloat16)) for _, b in self.gates]
        # fla keeps states as [B, H, K, V]
        self.h0 = [torch.randn(B, HV, K, V, device="cuda") * 0.2 for _ in range(LAYERS)]
        try:  # grouped value heads, if this fla supports them; else expand q, k to HV heads
            self._call(0)
        except Exception:  # noqa: BLE001
            g = HV // HK
            self.q = [t.repeat_interleave(g, dim=2) for t in self.q]
            self.k = [t.repeat_interleave(g, dim=2) for t in self.k]
            self._call(0)

    def _call(self, i):
        return self.fn(self.q[i], self.k[i], self.v[i], self.g[i], self.beta[i],
                       initial_state=self.h0[i], output_final_state=True,
                       use_qk_l2norm_in_kernel=True)

    def round(self):
        for i in range(LAYERS):
            self._call(i)


def check_accuracy(w: int, B: int, verify_cfg: dict, commit_cfg: dict, with_vllm: bool = True) -> dict:
    """Two consecutive rounds (commit w then ceil(w/2), and the reverse) vs vLLM and fp64 torch."""
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        worst = {"out_vs_fp64": 0.0, "state_vs_fp64": 0.0, "out_vs_vllm": 0.0, "state_vs_vllm": 0.0}
        for order in ((w, math.ceil(w / 2)), (math.ceil(w / 2), w)):
            vllm_kernel = load_vllm_spec_decode_gdn_kernel() if with_vllm else None
            pool0 = random_pool(B + 1, 7)
            ours_pool = pool0.clone()
            ref_states = [pool0[1 + b].double() for b in range(B)]
            vllm_pool = torch.zeros(B * w + 1, HV, V, K, device="cuda")
            idx = torch.arange(1, B * w + 1, dtype=torch.int32, device="cuda").view(B, w)
            vllm_pool[idx[:, 0].long()] = pool0[1:B + 1]
            prev_acc = torch.ones(B, dtype=torch.int32, device="cuda")
            slots = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
            for rnd, m in enumerate(order):
                r = Round(B, w, dtype=dtype, gen_seed=1000 * rnd + w)
                o, f = gdn_verify(r.q[0], r.k[0], r.v[0], g=r.a[0], beta=r.b[0], A_log=r.A_log[0],
                                  dt_bias=r.dt_bias[0], state=ours_pool, state_indices=slots,
                                  cu_seqlens=r.cu, max_len=w, **verify_cfg)
                if with_vllm:
                    o_v, _ = vllm_kernel(
                        A_log=r.A_log[0], a=r.a[0], b=r.b[0], dt_bias=r.dt_bias[0], q=r.q[0][None],
                        k=r.k[0][None], v=r.v[0][None], initial_state=vllm_pool, inplace_final_state=True,
                        cu_seqlens=r.cu, ssm_state_indices=idx, num_accepted_tokens=prev_acc,
                        use_qk_l2norm_in_kernel=True)
                gdn_commit([ours_pool], VerifyFactors(f.z[None], f.k[None], f.g_cum[None]), r.cu,
                           slots, torch.full((B,), m, dtype=torch.int32, device="cuda"), **commit_cfg)
                prev_acc = torch.full((B,), m, dtype=torch.int32, device="cuda")
                g, beta = gdn_gating(r.A_log[0].double(), r.a[0].double(), r.dt_bias[0].double(),
                                     r.b[0].double())
                rel = lambda x, y: ((x.double() - y.double()).norm() / y.double().norm()).item()  # noqa: E731
                if with_vllm:
                    worst["out_vs_vllm"] = max(worst["out_vs_vllm"], rel(o, o_v[0]))
                for b in range(B):
                    s = slice(b * w, (b + 1) * w)
                    o_ref, st = recurrent_gated_delta_rule(r.q[0][s].double(), r.k[0][s].double(),
                                                           r.v[0][s].double(), g[s], beta[s], ref_states[b])
                    ref_states[b] = st[m - 1]
                    worst["out_vs_fp64"] = max(worst["out_vs_fp64"], rel(o[s], o_ref))
                    worst["state_vs_fp64"] = max(worst["state_vs_fp64"], rel(ours_pool[1 + b], st[m - 1]))
                    if with_vllm:
                        worst["state_vs_vllm"] = max(worst["state_vs_vllm"],
                                                     rel(ours_pool[1 + b], vllm_pool[int(idx[b, m - 1])]))
        res["fp32" if dtype == torch.float32 else "bf16"] = worst
    return res


def tune(samples: int) -> tuple[dict, dict, list]:
    """Pick the launch configuration of verify and commit (batch 1 and 4, summed)."""
    rows = []

    def verify_time(cfg, w):
        t = 0.0
        for B in (1, 4):
            o = Ours(Round(B, w), w, dict(cfg, method="chunk"), {})
            o.verify()
            t += median_time_ms(graph_of(o.verify), samples)[0]
        return t

    best_v = None
    candidates = [dict(BV=BV, BK=BK, num_warps=nw, precision=prec)
                  for prec, BV, BK, nw in itertools.product(("ieee", "tf32x3"), (32, 64, 128), (32, 64), (4, 8))]
    for cfg in candidates:
        try:
            t = verify_time(cfg, 16)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile
            log(f"tune verify {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(("verify", cfg, t))
        log(f"tune verify {cfg}: {t:.4f} ms (B=1 + B=4, w=16)")
        if best_v is None or t < best_v[1]:
            best_v = (cfg, t)
    vcfg = dict(best_v[0])
    # the triangular inverse: substitution (u - 1 steps) or product series, by round length
    series_from = 17
    for w in (16, 12, 8, 4):
        t_rows = verify_time(dict(vcfg, series_from=17), w)
        t_series = verify_time(dict(vcfg, series_from=0), w)
        rows.append(("inverse", dict(w=w, rows=t_rows, series=t_series), min(t_rows, t_series)))
        log(f"tune inverse at w={w}: substitution {t_rows:.4f} ms, series {t_series:.4f} ms")
        if t_series < t_rows:
            series_from = w
    vcfg["series_from"] = series_from
    best_c = None
    for BV, BK, nw in ((16, 32, 2), (32, 32, 2), (32, 64, 2), (64, 32, 2), (64, 64, 4), (32, 64, 4)):
        cfg = dict(BV=BV, BK=BK, num_warps=nw, precision="ieee")
        try:
            t = 0.0
            for B in (1, 4):
                o = Ours(Round(B, 16), 16, vcfg, cfg)
                o.verify()
                o.commit()
                t += median_time_ms(graph_of(o.commit), samples)[0]
        except Exception as e:  # noqa: BLE001
            log(f"tune commit {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(("commit", cfg, t))
        log(f"tune commit {cfg}: {t:.4f} ms (B=1 + B=4, w=16)")
        if best_c is None or t < best_c[1]:
            best_c = (cfg, t)
    return vcfg, best_c[0], rows


RECURRENT_CANDIDATES = [dict(BV=bv, num_warps=nw) for bv, nw in
                        ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8))]


def tune_recurrent(samples: int, lengths=(2, 3, 4), batches=(1, 4)) -> tuple[dict, list]:
    """Launch configuration of the recurrent verify kernel: every candidate at each (w, B), 30 layers;
    the one with the least time summed over all of them is returned with the table."""
    rows, total = [], {}
    for cfg in RECURRENT_CANDIDATES:
        key = json.dumps(cfg)
        for w, B in itertools.product(lengths, batches):
            vc = dict(cfg, method="recurrent")
            try:
                o = Ours(Round(B, w), w, vc, {})
                o.verify()
                t = median_time_ms(graph_of(o.verify), samples)[0]
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile
                log(f"tune recurrent {cfg} w={w} B={B} failed: {type(e).__name__}: {str(e)[:200]}")
                total[key] = float("inf")
                continue
            rows.append(("recurrent", dict(cfg, w=w, B=B), t))
            total[key] = total.get(key, 0.0) + t
            log(f"tune recurrent {cfg} w={w} B={B}: verify {t:.4f} ms")
    best = min(total, key=total.get)
    if total[best] == float("inf"):
        raise RuntimeError("tune recurrent: no candidate configuration ran")
    log(f"tune recurrent: best {best} ({total[best]:.4f} ms summed)")
    return json.loads(best), rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="markdown report to write")
    p.add_argument("--json", type=Path, help="raw results to write")
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--lengths", type=int, nargs="+", default=[2, 3, 4, 8, 12, 16])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--no-tune", action="store_true", help="use the default launch configuration")
    p.add_argument("--render", type=Path, help="only re-render --out from a --json file of an earlier run")
    p.add_argument("--tune-recurrent", action="store_true",
                   help="choose the recurrent verify kernel's launch configuration in this run")
    p.add_argument("--ours-only", action="store_true",
                   help="time only our kernels (no vLLM or fla needed): for tuning")
    args = p.parse_args(argv)
    if args.render:
        data = json.loads(args.render.read_text())
        (args.out or Path("/dev/stdout")).write_text(
            render_markdown(data["meta"], data["accuracy"], data["results"]))
        return 0
    if not torch.cuda.is_available():
        print("bench_gdn_kernels needs a CUDA GPU (with vLLM 0.26 and fla-core installed)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth(args.samples)
    log(f"device: {dev}; copy bandwidth (read + write) {bw / 1e12:.2f} TB/s")
    launch_ms = launch_floor_ms(LAYERS + 1, args.samples)
    log(f"launch floor: {LAYERS + 1} one-store kernels in one graph {launch_ms:.4f} ms")
    if args.no_tune:
        vcfg, ccfg, tune_rows = dict(), dict(), []
    else:
        vcfg, ccfg, tune_rows = tune(max(10, args.samples // 3))
    rcfg, rec_rows = dict(), []
    if args.tune_recurrent:
        rcfg, rec_rows = tune_recurrent(max(10, args.samples // 3))
        tune_rows += rec_rows
    chunk_cfg, rec_cfg = dict(vcfg, method="chunk"), dict(rcfg, method="recurrent")
    log(f"verify config {vcfg} (chunk), {rcfg} (recurrent), commit config {ccfg}")

    accuracy, results, failed = {}, [], []
    fla_ok = not args.ours_only
    nan = (float("nan"), float("nan"))
    for w in args.lengths:
        for B in args.batches:
            for method, cfg in (("chunk", chunk_cfg), ("recurrent", rec_cfg)):
                acc = check_accuracy(w, B, cfg, ccfg, with_vllm=not args.ours_only)
                accuracy[f"w{w}_B{B}_{method}"] = acc
                ok = (max(acc["fp32"].values()) <= 1e-4 and max(acc["bf16"]["out_vs_fp64"],
                      acc["bf16"]["state_vs_fp64"]) <= 5e-3)
                log(f"accuracy {method} w={w} B={B}: {json.dumps(acc)} -> {'ok' if ok else 'FAILED'}")
                if not ok:
                    failed.append((method, w, B))
    for w in args.lengths:
        for B in args.batches:
            r = Round(B, w)
            floor_verify = LAYERS * B * STATE_BYTES / bw * 1e3
            floor_commit = 2 * LAYERS * B * STATE_BYTES / bw * 1e3
            fla_ms = None
            if fla_ok:
                try:
                    fla = FlaChunk(r)
                    fla_ms = median_time_ms(graph_of(fla.round), args.samples)
                    del fla
                except Exception as e:  # noqa: BLE001 - reported, not hidden
                    log(f"fla failed at w={w} B={B}: {type(e).__name__}: {str(e)[:300]}")
                    fla_ok = False
            for m in sorted({w, math.ceil(w / 2)}, reverse=True):
                ours = Ours(r, m, chunk_cfg, ccfg)
                ours.round()
                t_round = median_time_ms(graph_of(ours.round), args.samples)
                t_verify = median_time_ms(graph_of(ours.verify), args.samples)
                # the same round with fp32-accurate products (what fp32 inputs get)
                exact = Ours(r, m, dict(chunk_cfg, precision="tf32x3", BK=64), ccfg)
                exact.round()
                t_exact = median_time_ms(graph_of(exact.round), args.samples)
                del exact
                t_commit = median_time_ms(graph_of(ours.commit), args.samples)
                rec = Ours(r, m, rec_cfg, ccfg)
                rec.round()
                t_rec_round = median_time_ms(graph_of(rec.round), args.samples)
                t_rec_verify = median_time_ms(graph_of(rec.verify), args.samples)
                del rec
                t_vllm = t_vllm_copy = nan
                if not args.ours_only:
                    vl = VllmPath(r, m, with_copy=False)
                    vl.round()
                    t_vllm = median_time_ms(graph_of(vl.round), args.samples)
                    vlc = VllmPath(r, m, with_copy=True)
                    vlc.round()
                    t_vllm_copy = median_time_ms(graph_of(vlc.round), args.samples)
                    del vl, vlc
                row = dict(w=w, B=B, m=m, chunk=t_round[0], chunk_iqr=t_round[1], ours_tf32x3=t_exact[0],
                           chunk_verify=t_verify[0], ours_commit=t_commit[0],
                           recurrent=t_rec_round[0], recurrent_iqr=t_rec_round[1],
                           recurrent_verify=t_rec_verify[0],
                           vllm=t_vllm[0], vllm_iqr=t_vllm[1], vllm_copy=t_vllm_copy[0],
                           fla=fla_ms[0] if fla_ms else None,
                           floor=floor_verify + floor_commit, floor_verify=floor_verify,
                           floor_commit=floor_commit)
                row["launch_floor"] = launch_ms
                with_default(row)
                results.append(row)
                log(f"w={w:2d} B={B} m={m:2d}: ours {row['ours']:.4f} ms ({row['method']}; verify chunk "
                    f"{row['chunk_verify']:.4f} / recurrent {row['recurrent_verify']:.4f}"
                    f" + commit {row['ours_commit']:.4f}), vLLM {row['vllm']:.4f} "
                    f"({row['speedup_vs_vllm']:.2f}x), vLLM+copy {row['vllm_copy']:.4f}, fla "
                    f"{row['fla'] if row['fla'] is None else round(row['fla'], 4)}, floor "
                    f"{row['floor']:.4f} ({row['x_floor']:.2f}x floor)")
                del ours
            torch.cuda.empty_cache()
    meta = dict(device=dev, copy_bandwidth_TBps=bw / 1e12, launch_floor_ms=launch_ms, verify_config=vcfg,
                recurrent_config=rcfg, commit_config=ccfg,
                layers=LAYERS, HK=HK, HV=HV, K=K, V=V, samples=args.samples,
                torch=torch.__version__, seconds=time.time() - t0, command=" ".join(sys.argv))
    if args.json:
        # raw timings only: what the rows derive from the library's current rule is recomputed on render
        raw = [{k: v for k, v in r.items() if k not in DERIVED} for r in results]
        args.json.write_text(json.dumps(dict(meta=meta, accuracy=accuracy, results=raw,
                                             tune=[(k, c, t) for k, c, t in tune_rows]), indent=1))
    if args.out:
        args.out.write_text(render_markdown(meta, accuracy, results))
    log(f"done in {time.time() - t0:.0f} s")
    if failed:
        log(f"ACCURACY CHECK FAILED at (kernel, w, B) = {failed}")
        return 1
    return 0


DERIVED = ("ours", "ours_verify", "method", "speedup_vs_vllm", "x_floor", "x_launch_floor")


def verify_rule() -> str:
    from vllm_hybridspec.kernels.gdn import verify

    return ", ".join(f"{w} from {n} sequence{'s' if n > 1 else ''}" for n, w in sorted(verify.RECURRENT_UP_TO.items()))


def with_default(row: dict) -> dict:
    """Fill ``ours`` (the round of the method ``gdn_verify``'s "auto" picks for this length, with the
    library's current ``recurrent_up_to``) and the ratios from it. Rows of runs before the recurrent
    kernel existed keep their ``ours`` (the chunkwise kernel)."""
    from vllm_hybridspec.kernels.gdn import verify

    if "recurrent" in row:
        row["method"] = "recurrent" if row["w"] <= verify.recurrent_up_to(row["B"]) else "chunk"
        row["ours"] = row[row["method"]]
        row["ours_verify"] = row[f"{row['method']}_verify"]
    row["speedup_vs_vllm"] = row["vllm"] / row["ours"]
    row["x_floor"] = row["ours"] / row["floor"]
    row["x_launch_floor"] = row["ours"] / row["launch_floor"] if row.get("launch_floor") else None
    return row


def render_markdown(meta, accuracy, results) -> str:
    results = [with_default(dict(r)) for r in results]
    lines = [
        "# GDN verification + commit: ours vs vLLM 0.26 vs fla",
        "",
        f"Measured on {meta['device']} (torch {meta['torch']}) with",
        "",
        "```",
        f"python examples/bench_gdn_kernels.py {' '.join(meta['command'].split()[1:])}",
        "```",
        "",
        f"Shape: Qwen3.6-35B-A3B GDN, {meta['layers']} layers, {meta['HK']} key heads, {meta['HV']} value "
        f"heads, {meta['K']}x{meta['V']} fp32 states; bf16 projections as inputs.  Times are ms for a "
        f"whole round of all {meta['layers']} layers, each variant captured as one CUDA graph, median of "
        f"{meta['samples']} samples of 10 replays.  Copy bandwidth measured in the same run: "
        f"{meta['copy_bandwidth_TBps']:.2f} TB/s (read + write).  The floor is the time to read S0 once "
        "(verify) plus read S0 and write S_m once (commit) at that bandwidth."
        + (f"  Launch floor, same run: {meta['layers'] + 1} launches of a kernel that stores one float, in one "
           f"CUDA graph, take {meta['launch_floor_ms']:.4f} ms (one verify per layer and one commit cost at "
           "least that much, however little each kernel does)." if "launch_floor_ms" in meta else ""),
        "",
        "- ours: `gdn_verify` per layer (no per-token state) + one `gdn_commit` for all layers. `gdn_verify` "
        "has two kernels with the same outputs and factors: 'chunk' (all w tokens in one set of matrix "
        "products, Eq. 3, with the default `precision=\"auto\"`: tf32 products for these bf16 inputs) and "
        "'recurrent' (the recurrence stepped on a register copy of S0, no state written; fp32 arithmetic). "
        "The 'ours' column is the method the library's `method=\"auto\"` picks at that length "
        f"(recurrent for w <= {verify_rule()}, else chunk); the verify columns time each kernel alone. "
        "'chunk, tf32x3' is the chunkwise round with fp32-accurate products, what fp32 inputs get. "
        "Launch configuration: "
        + (f"chosen in the same run: chunk `{meta['verify_config']}`" if meta["verify_config"]
           else "chunk: the library defaults (chosen by earlier `--ours-only` tuning runs, gdn_kernels_tuning.log)")
        + (f"; recurrent `{meta['recurrent_config']}` (chosen in the same run)" if meta.get("recurrent_config")
           else "; recurrent: the library defaults")
        + (f"; commit `{meta['commit_config']}`." if meta["commit_config"] else "; commit: the library defaults."),
        "- vLLM: `fused_sigmoid_gating_delta_rule_update` exactly as vLLM 0.26's Qwen GDN layer calls it "
        "when speculating (state slots [B, w], one state written per token; the round reads the slot of "
        "the previously accepted token, so vLLM's default mode needs no copy); vLLM+copy adds the copy of "
        "the accepted slot that prefix-caching align mode makes.",
        "- fla: `chunk_gated_delta_rule` (fla-core 0.6.0), output + final state only (it cannot roll back "
        "to m < w), gates precomputed outside the graph.",
        "",
    ]
    split = "recurrent" in results[0] if results else False
    if split:
        lines += [
            "| w | B | m | ours | method | verify: chunk | verify: recurrent | commit | chunk, tf32x3 | vLLM | "
            "vLLM+copy | fla | floor | ours vs vLLM | ours / floor | ours / launch floor |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines += [
            "| w | B | m | ours | verify | commit | ours, tf32x3 | vLLM | vLLM+copy | fla | floor | ours vs vLLM | ours / floor |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in results:
        fla = "-" if r["fla"] is None else f"{r['fla']:.4f}"
        if split:
            lines.append(
                f"| {r['w']} | {r['B']} | {r['m']} | {r['ours']:.4f} | {r['method']} | {r['chunk_verify']:.4f} | "
                f"{r['recurrent_verify']:.4f} | {r['ours_commit']:.4f} | {r['ours_tf32x3']:.4f} | {r['vllm']:.4f} | "
                f"{r['vllm_copy']:.4f} | {fla} | {r['floor']:.4f} | {r['speedup_vs_vllm']:.2f}x | "
                f"{r['x_floor']:.2f}x | {r['x_launch_floor']:.2f}x |")
            continue
        lines.append(
            f"| {r['w']} | {r['B']} | {r['m']} | {r['ours']:.4f} | {r['ours_verify']:.4f} | "
            f"{r['ours_commit']:.4f} | {r.get('ours_tf32x3', float('nan')):.4f} | {r['vllm']:.4f} | {r['vllm_copy']:.4f} | {fla} | {r['floor']:.4f} | "
            f"{r['speedup_vs_vllm']:.2f}x | {r['x_floor']:.2f}x |")
    lines += ["", "Accuracy, checked before timing (largest relative Frobenius error over two rounds that "
              "commit w then ceil(w/2) and the reverse; layer 0):", "",
              "| w | B | kernel | inputs | out vs fp64 | state vs fp64 | out vs vLLM | state vs vLLM |",
              "|---|---|---|---|---|---|---|---|"]
    for key, acc in accuracy.items():
        w, rest = key[1:].split("_B")
        B, _, method = rest.partition("_")
        for dt, e in acc.items():
            lines.append(f"| {w} | {B} | {method or 'chunk'} | {dt} | {e['out_vs_fp64']:.1e} | "
                         f"{e['state_vs_fp64']:.1e} | {e['out_vs_vllm']:.1e} | {e['state_vs_vllm']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
