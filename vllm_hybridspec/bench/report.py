"""Result files of `hybridspec bench` as a markdown table and plots against concurrency, one line per
configuration."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from vllm_hybridspec.bench.schema import load_result_json
from vllm_hybridspec.policy.files import atomic_path, write_text_atomic


def load_result(path: Path) -> dict:
    doc = load_result_json(path)
    doc.setdefault("config", {})
    doc["label"] = doc["config"].get("label") or Path(path).stem
    doc["_source"] = Path(path).name
    return doc


def load_merged(spec: str | Path) -> dict:
    """One configuration from ``PATH`` or from ``LABEL=PATH[,PATH...]``: the sweeps of one setting run in
    separate calls (a 10-minute call rarely holds C = 1..128 of several settings). Levels are merged by
    concurrency, in the order given; a level measured in more than one file is taken from the last one,
    and the report notes the value it replaced."""
    spec = str(spec)
    label, sep, paths = spec.partition("=")
    if not sep or Path(spec).is_file():
        return load_result(Path(spec))
    if not label or not paths or "" in paths.split(","):
        raise ValueError(f"{spec!r}: expected LABEL=PATH[,PATH...]")
    docs = [load_result(Path(p)) for p in paths.split(",")]
    levels, notes = {}, []
    for doc in docs:
        for lv in doc["levels"]:
            c = lv["concurrency"]
            if c in levels:
                old = levels[c]
                notes.append(f"C = {c} measured in {old['_source']} ({_fmt(old['output_throughput'])} tok/s) and "
                             f"{doc['_source']} ({_fmt(lv['output_throughput'])} tok/s); the latter is shown")
            levels[c] = dict(lv, _source=doc["_source"])
    bad = [f"{d['_source']}: {d['status']}: {d.get('error')}" for d in docs if d.get("status") != "ok"]
    merged = dict(docs[-1], label=label, levels=[levels[c] for c in sorted(levels)],
                  status="ok" if not bad else "partly ok", error="; ".join(bad) or None,
                  merged_from=[d["_source"] for d in docs], merge_notes=notes)
    merged["config"] = dict(docs[-1]["config"], label=label)
    return merged


def _fmt(value, spec: str = ".1f", scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def markdown_table(docs: list[dict]) -> str:
    head = ("| configuration | C | done / failed / not sent | output tok/s [min-max of runs] | req/s | ITL mean / p50 / p99 (ms) "
            "| E2E mean / p50 / p99 (s) | TTFT p50 (ms) | accept. length | KV usage mean / max |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for doc in docs:
        for lv in doc["levels"]:
            itl, e2e = lv["itl_s"], lv["e2e_s"]
            kv = lv.get("kv_cache_usage") or {}
            flag = "" if lv.get("status", "ok") == "ok" else f" ({lv['status']})"
            spread = lv.get("output_throughput_spread")
            tps = _fmt(lv["output_throughput"]) + (f" [{_fmt(spread['min'])}-{_fmt(spread['max'])}]" if spread else "")
            lines.append(
                f"| {doc['label']}{flag} | {lv['concurrency']} | {lv['completed']} / {lv['failed']} / "
                f"{lv.get('not_sent', 0)} | {tps} | {_fmt(lv['request_throughput'], '.2f')} "
                f"| {_fmt(itl['mean'], '.1f', 1e3)} / {_fmt(itl['p50'], '.1f', 1e3)} / {_fmt(itl['p99'], '.1f', 1e3)} "
                f"| {_fmt(e2e['mean'], '.2f')} / {_fmt(e2e['p50'], '.2f')} / {_fmt(e2e['p99'], '.2f')} "
                f"| {_fmt(lv['ttft_s']['p50'], '.1f', 1e3)} | {_fmt(lv.get('mean_acceptance_length'), '.2f')} "
                f"| {_fmt(kv.get('mean'), '.1%')} / {_fmt(kv.get('max'), '.1%')} |")
    notes = [f"- {doc['label']}: {doc['status']}: {doc.get('error')}" for doc in docs if doc.get("status") != "ok"]
    notes += [f"- {doc['label']}: {n}" for doc in docs for n in doc.get("merge_notes", [])]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _series(doc: dict, get) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for lv in doc["levels"]:
        y = get(lv)
        if y is not None:
            xs.append(lv["concurrency"])
            ys.append(y)
    return xs, ys


def _panel(ax, docs, get, ylabel: str, title: str, style: str = "o-", scale: float = 1.0) -> None:
    for i, doc in enumerate(docs):
        xs, ys = _series(doc, get)
        ax.plot(xs, [y * scale for y in ys], style, color=f"C{i}", label=doc["label"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency C")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)


def plot(docs: list[dict], out_dir: Path) -> list[Path]:
    """throughput.png (tokens/s, requests/s), latency.png (ITL, E2E: mean solid, p99 dashed),
    kv_cache.png (mean and max KV-cache usage); each configuration one colour."""
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _panel(axes[0], docs, lambda lv: lv["output_throughput"], "output tokens / s", "Output throughput")
    for i, doc in enumerate(docs):  # the repeats' min-max as error bars
        spread = [(lv["concurrency"], lv["output_throughput"], lv["output_throughput_spread"]) for lv in doc["levels"]
                  if lv.get("output_throughput_spread") and lv["output_throughput"] is not None]
        if spread:
            axes[0].errorbar([c for c, _, _ in spread], [y for _, y, _ in spread],
                             yerr=[[y - s["min"] for _, y, s in spread], [s["max"] - y for _, y, s in spread]],
                             fmt="none", ecolor=f"C{i}", capsize=3)
    _panel(axes[1], docs, lambda lv: lv["request_throughput"], "requests / s", "Request throughput")
    for ax in axes:  # configurations differ by multiples, and C spans two decades
        ax.set_yscale("log")
    axes[0].legend()
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, ax, unit, scale, name in (("itl_s", axes[0], "ms", 1e3, "Inter-token latency"),
                                       ("e2e_s", axes[1], "s", 1.0, "End-to-end latency")):
        _panel(ax, docs, lambda lv, k=key: lv[k]["mean"], f"{unit} (mean solid, p99 dashed)", name, "o-", scale)
        for i, doc in enumerate(docs):
            xs, ys = _series(doc, lambda lv, k=key: lv[k]["p99"])
            ax.plot(xs, [y * scale for y in ys], "x--", color=f"C{i}")
    axes[0].legend()
    paths.append(_save(fig, out_dir / "latency.png"))

    fig, ax = plt.subplots(figsize=(5.5, 4))
    _panel(ax, docs, lambda lv: (lv.get("kv_cache_usage") or {}).get("mean"), "KV-cache usage (%)",
           "KV-cache usage (mean solid, max dashed)", "o-", 100.0)
    for i, doc in enumerate(docs):
        xs, ys = _series(doc, lambda lv: (lv.get("kv_cache_usage") or {}).get("max"))
        ax.plot(xs, [y * 100 for y in ys], "x--", color=f"C{i}")
    ax.legend()
    paths.append(_save(fig, out_dir / "kv_cache.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:  # matplotlib takes the format from the suffix, which tmp keeps
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
    return path


def write_report(results: list[Path | str], out_dir: Path) -> Path:
    """``report.md`` (the table, then the plots) and the plots in ``out_dir``; returns report.md.
    Each result is a file, or ``LABEL=PATH[,PATH...]`` for one configuration measured in several
    (:func:`load_merged`)."""
    docs = [load_merged(p) for p in results]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = plot(docs, out_dir)
    intro = ("Closed-loop streaming completions; ITL counts each token of a multi-token (speculative) "
             "chunk; acceptance length includes the bonus token.")
    md = ["# Benchmark report", "", intro, "", markdown_table(docs)]
    for doc in docs:
        cfg = doc["config"]
        md.append(f"- **{doc['label']}**: model `{cfg.get('model')}`, output length {cfg.get('output_len')} "
                  f"({'fixed' if cfg.get('ignore_eos', True) else 'up to EOS'}), "
                  f"server `{cfg.get('serve') or cfg.get('base_url')}`"
                  + (f"; merged from {', '.join(doc['merged_from'])}" if doc.get("merged_from") else ""))
    md += [""] + [f"![{p.stem}]({p.name})" for p in pngs]
    path = out_dir / "report.md"
    write_text_atomic(path, "\n".join(md) + "\n")
    return path
