"""The device-side cut's pieces (``engine/length/cut.py``, no engine) against plain-Python references
on fresh random batches: which token each token is routed as, the rows ended at their cut with the
bonus token, the bonus index moved to the cut, and the rows' lengths gathered by request id across
a reordered batch. The engine-level checks (greedy identity, planted cut bugs, the sampling
distribution) are in ``tests/serving``."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hybridspec.engine.length.cut import NO_CUT, StepCut, cuts_nothing, end_rows_at_cut
from vllm_hybridspec.engine.length.selector import RoundLayout
from vllm_hybridspec.kernels.cut import route_tokens_torch

from ...seeds import fresh_seed


def random_step(gen, n, k):
    """Rows of ``K + 1`` tokens (decodes with drafts) or of 1..20 (prefill chunks), their offsets."""
    spec = torch.rand(n, generator=gen) < 0.7
    lens = torch.where(spec, torch.full((n,), k + 1), torch.randint(1, 21, (n,), generator=gen))
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = lens.cumsum(0)
    return spec, lens, qsl


def test_route_tokens_sends_each_cut_token_to_its_rows_first_token():
    gen = torch.Generator().manual_seed(fresh_seed("cut routing"))
    k, n = 7, 9
    cut = StepCut(max_num_reqs=16, max_num_tokens=256, device=torch.device("cpu"), pin=False)
    spec, lens, qsl = random_step(gen, n, k)
    w = torch.where(spec, torch.randint(1, k + 2, (n,), generator=gen), NO_CUT).to(torch.int32)
    route_tokens_torch(qsl, n, w, cut.source)
    want = list(range(256))
    for r in range(n):
        for j in range(int(lens[r])):
            if j >= int(w[r]):
                want[int(qsl[r]) + j] = int(qsl[r])
    assert cut.source.tolist() == want
    assert int((cut.source != torch.arange(256)).sum()) > 0  # something was cut
    # a router call over the step's tokens (padded) gathers its rows by source
    logits = torch.randn(int(qsl[-1]) + 3, 8, generator=gen)
    gathered = logits[torch.tensor(want[: logits.shape[0]])]
    cut.active = True  # an eager forward of a step that cuts
    assert torch.equal(cut.route(logits), gathered)
    assert cut.route(torch.randn(300, 8, generator=gen)).shape == (300, 8)  # larger than the buffers: untouched
    # a graph captured for a step that may cut gathers whatever the capture's own step does
    cut.active = False
    assert torch.equal(cut.route(logits, capturing=True), gathered)
    # no gather where no token can be cut: an eager step that does not cut, a one-token-per-request graph
    assert cut.route(logits) is logits
    cut.active = True
    assert cut.route(logits, capturing=True, one_token_per_request=True) is logits
    cut.reset()
    assert torch.equal(cut.source, torch.arange(256)) and not cut.active


def test_rows_end_at_their_cut_with_the_bonus_token():
    """A row that accepted at least ``v`` drafts ends with the bonus at position ``v``; one rejected
    before ``v`` keeps its recovered token and its ``-1`` padding."""
    gen = torch.Generator().manual_seed(fresh_seed("cut rows"))
    n, k = 40, 7
    accepted = torch.randint(0, k + 1, (n,), generator=gen)  # drafts accepted by the full rejection pass
    tokens = torch.randint(0, 1000, (n, k + 1), generator=gen)
    tokens[torch.arange(k + 1)[None, :] > accepted[:, None]] = -1
    bonus = torch.randint(1000, 2000, (n, 1), generator=gen)
    v = torch.randint(0, k + 1, (n,), generator=gen)
    got = end_rows_at_cut(tokens, bonus, v)
    for r in range(n):
        row = tokens[r].tolist()
        if int(accepted[r]) >= int(v[r]):
            row = row[: int(v[r])] + [int(bonus[r])] + [-1] * (k - int(v[r]))
        assert got[r].tolist() == row, r
    assert torch.equal(end_rows_at_cut(tokens, bonus.view(-1), v), got)  # [N] bonus alike


@dataclass
class _Metadata:  # the fields of vLLM's SpecDecodeMetadata the cut reads and moves, and one it keeps
    cu_num_draft_tokens: torch.Tensor
    bonus_logits_indices: torch.Tensor
    other: int


def test_the_bonus_index_moves_to_each_rows_cut():
    gen = torch.Generator().manual_seed(fresh_seed("cut bonus"))
    n, k = 6, 5
    cut = StepCut(max_num_reqs=8, max_num_tokens=64, device=torch.device("cpu"), pin=False)
    drafts = torch.tensor([k, 0, k, 3, k, k], dtype=torch.int32)  # a prefill row, a shortened row
    cut.w[:n] = torch.tensor([2, NO_CUT, k + 1, 3, 1, NO_CUT], dtype=torch.int32)
    cu_sampled = (drafts + 1).cumsum(0).to(torch.int32)
    metadata = _Metadata(drafts.cumsum(0).to(torch.int32), cu_sampled - 1, int(torch.randint(9, (), generator=gen)))
    moved, v = cut.bonus_at_cut(metadata, n)
    assert v.tolist() == [1, 0, k, 2, 0, k]
    starts = (cu_sampled - drafts - 1).tolist()
    assert moved.bonus_logits_indices.tolist() == [s + int(x) for s, x in zip(starts, v)]
    assert moved.other == metadata.other and metadata.bonus_logits_indices.tolist() == (cu_sampled - 1).tolist()
    assert int(cut.verified_drafts) == int(v.sum())


def test_plan_gathers_each_rows_length_by_request_id():
    """The previous round's rows were in another order (and one request has left): each row of this
    step takes its own request's length; rows without drafts and new requests keep every token."""
    gen = torch.Generator().manual_seed(fresh_seed("cut plan"))
    k = 7
    prev_ids = ["a", "b", "c", "d", "e"]
    w_prev = torch.randint(1, k + 2, (5,), generator=gen, dtype=torch.int32)
    req_ids = ["d", "a", "new", "e", "c"]
    spec_rows = np.array([True, True, False, True, False])
    n = len(req_ids)
    lens = torch.tensor([k + 1, k + 1, 12, k + 1, 1])
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = lens.cumsum(0)
    cut = StepCut(max_num_reqs=8, max_num_tokens=64, device=torch.device("cpu"), pin=False)
    cut.plan(RoundLayout(torch.zeros(5, k), w_prev, {r: i for i, r in enumerate(prev_ids)}), req_ids, spec_rows, qsl)
    w = dict(zip(prev_ids, w_prev.tolist()))
    assert cut.w[:n].tolist() == [w["d"], w["a"], NO_CUT, w["e"], NO_CUT]
    assert cut.active and cut.steps_cut == 1
    route_tokens_torch(qsl, n, cut.w, cut.source)
    assert int((cut.source[: int(qsl[-1])] != torch.arange(int(qsl[-1]))).sum()) == sum(
        k + 1 - w[r] for r in ("d", "a", "e"))


