"""``hybridspec calibrate capture`` and ``hybridspec calibrate costs``: the two calibration
measurements that run vLLM (round records of a drafter, round times of the engine); ``calibrate fit``
turns them into a policy file (``vllm_hybridspec.policy``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import typer

from vllm_hybridspec.policy.cli import calibrate_app, fail
from vllm_hybridspec.policy.errors import InputError
from vllm_hybridspec.policy.files import check_writable
from vllm_hybridspec.tools.engine_args import (
    EngineOptions,
    PromptOptions,
    engine_options,
    json_object,
    prompt_options,
)


def capture(
    engine: EngineOptions,
    prompts: PromptOptions,
    speculative_config: str = typer.Option(..., help="the drafter, as --speculative-config JSON (method, model, "
                                           "num_speculative_tokens = D)"),
    out: Path = typer.Option(..., help="round records to write (JSONL, docs/policy.md)"),
    output_len: int = typer.Option(256, min=1, help="tokens generated per prompt (EOS ignored)"),
    temperature: float = typer.Option(0.0, min=0.0, help="sampling temperature of the calibration run"),
) -> None:
    """Run target + drafter through vLLM verifying every draft token and write the round records
    (confidences, entropies, accepted counts) that `calibrate fit --records` reads."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _check_out(out)
    if not math.isfinite(temperature):
        raise fail(ValueError(f"--temperature {temperature}: expected a finite number >= 0"))
    spec = _speculative_config(speculative_config)
    options = dict(spec.get("hybridspec") or {})
    for key in ("policy", "select", "fixed_length", "batched"):
        if options.get(key):
            raise fail(ValueError(f'--speculative-config: "hybridspec.{key}" = {options[key]!r}; a capture run '
                                  "verifies every draft token"))
    token_prompts = _calibration_prompts(engine.model, prompts)
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "hybridspec": {**options, "capture": str(out)}}
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(**engine.llm_kwargs(speculative_config=spec, disable_log_stats=False))
    except ValueError as e:
        raise fail(e) from None
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=0)
    llm.generate(token_prompts, params, use_tqdm=True)
    from vllm_hybridspec.tools.compare import spec_counters

    counters = spec_counters(llm)
    from vllm_hybridspec.policy.records import Rounds, load_records

    try:
        rounds = Rounds.from_records(load_records(out))
    except InputError as e:
        raise fail(InputError(f"the capture run wrote no usable records: {e}")) from None
    full = ~rounds.truncated
    mean = rounds.accepted[full].double().mean().item() if full.any() else float("nan")
    typer.echo(f"wrote {out}: {len(rounds)} rounds of D = {rounds.draft_len} drafts from {len(token_prompts)} "
               f"prompts, {int(full.sum())} untruncated, mean accepted {mean:.3f} (acceptance length {1 + mean:.3f})")
    drafts, accepted = counters.get("num_drafts"), counters.get("num_accepted_tokens")
    typer.echo(f"vLLM's counters: {drafts:.0f} drafts, {accepted:.0f} accepted tokens; records: {len(rounds)} rounds, "
               f"{int(rounds.accepted.sum())} accepted")
    if drafts != len(rounds) or accepted != int(rounds.accepted.sum()):
        typer.echo("warning: the records do not match vLLM's spec-decode counters (a round was missed or counted "
                   "twice); do not fit a policy from them", err=True)
        raise typer.Exit(1)


def _check_out(out: Path) -> None:
    """--out: a file path below a directory that exists or can be made, checked before any engine starts."""
    try:
        check_writable(out, "--out", make_parents=True)
    except InputError as e:
        raise fail(e) from None


def _speculative_config(text: str) -> dict:
    spec = _json_object(text, "speculative-config")
    if "num_speculative_tokens" not in spec:
        raise fail(ValueError(f"--speculative-config needs num_speculative_tokens: {text!r}"))
    return spec


