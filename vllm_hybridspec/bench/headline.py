"""The headline: output tokens/s of plain decoding and the speculative configurations at each concurrency,
their ratios against plain decoding and against vLLM's own verify-all path, from `hybridspec bench`
result files (``docs/benchmarks/headline.json``, issue: HybridSpec's Table 1 at the 35B shape).

Each configuration is one result file or several (``PATH,PATH``: levels merged by concurrency, the last
file wins, as in ``hybridspec report``). The KV capacity of each server comes from the result's
``config.server`` (what ``hybridspec bench --serve`` read from the server's log); the host names say
whether every ratio compares runs of one machine."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from vllm_hybridspec.bench.report import load_merged
from vllm_hybridspec.policy.files import atomic_path, write_text_atomic

# configuration key -> what it is (the order of the table's columns)
CONFIGS = {
    "plain": "plain decoding",
    "hybridspec": "HybridSpec: per-request lengths, the gate, the routing correction",
    "ours_verify_all": "ours, every draft verified",
    "ours_static": "ours, the best static length",
    "vllm_verify_all": "vLLM's own GDN spec path, every draft verified",
}
# headline.json's kv_tokens keys and the configurations whose servers give them (first found)
KV_SOURCES = {"plain": ("plain",), "ours": ("hybridspec", "ours_verify_all", "ours_static"),
              "vllm": ("vllm_verify_all",)}
# the issue's bars: at C = 1 HybridSpec against plain and against vLLM's verify-all; at every C against plain
BARS = {"c1_over_plain": 1.8, "c1_over_vllm_verify_all": 1.3, "every_c_over_plain": 0.97}


def _level_map(doc: dict) -> dict[int, dict]:
    return {lv["concurrency"]: lv for lv in doc["levels"]}


def serve_precision(serve: str | None) -> str | None:
    """The precision a ``--serve`` command ran its model in: ``--quantization``'s value where it has one
    (``fp8``), else ``--dtype``'s (``bfloat16``; ``auto`` where not given); ``None`` without a command."""
    import shlex

    if not serve:
        return None
    args = shlex.split(serve)

    def value(flag: str) -> str | None:
        for i, a in enumerate(args):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    return value("--quantization") or value("--dtype") or "auto"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else round(a / b, 4)


def build_headline(files: dict[str, str], shape: str, profile: str, draft_len: int, command: str) -> dict:
    """``files``: configuration key (:data:`CONFIGS`) -> ``PATH[,PATH...]``; ``plain`` and ``hybridspec``
    are required. Raises ``ValueError`` in one line naming a bad key or file (bad files: the schema
    check of ``hybridspec report``)."""
    unknown = sorted(set(files) - set(CONFIGS))
    if unknown:
        raise ValueError(f"unknown configuration {unknown[0]!r}; valid: {', '.join(CONFIGS)}")
    missing = [k for k in ("plain", "hybridspec") if k not in files]
    if missing:
        raise ValueError(f"the headline needs the {missing[0]!r} result (every ratio is against plain decoding)")
    docs = {key: load_merged(f"{key}={spec}") for key, spec in files.items()}
    levels_of = {key: _level_map(doc) for key, doc in docs.items()}
    concurrencies = sorted(set().union(*levels_of.values()))
    levels, spread, acceptance, ratios = {}, {}, {}, {}
    for c in concurrencies:
        row = {key: (levels_of[key].get(c) or {}).get("output_throughput") for key in CONFIGS if key in docs}
        levels[str(c)] = row
        spread[str(c)] = {key: [s["min"], s["max"]] for key in row
                          if (s := (levels_of[key].get(c) or {}).get("output_throughput_spread"))}
        acceptance[str(c)] = {key: lv.get("mean_acceptance_length") for key in row
                              if (lv := levels_of[key].get(c)) and lv.get("mean_acceptance_length") is not None}
        ratios[str(c)] = {f"{key}_over_plain": _ratio(row[key], row["plain"]) for key in row if key != "plain"}
        if "vllm_verify_all" in row:
            ratios[str(c)]["hybridspec_over_vllm_verify_all"] = _ratio(row["hybridspec"], row["vllm_verify_all"])
    kv = {}
    for name, sources in KV_SOURCES.items():
        found = [docs[k]["config"].get("server", {}).get("kv_capacity_tokens") for k in sources if k in docs]
        kv[name] = next((n for n in found if n is not None), None)
    hosts = {key: doc["config"].get("host") for key, doc in docs.items()}
    gpus = {key: doc["config"].get("gpu") for key, doc in docs.items()}
    precisions = {key: serve_precision(doc["config"].get("serve")) for key, doc in docs.items()}
    notes = [f"{key}: {doc['status']}: {doc.get('error')}" for key, doc in docs.items() if doc.get("status") != "ok"]
    notes += [f"{key}: {n}" for key, doc in docs.items() for n in doc.get("merge_notes", [])]
    if len(set(hosts.values())) > 1 or None in hosts.values():
        notes.append("the results do not all come from one machine (config.host): "
                     + ", ".join(f"{k} {h}" for k, h in hosts.items()))
    for what, values in (("precision", precisions), ("gpu", gpus)):
        if len(set(values.values())) > 1 or None in values.values():
            notes.append(f"the results do not all name one {what}: "
                         + ", ".join(f"{k} {v}" for k, v in values.items()))
    verify_all = levels_of.get("ours_verify_all", {})
    first = verify_all.get(1) or (verify_all[min(verify_all)] if verify_all else None)
    over_plain = {c: ratios[str(c)]["hybridspec_over_plain"] for c in concurrencies}
    c1 = ratios.get("1", {})
    targets = {
        "c1_over_plain": _target(c1.get("hybridspec_over_plain"), BARS["c1_over_plain"]),
        "c1_over_vllm_verify_all": _target(c1.get("hybridspec_over_vllm_verify_all"), BARS["c1_over_vllm_verify_all"]),
        "every_c_over_plain": _target(min((r for r in over_plain.values() if r is not None), default=None),
                                      BARS["every_c_over_plain"]),
    }
    one = lambda values: next(iter(set(values.values()))) if len(set(values.values())) == 1 else None  # noqa: E731
    return {"shape": shape, "profile": profile, "D": draft_len, "precision": one(precisions), "gpu": one(gpus),
            "mean_accepted_verify_all": None if first is None else first.get("mean_acceptance_length"),
            "levels": levels, "kv_tokens": kv, "command": command,
            "ratios": ratios, "spread": spread, "acceptance_length": acceptance, "targets": targets,
            "sources": {key: doc.get("merged_from") or [doc["_source"]] for key, doc in docs.items()},
            "hosts": hosts, "same_machine": len(set(hosts.values())) == 1 and None not in hosts.values(),
            "notes": notes}