def test_penalties_bad_words_and_thinking_budgets_turn_the_cut_off():
    base = dict(no_penalties=True, bad_words_token_ids={}, thinking_budget_state_holder=None)
    assert not cuts_nothing(SimpleNamespace(**base))
    assert cuts_nothing(SimpleNamespace(**{**base, "no_penalties": False}))
    assert cuts_nothing(SimpleNamespace(**{**base, "bad_words_token_ids": {0: [[5]]}}))
    holder = SimpleNamespace(has_tracked_requests=lambda: True)
    assert cuts_nothing(SimpleNamespace(**{**base, "thinking_budget_state_holder": holder}))


@pytest.mark.parametrize("num_tokens, num_reqs, one", [(4, 4, True), (64, 4, False), (16, None, False)])
def test_one_token_per_request_reads_vllms_batch_descriptor(num_tokens, num_reqs, one):
    """``vllm.forward_context.BatchDescriptor`` (``num_tokens``, ``num_reqs``: given for full graphs,
    ``None`` for piecewise ones) as the running forward's ``batch_descriptor``: the fields the cut
    reads to leave the router gather out of plain decoding's graphs."""
    from vllm.config import VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    from vllm_hybridspec.engine.length.cut import one_token_per_request

    with set_forward_context(None, VllmConfig(), batch_descriptor=BatchDescriptor(num_tokens, num_reqs)):
        assert one_token_per_request() is one
