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
    """The configs of every file, in order, as their model read them (a field left out or null is
    ``None``); a file that is not a ``hybridspec compare`` result is refused in one line naming it."""
    from vllm_hybridspec.policy.errors import InputError
    from vllm_hybridspec.tools.result_files import load_compare

    results = []
    for path in paths:
        try:
            result = load_compare(path)
        except InputError as e:
            raise typer.BadParameter(str(e)) from None
        for r in result.results:
            results.append({**r.model_dump(), "file": str(path)})
    return results


def _gap(ref: dict, output: list[int], p: int) -> str:
    """The reference's top-2 gap where ``output`` first parts from the reference's output of prompt ``p``;
    ``-`` where none was recorded (no gap at that token, or the reference ended there)."""
    gaps = ref["top2_gaps"][p]
    i = first_divergence(output, ref["outputs"][p])
    return "-" if i >= len(gaps) or gaps[i] is None else f"{gaps[i]:.4g}"


def identity_table(results: list[dict]) -> str:
    """Per config: prompts identical to the reference's output (the first config with outputs), the
    reference's top-2 gaps where they part, KV capacity, acceptance, engine start."""
    ref = next((r for r in results if r["error"] is None), None)
    if ref is None:
        raise typer.BadParameter(f"{results[0]['file']}: every config ended in an error; there is no output "
                                 "to compare")
    lines = ["| config | identical to " + ref["name"] + " | gaps (nats) at first divergences | KV cache (tokens) "
             "| acceptance length | engine start (s) |", "|---|---|---|---|---|---|"]
    for r in results:
        if r["error"] is not None:
            lines.append(f"| {r['name']} | error: {r['error'][:80]} | | | | |")
            continue
        n = len(ref["outputs"])
        diffs = [p for p, (a, b) in enumerate(zip(r["outputs"], ref["outputs"])) if a != b]
        gaps = ""
        if diffs and ref["top2_gaps"] is not None:
            gaps = ", ".join(_gap(ref, r["outputs"][p], p) for p in diffs)
        acc = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.3f}"
        start = "-" if r["engine_start_s"] is None else f"{r['engine_start_s']:.0f}"
        lines.append(f"| {r['name']} | {n - len(diffs)}/{n} | {gaps or '-'} | {r['kv_capacity_tokens']:,} | {acc} "
                     f"| {start} |")
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
    if ref["error"] is not None or ref["top2_gaps"] is None:
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
    census = gap_census(next(r for r in results if r["error"] is None))
    if census:
        typer.echo(f"\n{census}")
    sweep = sweep_table(results)
    if sweep:
        typer.echo(f"\n{sweep}")
