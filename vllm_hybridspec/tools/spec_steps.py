"""``hybridspec spec-steps``: the time of one decode step at each verification length and batch size,
with the CUDA-graph mode each step ran in, from one engine start.

The engine is started in this process with the target, the drafter of ``--speculative-config`` (or
none: plain decoding) and ``"hybridspec": {"fixed_length": K + 1}``; for every batch size ``B`` and
length ``w`` the proposer's selector verifies exactly ``w`` tokens per request (``w = 1``: drafting
turned off, what the batch gate runs), ``B`` greedy requests decode, and after the warm-up the wall
time of ``--steps`` calls of ``LLMEngine.step`` is divided by their number. With ``--untrimmed``, one
more row per ``B`` verifies all ``K + 1`` tokens without the selector (``"trimmed": false``), the cost
of the selector's own work next to its ``w = K + 1`` row (vLLM schedules every draft either way; the
selector's lengths are cut on the device, ``engine/length/cut.py``). Under async scheduling
(the default of the engine: on for "hspec", "dflash" and plain decoding) a step's time is the
pipelined time per step, which is what serving sees. The graph modes come from the runner's count of
the modes its steps were dispatched to (``engine/length/graphs.py``).

One JSON per engine; ``hybridspec spec-steps-table`` merges ours, vLLM's own GDN path and plain
decoding into the table of ``docs/benchmarks/spec_steps.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import typer
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_hybridspec.policy.errors import InputError, describe
from vllm_hybridspec.policy.files import read_json, write_text_atomic
from vllm_hybridspec.tools.engine_args import EngineOptions, PromptOptions, engine_options, input_file, int_list
from vllm_hybridspec.tools.engine_args import json_object, output_path, prompt_options

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the runner is reachable


def drafter_counts(runner) -> dict:
    """The H-Spec proposer's drafting rounds so far: ``replays`` of a captured graph, ``captures`` (a
    round that ran eagerly and captured its graph) and ``eager`` rounds (no graph for the round);
    empty for other drafters or none."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "eager_rounds"):
        return {}
    graphs = getattr(drafter, "draft_graphs", None)
    return {"replays": graphs.replays if graphs else 0, "captures": graphs.captures if graphs else 0,
            "eager": drafter.eager_rounds}


def time_steps(llm, prompts: list[dict], batch: int, steps: int, warmup: int, tag: str, runner=None) -> dict:
    """``batch`` greedy requests; ``warmup`` steps (prefill included), then the mean wall time of
    ``steps`` steps with each step's own time (so a spike, a capture or a compilation, shows as
    one), the output tokens they produced and (with ``runner``) the graph modes they were dispatched
    to and the drafter's rounds (:func:`drafter_counts`). The requests are aborted afterwards."""
    from vllm_hybridspec.engine.length.graphs import graph_mode_counts

    from vllm import SamplingParams

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has requests from an earlier measurement")
    spec = engine.vllm_config.speculative_config
    k = spec.num_speculative_tokens if spec else 0
    params = SamplingParams(temperature=0, max_tokens=(warmup + steps + 4) * (k + 1), ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, prompts[i % len(prompts)], params)
    produced = dict.fromkeys(ids, 0)

    def step() -> int:
        new = 0
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            new += n - produced[out.request_id]
            produced[out.request_id] = n
            if out.finished:
                raise RuntimeError(f"request {out.request_id} finished during the measurement")
        return new

    for _ in range(warmup):
        step()
    before = graph_mode_counts(runner) if runner is not None else {}
    rounds_before = drafter_counts(runner)
    times, tokens = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens += step()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = sum(times) / steps
    after = graph_mode_counts(runner) if runner is not None else {}
    modes = {key: n - before.get(key, 0) for key, n in after.items() if n - before.get(key, 0)}
    rounds = {key: n - rounds_before[key] for key, n in drafter_counts(runner).items()}
    row = {"B": batch, "ms": round(ms, 4), "median_ms": round(statistics.median(times), 4),
           "max_ms": round(max(times), 4), "tokens_per_step": round(tokens / steps, 3),
           "tokens_per_s": round(tokens / (ms * steps / 1e3), 2), "graph_modes": modes,
           "step_ms": [round(t, 4) for t in times]}
    if rounds:
        row["drafter_rounds"] = rounds
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return row


DRAFT_KINDS = ("model", "spread")


def device_name() -> str:
    """The accelerator the engine ran on (``torch.cuda.get_device_name``), or as ``bench`` names the machine's
    (``cpu: <model name>`` without a GPU)."""
    import torch

    from vllm_hybridspec.bench.cli import accelerator_name

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else accelerator_name()


