"""One engine start, every way of decoding it offers: costs, a fitted policy, and decode speed and
greedy output with drafting off, with every draft verified and with selected lengths.

Engine starts at full-size shapes take minutes (174-379 s at the Qwen3.6-35B-A3B shape on the
H200), and a GPU session has 30 of them. All of the following therefore share one in-process engine
with the target, the drafter and ``"hybridspec": {"fixed_length": K + 1}``; the proposer's length
selector is switched between the measurements (``LengthSelector.configure``):

1. **costs**: per-step decode time at each fixed verification length ``w`` and batch size ``B``,
   and with drafting turned off (the steps the batch gate runs: vLLM's plain decode path), written
   as the cost file of ``hybridspec calibrate fit`` (``policy/measure.py``);
2. **fit**: a policy from round records (a capture run of a drafter, ``hybridspec calibrate
   capture``) and those costs (``policy/calibrate.py``);
3. **modes**: ``plain`` (drafting off), ``all`` (every draft verified), ``sel`` (the fitted policy's
   lengths and gate), ``sel-nogate`` (its lengths alone) and ``sel-batched`` (its batched variant: one
   length shared by the batch, and the gate). For each: the greedy outputs of all
   prompts submitted at once (each mode's compared token for token with ``plain``), vLLM's
   spec-decode counters over them, the lengths the selector chose, and decode steps at each batch
   size (ms per step, tokens per step, tokens/s). With ``logprobs`` each mode also records the top-2
  tokens and log-probabilities at every output position, as ``hybridspec compare --logprobs`` does, so
  the outputs can be judged against a separate plain engine's (``tests/serving/identity.py``).

``plain`` here is vLLM's own decode path in the speculative engine: what the engine runs whenever
the gate turns drafting off. ``reference`` (a ``hybridspec replay-record`` continuations file, i.e.
greedy decoding by a separate engine without speculation) adds each mode's identity with that
engine's output.
The command line is ``hybridspec evaluate``, e.g. at the 35B shape with dummy weights and the dummy
H-Spec drafter of ``hybridspec full-shape``::

    hybridspec evaluate --model out/full-shape/target --load-format dummy --random-prompts --vocab 200000 \
        --speculative-config '{"method": "hspec", "model": "out/full-shape/hspec", "num_speculative_tokens": 7}' \
        --engine-args '{"max_model_len": 2048, "mamba_ssm_cache_dtype": "float32",
                        "additional_config": {"gdn_prefill_backend": "triton"}}' \
        --records models/hybrid-hspec/records.jsonl.gz --lengths 1,2,3,4,6,8 --batch-sizes 1,4 \
        --out-dir out/evaluate-35b
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the proposer is reachable

import typer  # noqa: E402

from vllm_hybridspec.policy.files import write_text_atomic  # noqa: E402
from vllm_hybridspec.tools.compare import identical_prompts  # noqa: E402
from vllm_hybridspec.tools.engine_args import (  # noqa: E402
    EngineOptions,
    PromptOptions,
    engine_options,
    input_file,
    int_list,
    json_object,
    output_path,
    prompt_options,
)

MODES = ("plain", "all", "sel", "sel-nogate", "sel-batched")


def configure_mode(selector, mode: str, k: int, policy: str | None) -> None:
    """Set ``selector`` for one of :data:`MODES`."""
    if mode == "plain":
        selector.configure(drafting=False)
    elif mode == "all":
        selector.configure(fixed_length=k + 1)
    elif mode in ("sel", "sel-nogate", "sel-batched"):
        if policy is None:
            raise ValueError(f"mode {mode!r} needs a policy file")
        selector.configure(policy=policy, gate=mode != "sel-nogate", batched=mode == "sel-batched")
    else:
        raise ValueError(f"unknown mode {mode!r}; modes are {', '.join(MODES)}")


def run_mode(llm, selector, mode: str, k: int, policy: str | None, prompts: list[dict], max_tokens: int,
             batch_sizes: list[int], steps: int, warmup: int, logprobs: bool = False) -> dict:
    """Greedy outputs (with their top-2 log-probabilities when ``logprobs``), counters and per-batch-size
    step times of one mode."""
    from vllm import SamplingParams

    from vllm_hybridspec.tools.compare import counter_delta, spec_counters, top2_of
    from vllm_hybridspec.tools.costs import time_decode_steps

    from vllm_hybridspec.engine.compat import in_process_runner
    from vllm_hybridspec.engine.length.cut import cut_of

    configure_mode(selector, mode, k, policy)
    before_stats = selector.stats()
    before = spec_counters(llm)
    cut = cut_of(in_process_runner(llm))  # the drafts the rejection sampler saw (vLLM counts all K it scheduled)
    verified_before = int(cut.verified_drafts) if cut is not None else 0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                logprobs=2 if logprobs else None), use_tqdm=False)
    batch_s = time.perf_counter() - t0
    after = spec_counters(llm)
    counters, acceptance_length = counter_delta(before, after)
    stats = selector.stats()
    lengths = {w: n - before_stats["rows_at_length"].get(w, 0) for w, n in stats["rows_at_length"].items()}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "mode": mode,
        "outputs": tokens,
        "batch_tokens_per_s": sum(map(len, tokens)) / batch_s,
        "spec_counters": counters,
        "mean_acceptance_length": acceptance_length,
        "rows_at_length": {w: n for w, n in lengths.items() if n},
        "verified_drafts": (int(cut.verified_drafts) - verified_before if cut is not None
                            else counters.get("num_draft_tokens", 0)),
        "gated_steps": stats["gated_steps"] - before_stats["gated_steps"],
        "steps": {},
    }
    if logprobs:
        result["top2"] = [[top2_of(lp) for lp in o.outputs[0].logprobs] for o in outs]
    for b in batch_sizes:
        t = time_decode_steps(llm, prompts, b, steps, warmup, f"{mode}-b{b}")
        result["steps"][str(b)] = {**t.summary(), "tokens_per_s": round(t.tokens / (sum(t.ms) / 1e3), 2)}
    return result


def evaluate(model: str, speculative_config: dict, engine_args: dict, prompts: list[dict], out_dir: Path,
             records: str | None = None, policy: str | None = None, lengths: list[int] | None = None,
             batch_sizes: list[int] = (1,), modes: list[str] = MODES, steps: int = 32, warmup: int = 4,
             max_tokens: int = 64, min_length: int = 1, reference: str | None = None, logprobs: bool = False,
             progress=print) -> dict:
    """Costs (when ``lengths``), the policy fit (when ``records``; else ``policy`` is used as given) and
    the ``modes``, all on one engine; writes ``costs.json`` (+ ``costs.runs.json``), ``policy.json`` and
    ``evaluate.json`` under ``out_dir`` and returns the last one's content."""
    from vllm import LLM

    from vllm_hybridspec.policy.calibrate import fit_policy
    from vllm_hybridspec.policy.cost import load_costs
    from vllm_hybridspec.tools.costs import engine_selector, measure_round_costs, write_costs
    from vllm_hybridspec.policy.policy_file import save_policy
    from vllm_hybridspec.policy.records import Rounds, load_records
    from vllm_hybridspec.engine.compat import in_process_drafter, kv_capacity_tokens

    k = int(speculative_config["num_speculative_tokens"])
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; modes are {', '.join(MODES)}")
    if any(m.startswith("sel") for m in modes) and records is None and policy is None:
        raise ValueError("the 'sel' modes need --records (to fit a policy) or --policy")
    if records is not None and not lengths:
        raise ValueError("fitting a policy from --records needs --lengths (the costs it is fitted to)")
    bad = [w for w in lengths or [] if not 1 <= w <= k + 1]
    if bad:
        raise ValueError(f"--lengths {bad} outside 1..num_speculative_tokens + 1 = {k + 1}")
    if policy is not None and not Path(policy).is_file():
        raise ValueError(f"policy file {policy!r} does not exist")
    options = dict(speculative_config.get("hybridspec") or {})
    chosen = sorted(set(options) & {"select", "policy", "capture", "batched", "fixed_length"})
    if chosen:
        raise ValueError(f'--speculative-config: "hybridspec" may not set {chosen} here; the evaluation sets the '
                         "lengths itself, mode by mode")
    if not prompts:
        raise ValueError("no prompts to evaluate")
    spec = {**speculative_config, "hybridspec": {**options, "fixed_length": k + 1}}
    out_dir.mkdir(parents=True, exist_ok=True)
    expected = plain_engine_outputs(reference, prompts, max_tokens) if reference is not None else None
    rounds = Rounds.from_records(load_records(records)) if records is not None else None
    if rounds is not None and rounds.draft_len != k:
        raise ValueError(f"records {records!r} hold drafts of {rounds.draft_len} tokens but "
                         f"num_speculative_tokens={k}")

    t0 = time.perf_counter()
    # synchronous scheduling: a step's wall time is its round's; the counters need the stats logger
    llm = LLM(**{"model": model, "skip_tokenizer_init": True, "seed": 0,
                 "max_num_seqs": max(max(batch_sizes), len(prompts)), **engine_args,
                 "async_scheduling": False, "disable_log_stats": False, "speculative_config": spec})
    result: dict = {"model": model, "speculative_config": spec, "engine_args": engine_args,
                    "engine_start_s": round(time.perf_counter() - t0, 1),
                    "kv_capacity_tokens": kv_capacity_tokens(llm), "modes": {}}
    if logprobs:
        result["prompts"] = [p["prompt_token_ids"] for p in prompts]
    progress(f"engine started in {result['engine_start_s']} s, KV capacity {result['kv_capacity_tokens']} tokens")
    selector = engine_selector(llm, spec["method"])

    if lengths:
        costs: dict = {"version": 1}
        runs: dict = {"model": model, "speculative_config": spec, "engine_args": engine_args, "steps": steps,
                      "warmup": warmup, "runs": [], "kv_capacity_tokens": result["kv_capacity_tokens"]}
        measure_round_costs(llm, selector, sorted(lengths), list(batch_sizes), prompts, steps, warmup, costs,
                            runs, plain_gated=True, tick=progress)
        write_costs(costs, runs, out_dir / "costs.json")
        result["costs"] = runs["runs"]
    if rounds is not None:
        fitted, notes = fit_policy(rounds, load_costs(out_dir / "costs.json"), min_length,
                                   {"records": str(records), "costs": str(out_dir / "costs.json")})
        policy = str(out_dir / "policy.json")
        save_policy(fitted, policy)
        result["policy_notes"] = notes
        result["policy_gate"] = {str(b): on for b, on in fitted.gate.items()}
        progress(f"fitted {policy}: rho = {fitted.rate:.5f} tokens/ms, gate {result['policy_gate']}")
    result["policy"] = policy

    for mode in modes:
        r = run_mode(llm, selector, mode, k, policy, prompts, max_tokens, list(batch_sizes), steps, warmup, logprobs)
        if expected is not None:
            r["identical_to_plain_engine"] = identical_prompts(r["outputs"], expected)
        result["modes"][mode] = r
        write_text_atomic(out_dir / "evaluate.json", json.dumps(result))
        progress(mode_line(r, result["modes"].get("plain")))
    selector.configure(fixed_length=k + 1)
    drafter = in_process_drafter(llm)
    if hasattr(drafter, "stats"):  # the replay proposer: rounds proposed, requests that left the recording
        result["drafter_stats"] = drafter.stats()
    write_text_atomic(out_dir / "evaluate.json", json.dumps(result))
    return result


