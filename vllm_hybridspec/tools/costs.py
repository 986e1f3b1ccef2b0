"""``hybridspec calibrate costs``: per-round decode time at fixed verification lengths, measured in vLLM.

One engine is started with the target, the drafter of ``--speculative-config`` and
``"hybridspec": {"fixed_length": K + 1}``; for every batch size ``B`` and length ``w`` the proposer's
length selector is set to ``w`` (so the target verifies exactly ``w`` tokens per request: the anchor
and ``w - 1`` drafts) and ``B`` requests are decoded step by step through ``LLMEngine.step``; the
wall time of each step after the warm-up is one round's time (drafting + verification + rejection
sampling + the GDN commit). ``--plain`` also starts the target without speculation and times its
decode steps at each ``B`` (``plain_ms``, for the batch gate and for comparison); ``--plain-gated``
times them in the same engine with drafting turned off instead (one engine start fewer).

The engine runs in this process with synchronous scheduling, so a step's wall time is the round's.
The cost file is what ``hybridspec calibrate fit --costs`` reads (docs/policy.md): ``round_ms`` holds
the per-step samples at ``B = 1``, ``batched`` the other batch sizes. A sidecar ``<out>.runs.json``
keeps the engine settings, tokens per round and KV capacity of each run.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the proposer is reachable


@dataclass
class StepTimes:
    batch: int
    length: int | None  # None: plain decoding
    ms: list[float] = field(default_factory=list)
    tokens: int = 0  # output tokens of the timed steps, all requests

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.ms)

    def summary(self) -> dict:
        return {"batch": self.batch, "length": self.length, "steps": len(self.ms),
                "mean_ms": round(self.mean_ms, 4), "median_ms": round(statistics.median(self.ms), 4),
                "tokens_per_step": round(self.tokens / len(self.ms), 3)}


def time_decode_steps(llm, prompts: list[dict], batch: int, steps: int, warmup: int, tag: str) -> StepTimes:
    """Add ``batch`` greedy requests, run ``warmup`` steps (prefill included), then time ``steps`` steps
    of ``llm.llm_engine.step()``; abort what is left. Every request must still be running when the
    timing ends, so ``max_tokens`` covers the most tokens the steps can produce."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has requests from an earlier measurement")
    k = (llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens
         if llm.llm_engine.vllm_config.speculative_config else 0)
    params = SamplingParams(temperature=0, max_tokens=(warmup + steps + 2) * (k + 1), ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, prompts[i % len(prompts)], params)
    produced = {rid: 0 for rid in ids}
    result = StepTimes(batch=batch, length=None)

    def step() -> tuple[float, int]:
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = (time.perf_counter() - t0) * 1e3
        new = 0
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            new += n - produced[out.request_id]
            produced[out.request_id] = n
            if out.finished:
                raise RuntimeError(f"request {out.request_id} finished during the measurement; raise max_tokens")
        return dt, new

    for _ in range(warmup):
        step()
    if min(produced.values()) == 0:
        raise RuntimeError(f"after {warmup} warm-up steps some of the {batch} requests have not started "
                           "decoding; raise --warmup")
    for _ in range(steps):
        dt, new = step()
        result.ms.append(dt)
        result.tokens += new
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def measure_costs(model: str, speculative_config: dict | None, lengths: list[int], batch_sizes: list[int],
                  prompts: list[dict], steps: int, warmup: int, engine_args: dict, plain: bool,
                  progress=None, plain_gated: bool = False) -> tuple[dict, dict]:
    """Return (cost file dict, runs sidecar dict). ``speculative_config`` None measures plain only.

    ``plain`` starts a second engine without speculation for the plain step times; ``plain_gated``
    takes them from the speculative engine itself with drafting turned off (the steps the batch gate
    runs: vLLM's plain decode path), which saves an engine start (minutes at full-size shapes)."""
    from vllm import LLM

    from vllm_hybridspec.engine.compat import kv_capacity_tokens

    runs: dict = {"model": model, "speculative_config": speculative_config, "engine_args": engine_args,
                  "steps": steps, "warmup": warmup, "runs": []}
    base = {"model": model, "skip_tokenizer_init": True, "seed": 0, "async_scheduling": False,
            "max_num_seqs": max(batch_sizes), **engine_args}
    costs: dict = {"version": 1}
    todo = len(batch_sizes) * ((len(lengths) if speculative_config else 0) + int(plain or plain_gated))
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, todo, label)

    if speculative_config:
        k = int(speculative_config["num_speculative_tokens"])
        bad = [w for w in lengths if not 1 <= w <= k + 1]
        if bad:
            raise ValueError(f"--lengths {bad} outside 1..num_speculative_tokens + 1 = {k + 1}")
        options = dict(speculative_config.get("hybridspec") or {})
        if options.get("select") or options.get("policy"):
            raise ValueError('--speculative-config: "hybridspec" may not select lengths here ("select"/"policy"); '
                             "the measurement fixes them")
        spec = {**speculative_config, "hybridspec": {**options, "fixed_length": k + 1}}
        llm = LLM(**base, speculative_config=spec, disable_log_stats=False)
        runs["kv_capacity_tokens"] = kv_capacity_tokens(llm)
        selector = engine_selector(llm, spec["method"])
        measure_round_costs(llm, selector, lengths, batch_sizes, prompts, steps, warmup, costs, runs,
                            plain_gated, tick)
        del llm
        _release()
    if plain:
        llm = LLM(**base, disable_log_stats=False)
        runs["plain_kv_capacity_tokens"] = kv_capacity_tokens(llm)
        for b in batch_sizes:
            t = time_decode_steps(llm, prompts, b, steps, warmup, f"plain-b{b}")
            runs["runs"].append(t.summary())
            if "batched" in costs:
                costs["batched"][str(b)]["plain_ms"] = round(t.mean_ms, 4)
            runs.setdefault("plain_ms", {})[str(b)] = round(t.mean_ms, 4)
            tick(f"plain B={b}: {t.mean_ms:.2f} ms")
        del llm
        _release()
    return costs, runs


