"""``hybridspec compare``: side-by-side greedy runs of one target under several speculative configs
(``hybridspec demo`` uses it on the reference models).

For every config: greedy outputs on the same prompts (compared token for token with the first config,
normally plain decoding), output tokens/s at batch size 1 (prompts one after another) and with all
prompts submitted at once, spec-decode acceptance counters, and the KV-cache capacity the engine
reports. Results go to ``--out`` as JSON and a table on stdout.

    hybridspec compare --model models/hybrid --prompts models/prompts/heldout.jsonl --num-prompts 24 \
        --max-tokens 128 --config plain=none \
        --config hspec='{"method": "hspec", "model": "models/hybrid-hspec", "num_speculative_tokens": 7}' \
        --out compare.json

Full-size shapes without weights: ``--load-format dummy --engine-args '{"hf_overrides": {...}}'`` and
``--random-prompts`` (token ids). On the H200 pass ``--engine-args '{"additional_config":
{"gdn_prefill_backend": "triton"}}'`` for GDN targets (../shared/device/README.md). A config may carry
engine arguments of its own: ``NAME='{"engine": {...}, <speculative config>}'``.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

from vllm_hybridspec.policy.files import write_text_atomic
from vllm_hybridspec.tools.engine_args import (
    EngineOptions,
    PromptOptions,
    engine_options,
    int_list,
    output_path,
    prompt_options,
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the scheduler's KV config is readable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def spec_counters(llm) -> dict[str, float]:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and not m.name.endswith("per_pos"):
            out[m.name.removeprefix("vllm:spec_decode_")] = float(m.value)
    return out


def rank_stats(llm) -> list[dict] | None:
    """Each tensor-parallel rank's selector and cut counters (``HybridSpecWorkerExtension.hybridspec_stats``),
    or None where the workers lack that extension (``worker_extension_cls`` in ``--engine-args``)."""
    extension = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls or ""
    return llm.collective_rpc("hybridspec_stats") if extension.endswith("HybridSpecWorkerExtension") else None


def counter_delta(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], float | None]:
    """vLLM's spec-decode counters between two :func:`spec_counters` readings, and the mean acceptance
    length over them (bonus token included; ``None`` without drafts)."""
    counters = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts = counters.get("num_drafts")
    return counters, (1 + counters["num_accepted_tokens"] / drafts) if drafts else None


def identical_prompts(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """How many prompts' token lists equal the reference's."""
    return sum(a == b for a, b in zip(outputs, reference))


def split_engine_args(spec: dict | None) -> tuple[dict | None, dict]:
    """A config may carry its own engine arguments: ``{"engine": {...}, <speculative config>}``; a dict
    with only ``"engine"`` is plain decoding with those arguments."""
    if spec is None:
        return None, {}
    spec = dict(spec)
    engine = spec.pop("engine", {})
    if not isinstance(engine, dict):
        raise ValueError(f'"engine" must be a JSON object of LLM(...) arguments, got {engine!r}')
    return (spec or None), engine


@dataclass
class CompareSettings:
    """What a comparison measures besides the engine: tokens per prompt, prompts timed at batch size 1,
    top-2 log-probabilities (near-ties), each config in its own process, and a step sweep."""

    max_tokens: int = 128
    bs1_prompts: int = 4
    logprobs: bool = False
    isolate: bool = False
    sweep_lengths: list[int] | None = None
    sweep_batches: tuple[int, ...] = (1,)
    sweep_steps: int = 32
    sweep_warmup: int = 4


def run_config(name: str, spec, engine: EngineOptions, settings: CompareSettings, prompts) -> dict:
    """Start an engine for ``spec`` (``None``: plain decoding), measure, shut it down; ``engine`` holds
    the engine settings, ``spec["engine"]`` this config's own."""
    import torch
    from vllm import LLM, SamplingParams

    from vllm_hybridspec.engine.compat import kv_capacity_tokens, length_selector

    spec, own_engine_args = split_engine_args(spec)
    engine_kw = engine.llm_kwargs(**own_engine_args)
    t_start = time.perf_counter()
    llm = LLM(**engine_kw, speculative_config=spec, disable_log_stats=False)
    start_s = time.perf_counter() - t_start
    logprobs = settings.logprobs
    greedy = SamplingParams(temperature=0, max_tokens=settings.max_tokens, ignore_eos=True,
                            logprobs=2 if logprobs else None)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    # with tensor parallelism the proposer lives in the worker processes: no selector stats, no spec
    # sweep, but each rank's counters where the workers have the plugin's extension
    in_process = llm.llm_engine.vllm_config.parallel_config.world_size == 1
    ranks_before = rank_stats(llm) if spec is not None and not in_process else None
    before = spec_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    batch_s = time.perf_counter() - t0
    after = spec_counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    # the top-2 (token, log-probability) at each output position, and their gap (where a divergence
    # is a floating-point near-tie): tests/serving/identity.py judges runs from these
    top2 = [[top2_of(lp) for lp in o.outputs[0].logprobs] for o in outs] if logprobs else None
    greedy = SamplingParams(temperature=0, max_tokens=settings.max_tokens, ignore_eos=True)
    counters, acceptance_length = counter_delta(before, after)
    bs1_tokens, t0 = 0, time.perf_counter()
    for p in prompts[: settings.bs1_prompts]:
        bs1_tokens += len(llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    bs1_s = time.perf_counter() - t0
    result = {
        "name": name,
        "speculative_config": spec,
        "kv_capacity_tokens": kv_capacity_tokens(llm),
        "batch_tokens_per_s": sum(map(len, tokens)) / batch_s,
        "batch_size": len(prompts),
        "bs1_tokens_per_s": bs1_tokens / bs1_s if settings.bs1_prompts else None,
        "bs1_prompts": settings.bs1_prompts,
        "spec_counters": counters,
        "mean_acceptance_length": acceptance_length,
        "outputs": tokens,
        "engine_args": engine_kw,
        "engine_start_s": start_s,
    }
    if top2 is not None:
        result["top2"] = top2
        result["top2_gaps"] = [[a[1] - b[1] if b else None for a, b in row] for row in top2]
    if ranks_before is not None:  # the batch's drafts verified after the device cut, on each rank
        result["ranks"] = [{**a, "verified_drafts": a["verified_drafts"] - b["verified_drafts"]}
                           if a.get("verified_drafts") is not None else a
                           for a, b in zip(rank_stats(llm), ranks_before)]
    selector = length_selector(llm) if spec is not None and in_process else None
    if selector is not None:
        result["selector"] = selector.stats()  # lengths verified since the engine started (all runs above)
    sweep = settings.sweep_lengths
    if sweep and spec is not None and not in_process:
        result["round_ms"] = {"skipped": "the proposer is not in this process (tensor parallelism)"}
    elif sweep:
        result["round_ms"] = sweep_round_times(llm, spec, prompts, sweep, list(settings.sweep_batches),
                                               settings.sweep_steps, settings.sweep_warmup)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def top2_of(position_logprobs) -> list[list | None]:
    """``[[token, logprob], [runner-up, logprob]]`` at one position (``None`` for a missing runner-up)."""
    ranked = sorted(((int(t), float(x.logprob)) for t, x in position_logprobs.items()), key=lambda p: -p[1])
    return [list(ranked[0]), list(ranked[1]) if len(ranked) > 1 else None]


def sweep_round_times(llm, spec, prompts, lengths: list[int], batches: list[int], steps: int,
                      warmup: int = 4) -> dict:
    """Per-step decode time at each batch size: plain decoding (``spec`` None) once per batch size; with
    a drafter whose config fixes the length (``"hybridspec": {"fixed_length": K + 1}``) at every length
    of ``lengths`` (the proposer's selector is set between runs, as ``hybridspec calibrate costs`` does)."""
    from vllm_hybridspec.tools.costs import time_decode_steps
    from vllm_hybridspec.engine.compat import length_selector

    out = {}
    selector = None
    if spec is not None:
        selector = length_selector(llm)
        if selector is None or selector.options.fixed_length is None:
            return {"skipped": 'the config has no "hybridspec": {"fixed_length": ...}'}
    for b in batches:
        for w in (lengths if selector is not None else [None]):
            if selector is not None:
                if w > spec["num_speculative_tokens"] + 1:
                    continue
                selector.configure(fixed_length=w)
            t = time_decode_steps(llm, prompts, b, steps, warmup, f"sweep-{w}-{b}")
            t.length = w
            out[f"B{b}_w{w or 'plain'}"] = t.summary()
    if selector is not None:
        selector.configure(fixed_length=spec["num_speculative_tokens"] + 1)
    return out


def summary_table(results: list[dict], num_prompts: int) -> str:
    """One line per config; ``identical`` counts prompts whose output equals the first config's."""
    reference = next((r for r in results if "outputs" in r), None)
    lines = [f"{'config':<12} {'identical':>10} {'kv tokens':>11} {'tok/s bs1':>10} {'tok/s batch':>12} {'accept len':>10}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['name']:<12} ERROR {r['error'][:100]}")
            continue
        r["identical_prompts"] = identical_prompts(r["outputs"], reference["outputs"])
        if "top2_gaps" in reference:
            # for each prompt that differs: the reference's top-2 gap where the outputs first part
            r["divergence_gaps"] = [
                reference["top2_gaps"][p][next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)]
                for p, (a, b) in enumerate(zip(r["outputs"], reference["outputs"])) if a != b]
        acc = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        lines.append(f"{r['name']:<12} {r['identical_prompts']:>4}/{num_prompts:<5} {r['kv_capacity_tokens']:>11} "
                     f"{r['bs1_tokens_per_s'] or float('nan'):>10.1f} {r['batch_tokens_per_s']:>12.1f} {acc:>10}")
    return "\n".join(lines)