def plain_engine_outputs(path: str, prompts: list[dict], max_tokens: int) -> list[list[int]]:
    """The first ``max_tokens`` tokens a plain engine produced for each prompt, from a continuations
    file (``hybridspec replay-record``); ``ValueError`` when a prompt is not in it or too short."""
    import numpy as np

    from vllm_hybridspec.engine.replay.data import load_continuations

    found = load_continuations(path)
    outputs = []
    for i, p in enumerate(prompts):
        tokens = np.asarray(p["prompt_token_ids"], dtype=np.int64)
        entry = found.find(tokens)
        if entry is None or len(entry.prompt) != len(tokens):
            raise ValueError(f"prompt {i} ({len(tokens)} tokens, starting {tokens[:8].tolist()}) is not in the "
                             f"reference continuations '{path}'")
        if len(entry.output) < max_tokens:
            raise ValueError(f"the reference continuations '{path}' hold {len(entry.output)} tokens for prompt {i}; "
                             f"--max-tokens is {max_tokens}")
        outputs.append(entry.output[:max_tokens].tolist())
    return outputs


def mode_line(r: dict, plain: dict | None) -> str:
    same = "-" if plain is None else f"{identical_prompts(r['outputs'], plain['outputs'])}/{len(r['outputs'])}"
    acc = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
    steps = "  ".join(f"B={b}: {s['mean_ms']:.2f} ms/step {s['tokens_per_step']:.2f} tok/step "
                      f"{s['tokens_per_s']:.1f} tok/s" for b, s in r["steps"].items())
    if "identical_to_plain_engine" in r:
        same += f" (plain engine {r['identical_to_plain_engine']}/{len(r['outputs'])})"
    return (f"{r['mode']:<11} identical to plain {same:>6}  accept len {acc:>5}  gated steps {r['gated_steps']:>4}  "
            f"lengths {r['rows_at_length']}  {steps}")


