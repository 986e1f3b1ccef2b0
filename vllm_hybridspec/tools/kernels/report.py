"""The markdown report of :mod:`.gdn_compare` (``docs/benchmarks/gdn_kernels.md``), from a run's
results or again from its JSON:

    hybridspec kernels render out.json --out docs/benchmarks/gdn_kernels.md

The JSON keeps raw timings only; what a row derives from the library's current rule (the method
``gdn_verify``'s ``method="auto"`` picks at that length, and the ratios from it) is recomputed on
every render, so an old run re-rendered reads under today's rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from .shapes import SHAPES

DERIVED = ("ours", "ours_verify", "method", "speedup_vs_vllm", "x_floor", "x_launch_floor")


def raw_results(results: list[dict]) -> list[dict]:
    """The rows without what :func:`with_default` derives (what the JSON keeps)."""
    return [{k: v for k, v in r.items() if k not in DERIVED} for r in results]


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


def _command(meta: dict) -> str:
    command = meta["command"]
    if command.startswith("hybridspec"):
        return command
    # runs of examples/bench_gdn_kernels.py kept argv as it was: the script, then its arguments
    return f"python examples/bench_gdn_kernels.py {' '.join(command.split()[1:])}"


def _err(e) -> str:
    return "-" if e is None or (isinstance(e, float) and math.isnan(e)) else f"{e:.1e}"


def render_markdown(meta: dict, accuracy: dict, results: list[dict]) -> str:
    results = [with_default(dict(r)) for r in results]
    dims = (meta["layers"], meta["HK"], meta["HV"], meta["K"], meta["V"])
    model = "Qwen3.6-35B-A3B GDN, " if dims == dataclasses.astuple(SHAPES["35b"]) else ""
    lines = [
        "# GDN verification + commit: ours vs vLLM 0.26 vs fla",
        "",
        f"Measured on {meta['device']} (torch {meta['torch']}) with",
        "",
        "```",
        _command(meta),
        "```",
        "",
        f"Shape: {model}{meta['layers']} layers, {meta['HK']} key heads, {meta['HV']} value "
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
            lines.append(f"| {w} | {B} | {method or 'chunk'} | {dt} | {_err(e['out_vs_fp64'])} | "
                         f"{_err(e['state_vs_fp64'])} | {_err(e['out_vs_vllm'])} | {_err(e['state_vs_vllm'])} |")
    return "\n".join(lines) + "\n"


def render_file(path: Path) -> str:
    """The report of a run from the JSON that ``hybridspec kernels compare --json`` wrote."""
    data = json.loads(Path(path).read_text())
    if not data["results"]:
        raise ValueError(f"{path} has no timings (a run without CUDA checks accuracy only): nothing to render")
    return render_markdown(data["meta"], data["accuracy"], data["results"])