def _calibration_prompts(model: str, prompts: PromptOptions, num_prompts: int | None = None) -> list[dict]:
    """Token-id prompts of ``prompts`` (random ids when no ``--prompts`` file is given), ``num_prompts``
    of them if given."""
    try:
        return dataclasses.replace(prompts, random_prompts=prompts.prompts is None,
                                   num_prompts=num_prompts or prompts.num_prompts).load(model)
    except typer.BadParameter as e:
        raise fail(ValueError(str(e))) from None


def _json_object(text: str, name: str) -> dict:
    try:
        return json_object(text, name)
    except typer.BadParameter as e:
        raise fail(ValueError(str(e))) from None


def costs(
    engine: EngineOptions,
    prompts: PromptOptions,
    speculative_config: str = typer.Option(None, help="the drafter, as --speculative-config JSON (method, model, "
                                           "num_speculative_tokens); omit with --plain to time plain decoding only"),
    out: Path = typer.Option(..., help="cost file to write (JSON, docs/policy.md); the runs go to <out>.runs.json"),
    lengths: str = typer.Option("1,2,4,8,12,16", help="verification lengths w (anchor + drafts), 1..K+1"),
    batch_sizes: str = typer.Option("1", help="concurrent requests per measurement, comma-separated"),
    plain: bool = typer.Option(False, help="also time plain decoding (no drafter) at each batch size"),
    plain_gated: bool = typer.Option(False, help="time plain decoding in the speculative engine itself, with "
                                     "drafting turned off as the batch gate does (no second engine start)"),
    steps: int = typer.Option(48, min=2, help="timed decode steps per (batch size, length)"),
    warmup: int = typer.Option(4, min=1, help="steps before timing (prefill included)"),
) -> None:
    """Per-round decode time at fixed verification lengths, measured through vLLM (the cost file of
    `calibrate fit`)."""
    from tqdm import tqdm

    def numbers(text: str, name: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise fail(ValueError(f"--{name} must be comma-separated integers, got {text!r}")) from None
        if not values or min(values) < 1:
            raise fail(ValueError(f"--{name} must be positive integers, got {text!r}"))
        return sorted(set(values))

    _check_out(out)
    spec = None if speculative_config is None else _speculative_config(speculative_config)
    if spec is None and not plain:
        raise fail(ValueError("give --speculative-config (round times) and/or --plain (plain decoding)"))
    if plain_gated and (spec is None or plain):
        raise fail(ValueError("--plain-gated times plain steps in the speculative engine: it needs "
                              "--speculative-config and excludes --plain"))
    batches = numbers(batch_sizes, "batch-sizes")
    ws = numbers(lengths, "lengths")
    token_prompts = _calibration_prompts(engine.model, prompts, max(batches))
    if len(token_prompts) < max(batches):
        raise fail(ValueError(f"--prompts {str(prompts.prompts)!r} has {len(token_prompts)} prompts; "
                              f"--batch-sizes needs {max(batches)}"))
    from vllm_hybridspec.tools.costs import measure_costs, write_costs

    bar = tqdm(desc="calibrate costs", unit="run")

    def progress(done: int, total: int, label: str) -> None:
        bar.total = total
        bar.update(done - bar.n)
        bar.set_postfix_str(label)

    try:
        cost_file, runs = measure_costs(engine.model, spec, ws, batches, token_prompts,
                                        steps, warmup, engine.llm_kwargs(), plain, progress, plain_gated=plain_gated)
    except ValueError as e:
        bar.close()
        raise fail(e) from None
    bar.close()
    sidecar = write_costs(cost_file, runs, out)
    for r in runs["runs"]:
        what = "plain" if r["length"] is None else f"w={r['length']:<2}"
        typer.echo(f"B={r['batch']:<3} {what:<6} {r['mean_ms']:9.3f} ms/step  {r['tokens_per_step']:.2f} tokens/step")
    typer.echo(f"wrote {out if 'round_ms' in cost_file else '(no cost file: plain only)'} and {sidecar}")


calibrate_app.command("capture")(prompt_options(engine_options(capture)))
calibrate_app.command("costs")(prompt_options(engine_options(costs)))