def summary_markdown(result: dict) -> str:
    """The modes as a table (one row per mode and batch size), for docs/benchmarks."""
    plain = result["modes"].get("plain")
    lines = ["| mode | identical to plain (same engine; plain engine) | acceptance length | B | ms/step | tokens/step "
             "| tokens/s | vs plain |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        same = "-" if plain is None else f"{identical_prompts(r['outputs'], plain['outputs'])}/{len(r['outputs'])}"
        if "identical_to_plain_engine" in r:
            same += f"; {r['identical_to_plain_engine']}/{len(r['outputs'])}"
        acc = f"{r['mean_acceptance_length']:.3f}" if r["mean_acceptance_length"] else "-"
        for b, s in r["steps"].items():
            ratio = "-" if plain is None else f"{s['tokens_per_s'] / plain['steps'][b]['tokens_per_s']:.2f}x"
            lines.append(f"| {mode} | {same} | {acc} | {b} | {s['mean_ms']:.2f} | {s['tokens_per_step']:.2f} | "
                         f"{s['tokens_per_s']:.1f} | {ratio} |")
    return "\n".join(lines)


def evaluate_command(
    engine: EngineOptions,
    prompts: PromptOptions,
    speculative_config: str = typer.Option(..., help="the drafter, as --speculative-config JSON"),
    records: Path = typer.Option(None, help="round records to fit the policy to (hybridspec calibrate capture)"),
    policy: Path = typer.Option(None, help="a policy file to use as it is (instead of --records)"),
    lengths: str = typer.Option(None, help="verification lengths to time (the cost file)"),
    batch_sizes: str = typer.Option("1", help="batch sizes of the step timings"),
    modes: str = typer.Option(",".join(MODES), help="modes to run"),
    steps: int = typer.Option(32, min=2),
    warmup: int = typer.Option(4, min=1),
    max_tokens: int = typer.Option(64, min=1),
    min_length: int = typer.Option(1, min=1, max=2, help="shortest length the policy may pick (1 or 2)"),
    reference: Path = typer.Option(None, help="continuations of a plain engine (hybridspec replay-record) to compare "
                                   "every mode's greedy output with"),
    logprobs: bool = typer.Option(False, help="record the top-2 tokens and log-probabilities at every output "
                                  "position of every mode, and the prompts' token ids"),
    out_dir: Path = typer.Option(..., help="costs.json, policy.json, evaluate.json and summary.md go here"),
) -> None:
    """Costs, a fitted policy and decode speed / greedy output with drafting off, every draft verified and
    selected lengths, all on one engine start."""
    if records is not None and policy is not None:
        raise typer.BadParameter("give --records (fit a policy) or --policy (use one), not both")
    unknown = [m for m in modes.split(",") if m and m not in MODES]
    if unknown or not modes.strip(","):
        raise typer.BadParameter(f"--modes {modes!r}: {'unknown modes ' + str(unknown) if unknown else 'no mode'}; "
                                 f"modes are {', '.join(MODES)}")
    if any(m.startswith("sel") for m in modes.split(",")) and records is None and policy is None:
        raise typer.BadParameter(f"--modes {modes!r}: the 'sel' modes need --records (to fit a policy) or --policy")
    input_file(records, "--records", "round records, JSONL (hybridspec calibrate capture)")
    input_file(policy, "--policy", "a policy file (hybridspec calibrate fit)")
    input_file(reference, "--reference", "continuations JSONL (hybridspec replay-record)")
    output_path(out_dir, "--out-dir", directory=True)
    try:
        result = evaluate(engine.model, json_object(speculative_config, "speculative-config"), engine.llm_kwargs(),
                          prompts.load(engine.model), out_dir, records=records and str(records),
                          policy=policy and str(policy), lengths=int_list(lengths, "lengths") if lengths else None,
                          batch_sizes=int_list(batch_sizes, "batch-sizes"), modes=[m for m in modes.split(",") if m],
                          steps=steps, warmup=warmup, max_tokens=max_tokens, min_length=min_length,
                          reference=reference and str(reference), logprobs=logprobs,
                          progress=lambda line: typer.echo(line))
    except ValueError as e:  # bad settings, prompts, records or policy (InputError is a ValueError)
        typer.echo(f"hybridspec evaluate: error: {e}", err=True)
        raise typer.Exit(2) from None
    table = summary_markdown(result)
    write_text_atomic(out_dir / "summary.md", table + "\n")
    typer.echo(table)


evaluate_command = prompt_options(engine_options(evaluate_command))
