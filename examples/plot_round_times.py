"""Per-round decode time against verification length, and decode tokens/s per mode, from an
``evaluate_one_engine.py`` result (its costs and modes) and optionally ``vllm_compare.py`` results
with a ``--sweep-lengths`` sweep (another GDN path of the same shape), side by side.

    python examples/plot_round_times.py docs/benchmarks/h200-2026-12-01/eval-35b/evaluate.json \\
        --compare docs/benchmarks/h200-2026-12-01/compare-35b-vllm-gdn.json --label "one-slot GDN (ours)" \\
        --out docs/benchmarks/h200-2026-12-01/round_times.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("evaluate", type=Path, help="evaluate.json")
    ap.add_argument("--compare", type=Path, action="append", default=[], help="vllm_compare.py JSON with round_ms")
    ap.add_argument("--label", default="evaluate", help="legend name of the evaluate run's GDN path")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(args.evaluate.read_text())
    batches = sorted({r["batch"] for r in result["costs"]})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5 * (len(batches) + 1), 4))
    for ax, b in zip(axes, batches):
        runs = sorted((r for r in result["costs"] if r["batch"] == b and r["length"] is not None),
                      key=lambda r: r["length"])
        ax.plot([r["length"] for r in runs], [r["mean_ms"] for r in runs], "o-", label=args.label)
        plain = [r["mean_ms"] for r in result["costs"] if r["batch"] == b and r["length"] is None]
        if plain:
            ax.axhline(plain[0], color="gray", ls="--", label="drafting off (plain decode path)")
        for path in args.compare:
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