def precision_of(model_config) -> str:
    """A run's precision as results name it: the weights' quantization where there is one (``fp8``), else
    the model's dtype (``bfloat16``, ``float32``)."""
    quantization = getattr(model_config, "quantization", None)
    return str(quantization) if quantization else str(model_config.dtype).removeprefix("torch.")


def memory_facts(runner) -> dict:
    """The model's weights in GiB as vLLM's runner measured them at load (target and drafter together,
    ``model_memory_usage``; absent on runners that do not measure it)."""
    used = getattr(runner, "model_memory_usage", None)
    return {} if not used else {"weights_gib": round(used / 2**30, 2)}


def measure(engine: EngineOptions, speculative_config: dict | None, lengths: list[int], batch_sizes: list[int],
            prompts: list[dict], steps: int, warmup: int, progress=print, untrimmed: bool = False,
            drafts: tuple[str, ...] = ("model",)) -> dict:
    """Every (B, w) on one engine; ``speculative_config`` None: plain decoding (``lengths`` ignored).
    ``untrimmed``: per B also ``w = K + 1`` with the selector off (rows with ``"trimmed": false``).
    ``drafts``: the rows once per kind, ``"model"`` the drafter's own tokens, ``"spread"`` distinct ids
    at every position (``engine.drafting.proposer.spread_drafts``; each row says ``"drafts"``)."""
    from vllm import LLM

    from vllm_hybridspec.engine.compat import in_process_runner, kv_capacity_tokens
    from vllm_hybridspec.engine.length.trimming import selector_of

    spec = None
    if speculative_config is not None:
        k = int(speculative_config["num_speculative_tokens"])
        bad = [w for w in lengths if not 1 <= w <= k + 1]
        if bad:
            raise typer.BadParameter(f"--lengths {bad} outside 1..num_speculative_tokens + 1 = {k + 1}")
        options = dict(speculative_config.get("hybridspec") or {})
        spec = {**speculative_config, "hybridspec": {**options, "fixed_length": k + 1}}
    t0 = time.perf_counter()
    llm = LLM(**engine.llm_kwargs(speculative_config=spec, max_num_seqs=max(max(batch_sizes), engine.max_num_seqs or 1)))
    start_s = round(time.perf_counter() - t0, 1)
    runner = in_process_runner(llm)
    result = {"model": engine.model, "speculative_config": spec, "engine": engine.llm_kwargs(),
              "device": device_name(), "precision": precision_of(llm.llm_engine.model_config),
              "engine_start_s": start_s, "kv_capacity_tokens": kv_capacity_tokens(llm), **memory_facts(runner),
              "rows": []}
    progress(f"engine started in {start_s} s on {result['device']}, {result['precision']}, KV capacity "
             f"{result['kv_capacity_tokens']} tokens" + (f", weights {result['weights_gib']} GiB"
                                                         if "weights_gib" in result else ""))
    selector = selector_of(runner) if spec is not None else None
    if spec is not None and selector is None:
        raise RuntimeError("the engine's drafter has no hybridspec length selector")
    runs = [(None, True, None)]  # (w, trimmed, drafts); plain decoding: one row per B
    if spec is not None:
        if "spread" in drafts and not hasattr(runner.drafter, "spread_drafts"):
            raise RuntimeError("--drafts spread: the engine's drafter is not H-Spec's proposer")
        runs = [(w, trimmed, d) for d in drafts
                for w, trimmed in [(w, True) for w in lengths] + ([(k + 1, False)] if untrimmed else [])]
    for b in batch_sizes:
        for w, trimmed, kind in runs:
            if kind is not None and hasattr(runner.drafter, "spread_drafts"):
                runner.drafter.spread_drafts = kind == "spread"
            if selector is not None:
                if w == 1:
                    selector.configure(drafting=False)
                elif not trimmed:
                    selector.configure(trim=False)
                else:
                    selector.configure(fixed_length=w)
            tag = (f"b{b}-w{w}" if trimmed else f"b{b}-all") + ("" if kind in (None, "model") else f"-{kind}")
            row = {"w": w, **({} if trimmed else {"trimmed": False}), **({} if kind is None else {"drafts": kind}),
                   **time_steps(llm, prompts, b, steps, warmup, tag, runner)}
            result["rows"].append(row)
            extra = f", drafter rounds {row['drafter_rounds']}" if "drafter_rounds" in row else ""
            label = ("" if trimmed else " (untrimmed)") + ("" if kind in (None, "model") else f" ({kind} drafts)")
            progress(f"B={b} w={w}{label}: {row['ms']:.3f} ms/step (median {row['median_ms']:.3f}, max {row['max_ms']:.3f}), "
                     f"{row['tokens_per_step']:.2f} tokens/step, modes {row['graph_modes']}{extra}")
    if selector is not None:
        selector.configure()
    if spec is not None and hasattr(runner.drafter, "spread_drafts"):
        runner.drafter.spread_drafts = False
    return result


