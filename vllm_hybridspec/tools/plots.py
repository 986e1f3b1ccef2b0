"""``hybridspec plot-rounds``: decode-step time against verification length, and decode tokens/s per
mode, from a ``hybridspec evaluate`` result (its costs and modes), optionally next to ``hybridspec
compare`` results with a ``--sweep-lengths`` sweep (another GDN path of the same shape)::

    hybridspec plot-rounds docs/benchmarks/h200-2026-12-01/eval-35b/evaluate.json \\
        --compare docs/benchmarks/h200-2026-12-01/compare-35b-vllm-gdn.json --label "one-slot GDN (ours)" \\
        --out round_times.png
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def plot_rounds(
    evaluate: Path = typer.Argument(..., help="evaluate.json of hybridspec evaluate"),
    compare: list[Path] = typer.Option([], help="hybridspec compare JSON with a step sweep (repeatable)"),
    label: str = typer.Option("evaluate", help="legend name of the evaluate run's GDN path"),
    out: Path = typer.Option(..., help="the PNG to write"),
) -> None:
    """Step time per verification length and tokens/s per mode, one panel per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_hybridspec.policy.cli import PLOT_FORMATS
    from vllm_hybridspec.tools.engine_args import input_file, output_path

    input_file(evaluate, "EVALUATE", "evaluate.json of hybridspec evaluate")
    for path in compare:
        input_file(path, "--compare", "a hybridspec compare result JSON")
    output_path(out, "--out")
    if out.suffix.lower() not in PLOT_FORMATS:
        raise typer.BadParameter(f"--out '{out}' has suffix '{out.suffix}'; the image format comes from it: use "
                                 f"one of {', '.join(PLOT_FORMATS)}")
    from vllm_hybridspec.policy.errors import InputError
    from vllm_hybridspec.tools.result_files import load_compare, load_evaluate

    for path, load in [(evaluate, load_evaluate), *((p, load_compare) for p in compare)]:
        try:
            load(path)
        except InputError as e:
            raise typer.BadParameter(str(e)) from None
    result = json.loads(evaluate.read_text())
    batches = sorted({r["batch"] for r in result["costs"]})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5 * (len(batches) + 1), 4))
    for ax, b in zip(axes, batches):
        runs = sorted((r for r in result["costs"] if r["batch"] == b and r["length"] is not None),
                      key=lambda r: r["length"])
        ax.plot([r["length"] for r in runs], [r["mean_ms"] for r in runs], "o-", label=label)
        plain = [r["mean_ms"] for r in result["costs"] if r["batch"] == b and r["length"] is None]
        if plain:
            ax.axhline(plain[0], color="gray", ls="--", label="drafting off (plain decode path)")
        for path in compare:
            for r in json.loads(path.read_text())["results"]:
                sweep = sorted((s for s in (r.get("round_ms") or {}).values()
                                if isinstance(s, dict) and s.get("batch") == b and s.get("length")),
                               key=lambda s: s["length"])
                if sweep:
                    ax.plot([s["length"] for s in sweep], [s["mean_ms"] for s in sweep], "s-", label=r["name"])
        ax.set_xlabel("verification length w (tokens per request)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"batch size {b}")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax = axes[-1]
    modes = list(result["modes"])
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        ax.bar([m + i * width for m in range(len(modes))],
               [result["modes"][m]["steps"][str(b)]["tokens_per_s"] for m in modes], width, label=f"B = {b}")
    ax.set_xticks([m + width * (len(batches) - 1) / 2 for m in range(len(modes))], modes)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("modes of one engine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    typer.echo(f"wrote {out}")
