"""``hybridspec check``: engine-level checks that are not tests (they need a real target, or a GPU).

``hybridspec check compiled-vs-eager``: the greedy output of one target served compiled (vLLM's
default: torch.compile and CUDA graphs) and eagerly (``enforce_eager``), plain or with a drafter. A
layer of the plugin that torch.compile traced away, or a graph that replays stale inputs, makes them
differ::

    VLLM_TARGET_DEVICE=cpu hybridspec check compiled-vs-eager --model models/hybrid --dtype float32 \\
        --prompts models/prompts/heldout.jsonl --num-prompts 2 \\
        --speculative-config '{"method": "hspec", "model": "models/hybrid-hspec", "num_speculative_tokens": 7}' \\
        --engine-args '{"mamba_ssm_cache_dtype": "float32"}'

It prints the prompts whose outputs differ with the first differing position, and exits 1 if any do
(a float tie can also make them differ: look at where; ``hybridspec compare --logprobs`` measures the
gaps).
"""

from __future__ import annotations

import gc
import os

import typer

from vllm_hybridspec.tools.engine_args import EngineOptions, PromptOptions, engine_options, json_object
from vllm_hybridspec.tools.engine_args import prompt_options

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

check_app = typer.Typer(help="Engine-level checks (compiled against eager).", no_args_is_help=True)


def greedy_outputs(engine: EngineOptions, spec: dict | None, prompts: list[dict], max_tokens: int,
                   eager: bool) -> list[list[int]]:
    """Greedy token ids of every prompt from one engine, which is shut down afterwards."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine.llm_kwargs(speculative_config=spec, enforce_eager=eager))
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (``None`` if equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compiled_vs_eager(
    engine: EngineOptions,
    prompts: PromptOptions,
    speculative_config: str = typer.Option(None, help="a drafter, as --speculative-config JSON (none: plain "
                                           "decoding)"),
    max_tokens: int = typer.Option(16, min=1, help="greedy tokens per prompt"),
) -> None:
    """Greedy output of one target compiled (vLLM's default) and eager: equal, or exit 1."""
    spec = json_object(speculative_config, "speculative-config") or None
    rows = prompts.load(engine.model)
    outputs = {mode: greedy_outputs(engine, spec, rows, max_tokens, eager=mode == "eager")
               for mode in ("eager", "compiled")}
    diffs = [(i, first_difference(e, c)) for i, (e, c) in enumerate(zip(outputs["eager"], outputs["compiled"]))]
    diffs = [(i, at) for i, at in diffs if at is not None]
    for i, at in diffs:
        typer.echo(f"prompt {i}: compiled != eager from output token {at}: eager {outputs['eager'][i][at:at + 8]}, "
                   f"compiled {outputs['compiled'][i][at:at + 8]}")
    typer.echo(f"compiled == eager on {len(rows) - len(diffs)}/{len(rows)} prompts ({max_tokens} tokens each)")
    raise typer.Exit(1 if diffs else 0)


check_app.command("compiled-vs-eager")(prompt_options(engine_options(compiled_vs_eager)))