def draft_kinds(drafts: str, spec: dict | None) -> tuple[str, ...]:
    """``--drafts`` as a tuple of :data:`DRAFT_KINDS`; ``typer.BadParameter`` naming the value otherwise,
    and for ``spread`` without an H-Spec drafter (``"method": "hspec"``)."""
    kinds = tuple(d.strip() for d in drafts.split(","))
    bad = [d for d in kinds if d not in DRAFT_KINDS]
    if bad or len(set(kinds)) != len(kinds):
        raise typer.BadParameter(f"--drafts {drafts!r}: comma-separated, each once, from {', '.join(DRAFT_KINDS)}")
    if "spread" in kinds and (spec is None or spec.get("method") != "hspec"):
        raise typer.BadParameter("--drafts spread needs an H-Spec drafter (--speculative-config with "
                                 "\"method\": \"hspec\")")
    return kinds


def spec_steps(
    engine: EngineOptions,
    prompts: PromptOptions,
    speculative_config: str = typer.Option(None, help="the drafter, as --speculative-config JSON; omit for plain "
                                           "decoding"),
    lengths: str = typer.Option("1,2,4,8,16", help="verification lengths w (w = 1: drafting off)"),
    batch_sizes: str = typer.Option("1,4", help="requests decoding together"),
    steps: int = typer.Option(48, min=4, help="timed steps per (B, w)"),
    warmup: int = typer.Option(8, min=2, help="untimed steps first (prefill, compilation)"),
    untrimmed: bool = typer.Option(False, help="also w = K + 1 with the length selector off (every draft scheduled "
                                   "by vLLM, no host read of the lengths), per batch size"),
    drafts: str = typer.Option("model", help="comma-separated draft kinds, every row once per kind: model (the "
                               "drafter's tokens) or spread (distinct ids at every position, so that a step's "
                               "tokens route as distinct tokens do; with dummy weights a drafter drafts one id)"),
    out: Path = typer.Option(..., help="result JSON"),
) -> None:
    """Per-step decode time and CUDA-graph mode at each verification length and batch size, one engine."""
    spec = json_object(speculative_config, "speculative-config") if speculative_config else None
    ws, bs = int_list(lengths, "lengths"), int_list(batch_sizes, "batch-sizes")
    kinds = draft_kinds(drafts, spec)
    output_path(out, "--out")  # before the engine starts; missing directories are made at the end
    result = measure(engine, spec, ws, bs, prompts.load(engine.model), steps, warmup,
                     progress=lambda line: typer.echo(line), untrimmed=untrimmed,
                     drafts=kinds)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=1))
    typer.echo(f"wrote {out}")


spec_steps = prompt_options(engine_options(spec_steps))