TRACEBACK_FRAMES = 12


def _failure(name: str, spec, e: BaseException) -> dict:
    """A failed config's result: the error in one line, and where it was raised (the innermost frames,
    file:line function, which an engine running in-process would otherwise lose)."""
    frames = traceback.extract_tb(e.__traceback__)[-TRACEBACK_FRAMES:]
    return {"name": name, "speculative_config": spec, "error": f"{type(e).__name__}: {e}",
            "traceback": [f"{f.filename}:{f.lineno} {f.name}" for f in frames]}


def _run_in_child(conn, name, spec, engine, settings, prompts) -> None:
    try:
        conn.send(run_config(name, spec, engine, settings, prompts))
    except Exception as e:  # the parent records it
        conn.send(_failure(name, spec, e))
    conn.close()


def _run_isolated(name: str, spec, engine: EngineOptions, settings: CompareSettings, prompts) -> dict:
    """``run_config`` in a fresh (spawned) process: an engine's GPU memory is only certainly given back
    when its process ends (on the H200 a second in-process engine at the 35B shape found 14.6 of
    139.8 GiB free), and a CUDA error cannot poison the next config."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_in_child, args=(child, name, spec, engine, settings, prompts))
    proc.start()
    child.close()
    try:
        result = parent.recv()
    except EOFError:
        result = None
    proc.join()
    if result is None:
        result = {"name": name, "speculative_config": spec,
                  "error": f"the config's process ended with exit code {proc.exitcode} before reporting"}
    return result


def run_all(configs: list[tuple[str, dict | None]], engine: EngineOptions, settings: CompareSettings, prompts,
            out: str | Path | None = None) -> list[dict]:
    """Every config in turn (each in its own process with ``settings.isolate``); a failing one is
    recorded with its error and the others still run. ``out`` is rewritten after every config."""
    results = []
    for name, spec in configs:
        if settings.isolate:
            result = _run_isolated(name, spec, engine, settings, prompts)
        else:
            try:
                result = run_config(name, spec, engine, settings, prompts)
            except Exception as e:
                result = _failure(name, spec, e)
        if "error" in result:
            print(f"[{name}] failed: {result['error']}", flush=True)
            for frame in result.get("traceback", []):
                print(f"[{name}]   at {frame}", flush=True)
        results.append(result)
        if out:
            write_text_atomic(out, json.dumps({"engine": asdict(engine), "settings": asdict(settings),
                                               "results": results}))
    return results


def parse_configs(items: list[str]) -> list[tuple[str, dict | None]]:
    """``NAME=JSON`` or ``NAME=none`` each; ``typer.BadParameter`` naming a bad one."""
    configs = []
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"--config {item!r}: expected NAME=JSON or NAME=none")
        if raw.strip() == "none":
            configs.append((name, None))
            continue
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"--config {name}: not valid JSON ({e}): {raw!r}") from None
        if not isinstance(spec, dict):
            raise typer.BadParameter(f"--config {name}: expected a JSON object, got {raw!r}")
        configs.append((name, spec))
    return configs


def compare(
    engine: EngineOptions,
    prompts: PromptOptions,
    config: list[str] = typer.Option(..., help="NAME=JSON (a --speculative-config, optionally with \"engine\": "
                                     "{...}) or NAME=none (plain decoding); repeatable, the first is the reference"),
    max_tokens: int = typer.Option(128, min=1, help="greedy tokens per prompt"),
    bs1_prompts: int = typer.Option(4, min=0, help="prompts also timed one at a time (batch size 1)"),
    logprobs: bool = typer.Option(False, help="record the top-2 tokens and log-probabilities (and their gap) at "
                                  "every output position, and the prompts' token ids"),
    isolate: bool = typer.Option(False, help="each config in its own process (an engine's GPU memory is only "
                                 "certainly freed when its process ends)"),
    sweep_lengths: str = typer.Option(None, help="also time decode steps at these verification lengths, for configs "
                                      'with "hybridspec": {"fixed_length": K + 1} (and plain decoding once)'),
    sweep_batches: str = typer.Option("1", help="batch sizes of the step sweep"),
    sweep_steps: int = typer.Option(32, min=2),
    sweep_warmup: int = typer.Option(4, min=1, help="untimed steps first (a shape's first use compiles)"),
    out: Path = typer.Option(..., help="result JSON (rewritten after every config)"),
) -> None:
    """Greedy outputs, KV capacity, acceptance and tokens/s of one target under several speculative
    configs, side by side."""
    settings = CompareSettings(max_tokens, bs1_prompts, logprobs, isolate,
                               int_list(sweep_lengths, "sweep-lengths") if sweep_lengths else None,
                               tuple(int_list(sweep_batches, "sweep-batches")), sweep_steps, sweep_warmup)
    configs = parse_configs(config)
    output_path(out, "--out", make_parents=False)
    token_prompts = prompts.load(engine.model)
    results = run_all(configs, engine, settings, token_prompts, out)
    typer.echo(summary_table(results, len(token_prompts)))
    written = {"engine": asdict(engine), "settings": asdict(settings), "results": results}
    if logprobs:  # what an identity check of the results needs besides them
        written["prompts"] = [p["prompt_token_ids"] for p in token_prompts]
    write_text_atomic(out, json.dumps(written))


compare = prompt_options(engine_options(compare))