def engine_selector(llm, method: str = "?"):
    """The length selector of an in-process engine's proposer (``"hybridspec"`` options given)."""
    from vllm_hybridspec.engine.compat import length_selector

    selector = length_selector(llm)
    if selector is None:
        raise RuntimeError(f"method {method!r} has no hybridspec length selector; the measurement needs a "
                           "drafter with one (hspec, dflash, replay_bench) and a \"hybridspec\" dict")
    return selector


def measure_round_costs(llm, selector, lengths: list[int], batch_sizes: list[int], prompts: list[dict],
                        steps: int, warmup: int, costs: dict, runs: dict, plain_gated: bool = False,
                        tick=None) -> None:
    """On a running speculative engine: per-step times at each fixed length ``w`` and batch size ``B``
    into ``costs`` (``round_ms`` at ``B = 1``; ``batched[B]``, B = 1 included, so the gate table covers
    every measured batch size) and their summaries into ``runs["runs"]``; with ``plain_gated`` also
    the steps without drafts (``plain_ms`` per ``B``). The selector verifies everything afterwards."""
    try:
        for b in batch_sizes:
            per_len = {}
            for w in lengths:
                selector.configure(fixed_length=w)
                t = time_decode_steps(llm, prompts, b, steps, warmup, f"w{w}b{b}")
                t.length = w
                per_len[str(w)] = [round(x, 4) for x in t.ms]
                runs["runs"].append(t.summary())
                if tick:
                    tick(f"B={b} w={w}: {t.mean_ms:.2f} ms")
            if b == 1:
                costs["round_ms"] = per_len
            costs.setdefault("batched", {})[str(b)] = {"round_ms": per_len}
            if plain_gated:
                selector.configure(drafting=False)
                t = time_decode_steps(llm, prompts, b, steps, warmup, f"gated-b{b}")
                summary = {**t.summary(), "plain": "gated"}
                runs["runs"].append(summary)
                costs["batched"][str(b)]["plain_ms"] = round(t.mean_ms, 4)
                runs.setdefault("plain_ms", {})[str(b)] = round(t.mean_ms, 4)
                if tick:
                    tick(f"plain (drafting off) B={b}: {t.mean_ms:.2f} ms")
    finally:
        selector.configure()


def _release() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_costs(costs: dict, runs: dict, out: Path) -> Path:
    from vllm_hybridspec.policy.files import write_text_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    if "round_ms" in costs:
        write_text_atomic(out, json.dumps(costs, indent=1))
    sidecar = out.with_name(out.stem + ".runs.json")
    write_text_atomic(sidecar, json.dumps(runs, indent=1))
    return sidecar
