"""``hybridspec compare-report``: markdown tables from ``hybridspec compare`` result files (one or more
runs of one target)::

    hybridspec compare-report plain.json one_slot.json vllm_gdn.json

The reference is the first config of the first file (normally plain decoding). Per config: prompts
whose greedy output equals the reference's and, for each that differs, the reference's top-2
log-probability gap where the outputs first part (when the runs recorded ``--logprobs``); KV-cache
capacity; acceptance; and the decode-step sweep (mean ms per step and tokens per step at each batch
size and verification length), from which decode tokens/s = tokens per step / step time.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def load(paths: list[Path]) -> list[dict]:
    """The configs of every file, in order; a file that is not a ``hybridspec compare`` result is refused
    in one line naming it."""
    from vllm_hybridspec.policy.errors import InputError
    from vllm_hybridspec.tools.result_files import load_compare

    results = []
    for path in paths:
        try:
            load_compare(path)
            rows = json.loads(Path(path).read_text())["results"]
        except InputError as e:
            raise typer.BadParameter(str(e)) from None
        for r in rows:
            results.append({**r, "file": str(path)})
    return results


def identity_table(results: list[dict]) -> str:
    """Per config: prompts identical to the first config's output, the reference's top-2 gaps where
    they part, KV capacity, acceptance, engine start."""
    ref = results[0]
    lines = ["| config | identical to " + ref["name"] + " | gaps (nats) at first divergences | KV cache (tokens) "
             "| acceptance length | engine start (s) |", "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:80]} | | | | |")
            continue
        n = len(ref["outputs"])
        diffs = [p for p, (a, b) in enumerate(zip(r["outputs"], ref["outputs"])) if a != b]
        gaps = ""
        if diffs and "top2_gaps" in ref:
            gaps = ", ".join(f"{ref['top2_gaps'][p][first_divergence(r['outputs'][p], ref['outputs'][p])]:.4g}"
                             for p in diffs)
        acc = f"{r['mean_acceptance_length']:.3f}" if r.get("mean_acceptance_length") else "-"
        lines.append(f"| {r['name']} | {n - len(diffs)}/{n} | {gaps or '-'} | {r['kv_capacity_tokens']:,} | {acc} "
                     f"| {r.get('engine_start_s', float('nan')):.0f} |")
    return "\n".join(lines)


def sweep_table(results: list[dict]) -> str:
    """The decode-step sweep of every config: ms per step, tokens per step, tokens/s."""
    rows = []
    for r in results:
        for key, s in (r.get("round_ms") or {}).items():
            if isinstance(s, dict):
                w = "plain" if s["length"] is None else s["length"]
                tps = s["tokens_per_step"] / s["mean_ms"] * 1e3
                rows.append(f"| {r['name']} | {s['batch']} | {w} | {s['mean_ms']:.2f} | {s['median_ms']:.2f} "
                            f"| {s['tokens_per_step']:.2f} | {tps:.0f} | {s['steps']} |")
    if not rows:
        return ""
    return "\n".join(["| config | batch | verified tokens w | mean ms/step | median ms/step | tokens/step "
                      "| decode tokens/s | steps |", "|---|---|---|---|---|---|---|---|", *rows])


def gap_census(ref: dict) -> str:
    """How many of the reference's output positions had a top-2 gap at or under 0, 1/16 and 1/8 nats."""
    if "top2_gaps" not in ref:
        return ""
    gaps = [g for row in ref["top2_gaps"] for g in row if g is not None]
    parts = [f"<= {t}: {sum(g <= t + 1e-9 for g in gaps)}" for t in (0.0, 0.0625, 0.125)]
    return f"{ref['name']}'s output positions with a top-2 gap {', '.join(parts)} of {len(gaps)}"


def compare_report(files: list[Path] = typer.Argument(..., help="hybridspec compare result JSON files")) -> None:
    """Markdown tables (identity, KV capacity, acceptance, step sweep) of hybridspec compare results."""
    results = load(files)
    if not results:
        raise typer.BadParameter(f"{', '.join(map(str, files))}: no configs in these results")
    typer.echo(identity_table(results))
    census = gap_census(results[0])
    if census:
        typer.echo(f"\n{census}")
    sweep = sweep_table(results)
    if sweep:
        typer.echo(f"\n{sweep}")