class StepsRow(BaseModel):
    """What :func:`spec_steps_table` reads of a row of a ``spec-steps`` result (the rest passes)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    B: int = Field(ge=1)
    w: int | None = Field(default=None, ge=1)
    ms: float = Field(ge=0)
    median_ms: float | None = Field(default=None, ge=0)
    trimmed: bool = True
    drafts: str = "model"
    graph_modes: dict[str, int] = Field(default_factory=dict)


class StepsSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    num_speculative_tokens: int = Field(ge=1)


class StepsResult(BaseModel):
    """A ``hybridspec spec-steps`` result as the table reads it: the drafter (``null``: plain decoding)
    and one row per (B, w)."""

    model_config = ConfigDict(extra="allow", strict=True)
    speculative_config: StepsSpec | None
    rows: list[StepsRow] = Field(min_length=1)


# each input of spec-steps-table: whether it is a run with a drafter, and what it should be
STEPS_INPUTS = {"--ours": (True, "the spec-steps result of our engine"),
                "--plain": (False, "a spec-steps result of plain decoding (no --speculative-config)"),
                "--vllm": (True, "a spec-steps result of vLLM's own GDN path")}


def read_steps(path: Path, option: str) -> dict:
    """The ``spec-steps`` result in ``path``, given as ``option``: a file of the shape
    :class:`StepsResult`, with a drafter or without as :data:`STEPS_INPUTS` says (the table matches
    rows by the drafter's K and reads plain decoding's one row per B); ``typer.BadParameter`` naming
    the option and the file otherwise."""
    speculative, what = STEPS_INPUTS[option]
    try:
        data = read_json(path, f"{option} file")
        result = StepsResult.model_validate(data)
    except InputError as e:
        raise typer.BadParameter(str(e)) from None
    except ValidationError as e:
        raise typer.BadParameter(str(describe(e, f"{option} '{path}'", StepsResult))) from None
    if speculative != (result.speculative_config is not None):
        run = "plain decoding (speculative_config null)" if speculative else "a run with a speculative_config"
        raise typer.BadParameter(f"{option} '{path}' is {run}; expected {what}")
    return data


def run_identity(runs: list[dict], precision: str | None = None, gpu: str | None = None) -> dict:
    """``precision`` and ``gpu`` of a table: what its inputs record (``spec-steps`` writes ``precision`` and
    ``device``), which must be one value across them (a table compares runs of one precision on one GPU);
    ``precision``/``gpu`` name them for inputs that record none and must agree with those that do.
    ``ValueError`` naming the field and the values otherwise."""
    out = {}
    for field, key, given in (("precision", "precision", precision), ("gpu", "device", gpu)):
        seen = {r[key] for r in runs if r.get(key) is not None}
        if given is not None:
            seen.add(given)
        if len(seen) > 1:
            raise ValueError(f"the inputs differ in {field}: {', '.join(sorted(seen))} (one table compares runs of "
                             f"one {field})")
        if not seen or any(r.get(key) is None for r in runs) and given is None:
            raise ValueError(f"{field} is not recorded in every input: name it with --{field}")
        out[field] = seen.pop()
    return out


def spec_steps_table(ours: dict, plain: dict, vllm_runs: list[dict], shape: str, command: str,
                     layers: int | None = None, draft_round: dict | None = None, precision: str | None = None,
                     gpu: str | None = None) -> dict:
    """``docs/benchmarks/spec_steps.json``: one row per (B, w, drafts) of ``ours``, with vLLM's full-graph
    step at the same length and with the same kind of drafts (``spec-steps --drafts``) where one of
    ``vllm_runs`` (engines verifying all ``K + 1``) has it. A row's figure is its median step (the mean
    where a result has none): a drafter graph captured while the prefix grows past a capacity bucket
    is one step of tens of milliseconds that the mean spreads over the row. ``layers``: the target's
    layer count; ``draft_round``: a ``kernels draft-round`` result, whose round with the engine's
    default drafter (:data:`DEFAULT_ROUND`) per batch size becomes ``drafter_round_ms``."""
    plain_ms = {str(r["B"]): _ms(r) for r in plain["rows"]}
    vllm_ms = {}
    for run in vllm_runs:
        k1 = run["speculative_config"]["num_speculative_tokens"] + 1
        for r in run["rows"]:
            if r["w"] == k1:
                vllm_ms[(r["B"], k1, r.get("drafts", "model"))] = (_ms(r), _mode(r))
    rows = []
    for r in ours["rows"]:
        drafts = r.get("drafts", "model")
        v = vllm_ms.get((r["B"], r["w"], drafts))
        rows.append({"B": r["B"], "w": r["w"], "trimmed": r.get("trimmed", True), "drafts": drafts, "ours_ms": _ms(r),
                     "ours_mode": _mode(r), "vllm_ms": None if v is None else v[0],
                     "vllm_mode": None if v is None else v[1]})
    table = {"shape": shape, "command": command, **run_identity([ours, plain, *vllm_runs], precision, gpu),
             "plain_ms": plain_ms}
    if layers is not None:
        table["layers"] = layers
    if draft_round is not None:
        table["drafter_round_ms"] = {str(r["B"]): r[DEFAULT_ROUND] for r in draft_round["rows"]}
    return {**table, "rows": rows}


# the draft-round figure of the engine's default drafter: fused norms and grouped attention on, torch.compile
# and candidate heads off (engine/options.py)
DEFAULT_ROUND = "round_grouped_ms"


class DraftRoundRow(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    B: int = Field(ge=1)
    round_grouped_ms: float = Field(gt=0)


class DraftRoundResult(BaseModel):
    """What the table reads of a ``hybridspec kernels draft-round --json`` result."""

    model_config = ConfigDict(extra="allow", strict=True)
    rows: list[DraftRoundRow] = Field(min_length=1)


def _ms(row: dict) -> float:
    return row["median_ms"] if row.get("median_ms") is not None else row["ms"]


def _mode(row: dict) -> str:
    """The mode most of a row's steps ran in (``FULL``, ``PIECEWISE`` or ``NONE``), or ``mixed``."""
    counts: dict[str, int] = {}
    for key, n in row["graph_modes"].items():
        counts[key.rsplit(" ", 1)[-1]] = counts.get(key.rsplit(" ", 1)[-1], 0) + n
    if not counts:
        return "unknown"
    mode, n = max(counts.items(), key=lambda kv: kv[1])
    return mode if n == sum(counts.values()) else f"mostly {mode}"