def _target(value, bar: float) -> dict:
    return {"value": value, "bar": bar, "met": None if value is None else value >= bar}


def _cell(value, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def markdown(head: dict) -> str:
    keys = [k for k in CONFIGS if any(k in row for row in head["levels"].values())]
    cols = " | ".join(keys)
    lines = [f"| C | {cols} | HybridSpec / plain | HybridSpec / vLLM verify-all |",
             "|---" * (len(keys) + 3) + "|"]
    for c, row in head["levels"].items():
        cells = []
        for k in keys:
            s = head["spread"][c].get(k)
            cells.append(_cell(row.get(k)) + (f" [{_cell(s[0])}-{_cell(s[1])}]" if s else ""))
        r = head["ratios"][c]
        lines.append(f"| {c} | {' | '.join(cells)} | {_cell(r.get('hybridspec_over_plain'), '.3f')}x | "
                     f"{_cell(r.get('hybridspec_over_vllm_verify_all'), '.3f')}x |")
    t = head["targets"]
    lines += ["", f"Output tokens/s (the repeats' min-max in brackets), {head.get('precision') or 'mixed precisions'} on "
              f"{head.get('gpu') or 'more than one GPU'}. Verify-all acceptance length "
              f"{_cell(head['mean_accepted_verify_all'], '.2f')}; KV capacity in tokens: "
              + ", ".join(f"{k} {v:,}" if v is not None else f"{k} –" for k, v in head["kv_tokens"].items()) + "."]
    lines += [f"- {name}: {_cell(v['value'], '.3f')} against {v['bar']} ({'met' if v['met'] else 'missed' if v['met'] is False else 'not measured'})"
              for name, v in t.items()]
    lines += [f"- note: {n}" for n in head["notes"]]
    return "\n".join(lines) + "\n"


def plot(head: dict, path: Path) -> Path:
    """Each speculative configuration's tokens/s over plain decoding's against C, 1.0 and the bars drawn."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    cs = [int(c) for c in head["levels"]]
    for i, key in enumerate(k for k in CONFIGS if k != "plain"):
        pts = [(c, head["ratios"][str(c)].get(f"{key}_over_plain")) for c in cs]
        pts = [(c, r) for c, r in pts if r is not None]
        if pts:
            ax.plot([c for c, _ in pts], [r for _, r in pts], "o-", color=f"C{i}", label=key.replace("_", " "))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(BARS["every_c_over_plain"], color="grey", ls=":", lw=0.8, label=f"{BARS['every_c_over_plain']}x")
    ax.plot([1], [BARS["c1_over_plain"]], "k*", label=f"bar at C = 1: {BARS['c1_over_plain']}x")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency C")
    ax.set_ylabel("output tokens/s over plain decoding")
    ax.set_title(f"{head['shape']}, {head['profile']}, D = {head['D']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
    return path


def write_headline(head: dict, out: Path, plot_path: Path | None = None) -> None:
    """The plot first, then the JSON: a plot that fails leaves no headline behind."""
    for path in (out, plot_path):
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if plot_path is not None:
        plot(head, Path(plot_path))
    write_text_atomic(Path(out), json.dumps(head, indent=1) + "\n")


def best_static_length(simulate: dict) -> int:
    """The best static length ``w`` of a ``hybridspec simulate --json`` result (its "best static" row, picked
    with hindsight on the records and the policy's fitted costs): the length the headline's static row serves."""
    for row in simulate.get("policies", []):
        if row.get("name") == "best static":
            detail = str(row.get("detail", ""))
            if detail.startswith("w = ") and detail[4:].isdigit():
                return int(detail[4:])
            raise ValueError(f"simulate's 'best static' row has detail {detail!r}, expected 'w = N'")
    raise ValueError("the simulate result has no 'best static' row (hybridspec simulate --json)")


if __name__ == "__main__":  # `python -m vllm_hybridspec.bench.headline static SIMULATE.json`: the stage script's helper
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "static":
        sys.exit("usage: python -m vllm_hybridspec.bench.headline static SIMULATE.json")
    try:
        print(best_static_length(json.loads(Path(sys.argv[2]).read_text())))
    except (OSError, ValueError) as e:
        sys.exit(f"{sys.argv[2]}: {e}")
