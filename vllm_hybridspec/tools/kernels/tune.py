"""Launch-configuration sweeps of our GDN kernels at the 35B shape (CUDA only, no vLLM needed).

Each candidate is timed with all 30 layers in one CUDA graph (:mod:`.timing`); a candidate that
does not compile (too many registers, shared memory) is logged and passed over.

* :func:`sweep_parts` (``hybridspec kernels tune --out tune.jsonl``): where the comparison misses its
  targets (batch 4: w = 2 against vLLM; w = 16 against 4x vLLM and the bandwidth floor), each
  candidate configuration of the commit, the chunkwise verify and the recurrent verify alone, median
  of ``--samples`` samples of 10 replays. Writes one JSON line per measurement and prints the
  fastest per (part, w, B).
* :func:`tune_compare` and :func:`tune_recurrent_verify`: the launch configuration
  ``hybridspec kernels compare`` chooses in its own run (unless ``--no-tune``; the recurrent kernel's
  with ``--tune-recurrent``).
* :func:`tune_fused` (``hybridspec kernels fused --tune``): the fused lazy-commit round at every
  candidate of :data:`FUSED`, bf16 inputs, steady state m = w.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import torch

from .fused_round import steady_state
from .shapes import Round, Shape, Unfused
from .timing import graph_ms, log

# sweep_parts: candidates of each part and the (w, B) it is timed at
COMMIT = [dict(BV=bv, BK=bk, num_warps=nw, precision=p) for bv, bk, nw, p in (
    (32, 64, 2, "ieee"), (64, 128, 4, "ieee"), (64, 128, 8, "ieee"), (128, 128, 8, "ieee"), (32, 128, 4, "ieee"),
    (16, 128, 2, "ieee"), (32, 64, 2, "tf32"), (64, 64, 4, "tf32"), (64, 32, 2, "ieee"), (128, 64, 4, "ieee"))]
CHUNK = [dict(method="chunk", BV=bv, BK=bk, num_warps=nw) for bv, bk, nw in (
    (64, 128, 4), (128, 128, 8), (128, 64, 8), (128, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8), (32, 64, 2),
    (32, 128, 2), (16, 128, 2), (16, 128, 1), (16, 64, 1))] + [
    dict(method="chunk", BV=bv, BK=128, num_warps=nw, series_from=9) for bv, nw in ((64, 4), (32, 2), (16, 1))]
RECURRENT = [dict(method="recurrent", BV=bv, num_warps=nw) for bv, nw in (
    (8, 1), (4, 1), (16, 1), (8, 2), (32, 8), (128, 4), (2, 1), (16, 2), (32, 4))]
CASES = {"commit": [(2, 4), (16, 4), (2, 1)], "chunk": [(16, 4), (3, 4), (16, 1), (2, 4)],
         "recurrent": [(2, 4), (3, 4), (2, 1)]}
# tune_recurrent_verify's candidates
RECURRENT_CANDIDATES = [dict(BV=bv, num_warps=nw) for bv, nw in
                        ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8))]
# tune_fused: value rows per program and warps (and the key chunk), per method
FUSED = {"chunk": [dict(BV=BV, num_warps=nw, BK=BK)
                   for BV in (16, 32, 64) for nw in (2, 4, 8) for BK in (64, 128)],
         "recurrent": [dict(BV=BV, num_warps=nw) for BV in (4, 8, 16) for nw in (1, 2, 4)]}


def ours_ms(shape: Shape, B: int, w: int, part: str, samples: int, verify: dict | None = None,
            commit: dict | None = None) -> float:
    """ms of ``part`` ("round", "verify" or "commit") of our unfused round at (w, B), m = w."""
    o = Unfused(shape, B, "cuda", seed=100, verify=verify, commit=commit)
    return o.timings(Round(shape, B, w), w, samples, (part,))[part].ms


def _or_none(label: str, measure, *args) -> float | None:
    """``measure(*args)``, or ``None`` (logged) where the configuration fails, e.g. does not compile."""
    try:
        return measure(*args)
    except Exception as e:  # noqa: BLE001 - a configuration that does not compile
        log(f"{label}: failed {type(e).__name__}: {str(e)[:200]}")
        return None


def sweep_parts(shape: Shape, out: Path, samples: int = 15) -> dict:
    """Every candidate of :data:`COMMIT`, :data:`CHUNK`, :data:`RECURRENT` at its :data:`CASES`; one JSON
    line ``{"part", "w", "B", "cfg", "ms"}`` per measurement to ``out``; returns the fastest
    ``{(part, w, B): (cfg, ms)}``."""
    from vllm_hybridspec.policy.files import write_text_atomic

    torch.backends.cuda.matmul.allow_tf32 = False
    best, lines = {}, []
    for part, configs in (("commit", COMMIT), ("chunk", CHUNK), ("recurrent", RECURRENT)):
        timed = "commit" if part == "commit" else "verify"
        for w, B in CASES[part]:
            for cfg in configs:
                verify, commit = ({}, cfg) if part == "commit" else (cfg, {})
                ms = _or_none(f"{part} w={w} B={B} {cfg}", ours_ms, shape, B, w, timed, samples,
                              verify, commit)
                if ms is None:
                    continue
                lines.append(json.dumps(dict(part=part, w=w, B=B, cfg=cfg, ms=ms)) + "\n")
                # the whole file again, beside and renamed, after every measurement: a sweep stopped
                # midway leaves every line measured so far and never half a line
                write_text_atomic(out, "".join(lines))
                log(f"{part} w={w} B={B} {cfg}: {ms:.4f} ms")
                if (part, w, B) not in best or ms < best[part, w, B][1]:
                    best[part, w, B] = (cfg, ms)
            torch.cuda.empty_cache()
    for (part, w, B), (cfg, ms) in best.items():
        log(f"best {part} w={w} B={B}: {cfg} {ms:.4f} ms")
    return best


def tune_compare(shape: Shape, samples: int) -> tuple[dict, dict, list]:
    """The launch configuration of the chunkwise verify and the commit (times summed over batch 1 and
    4): verify at w = 16, then the triangular inverse's method per round length, then the commit.
    Returns ``(verify_config, commit_config, rows)``."""
    rows = []

    def verify_time(cfg, w):
        return sum(ours_ms(shape, B, w, "verify", samples, dict(cfg, method="chunk")) for B in (1, 4))

    def commit_time(cfg):
        return sum(ours_ms(shape, B, 16, "commit", samples, dict(vcfg, method="chunk"), cfg) for B in (1, 4))

    candidates = [dict(BV=BV, BK=BK, num_warps=nw, precision=prec)
                  for prec, BV, BK, nw in itertools.product(("ieee", "tf32x3"), (32, 64, 128), (32, 64), (4, 8))]
    vcfg = dict(_fastest("verify", candidates, functools.partial(verify_time, w=16), rows))
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
    candidates = [dict(BV=BV, BK=BK, num_warps=nw, precision="ieee")
                  for BV, BK, nw in ((16, 32, 2), (32, 32, 2), (32, 64, 2), (64, 32, 2), (64, 64, 4), (32, 64, 4))]
    return vcfg, _fastest("commit", candidates, commit_time, rows), rows


def _fastest(part: str, candidates: list[dict], measure, rows: list) -> dict:
    """The candidate of least ``measure(cfg)`` (B = 1 + B = 4 at w = 16); each one timed is added to
    ``rows``."""
    best = None
    for cfg in candidates:
        t = _or_none(f"tune {part} {cfg}", measure, cfg)
        if t is None:
            continue
        rows.append((part, cfg, t))
        log(f"tune {part} {cfg}: {t:.4f} ms (B=1 + B=4, w=16)")
        if best is None or t < best[1]:
            best = (cfg, t)
    if best is None:
        raise RuntimeError(f"tune {part}: no candidate configuration ran")
    return best[0]


def tune_recurrent_verify(shape: Shape, samples: int, lengths=(2, 3, 4), batches=(1, 4)) -> tuple[dict, list]:
    """Launch configuration of the recurrent verify kernel: every candidate at each (w, B); the one
    with the least time summed over all of them is returned with the table."""
    rows, total = [], {}
    for cfg in RECURRENT_CANDIDATES:
        key = json.dumps(cfg)
        for w, B in itertools.product(lengths, batches):
            t = _or_none(f"tune recurrent {cfg} w={w} B={B}", ours_ms, shape, B, w, "verify", samples,
                         dict(cfg, method="recurrent"))
            if t is None:
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


def tune_fused(shape: Shape, batches, lengths, samples: int, replays: int) -> list[dict]:
    """The fused round at every launch candidate of :data:`FUSED` (bf16 inputs, steady state m = w):
    one dict per (B, w, method, BV, num_warps) with its ms; the fastest per (B, w) is printed."""
    rows = []
    for B in batches:
        for w in lengths:
            here = []
            for method, candidates in FUSED.items():
                fused, r, out = steady_state(shape, B, w, method)
                for launch in candidates:
                    ms = graph_ms(functools.partial(fused.round, r, out, **launch), samples, replays).ms
                    here.append(dict(B=B, w=w, method=method, **launch, ms=ms))
            best = min(here, key=lambda x: x["ms"])
            log(f"tune B={B} w={w}: best {best} ; " + ", ".join(
                f"{x['method'][0]}{x['BV']}/{x['num_warps']}/{x.get('BK', '-')}:{x['ms']:.3f}" for x in here))
            rows += here
            torch.cuda.empty_cache()
    return rows
