"""``hybridspec replay-record``: the target's greedy continuations of the benchmark prompts, recorded by
plain decoding, for the ``replay_bench`` proposer (benchmarking only; ``engine/replay/``)."""

from __future__ import annotations

from pathlib import Path

import typer

from vllm_hybridspec.bench.prompts import load_prompts
from vllm_hybridspec.engine.replay.data import save_continuations
from vllm_hybridspec.policy.errors import InputError
from vllm_hybridspec.tools.engine_args import EngineOptions, engine_options, output_path


def _fail(message: str, code: int = 1):
    typer.echo(f"hybridspec replay-record: error: {message}", err=True)
    raise typer.Exit(code)


def record_continuations(model: str, prompts: list, max_tokens: int, extra_tokens: int, out: str | Path,
                         **llm_kwargs) -> int:
    """Plain greedy decoding of ``prompts`` (text or token-id lists) through ``vllm.LLM``, EOS ignored,
    ``max_tokens + extra_tokens`` tokens each (``extra_tokens`` >= the replay's K); writes the
    continuations file and returns the number of requests. ``llm_kwargs`` go to ``vllm.LLM``
    (use the benchmark server's dtype and model settings: the replay needs the same greedy tokens)."""
    from vllm import LLM, SamplingParams

    if max_tokens < 1 or extra_tokens < 0:
        raise InputError(f"max_tokens must be >= 1 and extra_tokens >= 0, got {max_tokens} and {extra_tokens}")
    inputs = [{"prompt_token_ids": list(p)} if isinstance(p, list) else p for p in prompts]
    llm = LLM(model=model, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens + extra_tokens, ignore_eos=True)
    outputs = llm.generate(inputs, params)
    seen: set[tuple[int, ...]] = set()
    entries = []
    for o in outputs:
        prompt = tuple(o.prompt_token_ids)
        if prompt in seen:  # a benchmark cycles its prompts; one line each
            continue
        seen.add(prompt)
        entries.append((list(prompt), list(o.outputs[0].token_ids), max_tokens))
    save_continuations(entries, out)
    return len(entries)


def replay_record(
    engine: EngineOptions,
    out: Path = typer.Option(..., "--out", "-o", help="continuations JSONL for the replay_bench proposer"),
    prompts: Path = typer.Option(None, help="JSONL prompts, as for `hybridspec bench`"),
    dataset: str = typer.Option(None, help="a `datasets` name to take prompts from instead"),
    dataset_split: str = typer.Option("train"),
    prompt_field: str = typer.Option("prompt"),
    output_len: int = typer.Option(256, min=1, help="the benchmark's --output-len"),
    num_speculative_tokens: int = typer.Option(15, min=1, help="the largest K the replay will propose; recorded "
                                                               "past output-len by this many tokens"),
) -> None:
    """For benchmarking only: record the target's greedy continuations of the benchmark prompts (plain
    decoding, EOS ignored) for the replay_bench proposer (docs/bench.md, "Replayed acceptance"). Use the
    benchmark server's dtype and model settings (``--load-format dummy``: vLLM seeds random weights per
    parameter, so the server gets the same ones)."""
    output_path(out, "--out", make_parents=False)
    try:
        prompt_list = load_prompts(prompts, dataset, dataset_split, prompt_field)
    except ValueError as e:
        _fail(str(e), 2)
    kwargs = engine.llm_kwargs(skip_tokenizer_init=False)  # text prompts need the tokenizer
    kwargs.pop("model")
    n = record_continuations(engine.model, prompt_list, output_len, num_speculative_tokens, out, **kwargs)
    typer.echo(f"recorded {n} greedy continuations of {output_len} + {num_speculative_tokens} tokens to {out}")


replay_record = engine_options(replay_record)