def plot_table(table: dict, path: Path) -> None:
    """ms per step against w, one panel per batch size: ours per draft kind (selected lengths cut on the
    device), vLLM's verify-all step at K + 1 as a point, plain decoding's step as a line (the table's runs
    share one precision and GPU, named in the title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["B"] for r in table["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rows = [r for r in table["rows"] if r["B"] == b and r["trimmed"]]
        for kind, marker in (("model", "o"), ("spread", "s")):
            pts = sorted((r["w"], r["ours_ms"]) for r in rows if r["drafts"] == kind)
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=f"ours ({kind} drafts)")
            v = [(r["w"], r["vllm_ms"]) for r in rows if r["drafts"] == kind and r["vllm_ms"] is not None]
            if v:
                ax.scatter(*zip(*v), marker="x", s=60, zorder=3, label=f"vLLM's GDN path ({kind} drafts)")
        if str(b) in table["plain_ms"]:
            ax.axhline(table["plain_ms"][str(b)], color="gray", linestyle="--", label="plain decoding")
        ax.set(title=f"B = {b}", xlabel="verified tokens per request (w)", ylabel="ms per step", ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{table.get('layers', '?')} layers, {table.get('precision', '?')}, {table.get('gpu', '?')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def spec_steps_table_command(
    ours: Path = typer.Option(..., help="spec-steps JSON of our engine"),
    plain: Path = typer.Option(..., help="spec-steps JSON of a plain engine"),
    vllm: list[Path] = typer.Option([], help="spec-steps JSONs of vLLM's own GDN path (verify all), repeatable"),
    shape: str = typer.Option(..., help="what was measured, e.g. 'Qwen3.6-35B-A3B, dummy weights, H200'"),
    command: str = typer.Option(..., help="the commands that produced the inputs"),
    layers: int | None = typer.Option(None, min=1, help="the target's number of layers, recorded in the table"),
    draft_round: Path | None = typer.Option(
        None, help="a `hybridspec kernels draft-round --json` result of the same drafter: its default round per "
        "batch size becomes drafter_round_ms"),
    precision: str | None = typer.Option(None, help="the runs' precision (bfloat16, fp8, ...) where the inputs do not "
                                         "record it; must agree with those that do"),
    gpu: str | None = typer.Option(None, help="the GPU the runs were measured on, where the inputs do not record it"),
    out: Path = typer.Option(..., help="the table JSON to write"),
    plot: Path | None = typer.Option(None, help="also a PNG of ms per step against w per batch size"),
) -> None:
    """Merge spec-steps results into the spec-step table (``docs/benchmarks/spec_steps.json``)."""
    inputs = [("--ours", ours), ("--plain", plain), *(("--vllm", p) for p in vllm)]
    for option, path in inputs:
        input_file(path, option, STEPS_INPUTS[option][1])
    if draft_round is not None:
        input_file(draft_round, "--draft-round", "a `hybridspec kernels draft-round --json` result")
    output_path(out, "--out", make_parents=False)
    ours_run, plain_run, *vllm_runs = [read_steps(path, option) for option, path in inputs]
    rounds = None
    if draft_round is not None:
        try:
            rounds = read_json(draft_round, "--draft-round file")
            DraftRoundResult.model_validate(rounds)
        except InputError as e:
            raise typer.BadParameter(str(e)) from None
        except ValidationError as e:
            raise typer.BadParameter(str(describe(e, f"--draft-round '{draft_round}'", DraftRoundResult))) from None
    try:
        table = spec_steps_table(ours_run, plain_run, vllm_runs, shape, command, layers, rounds, precision, gpu)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    write_text_atomic(out, json.dumps(table, indent=1) + "\n")
    typer.echo(f"wrote {out}")
    if plot is not None:
        plot_table(table, plot)
        typer.echo(f"wrote {plot}")
