"""Selector (Eq. 5), Stage-0 length, expert counts, routing correction (Eq. 6), batched length."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_hybridspec.policy import (Policy, expected_tokens, new_expert_counts, new_experts_at,
                                    routing_correction, select_length, select_shared_length,
                                    stage0_length)
from vllm_hybridspec.policy.cost import padded_curve

from .helpers import hand_policy


def random_p(gen, b, d, dtype=torch.float64):
    return torch.cumprod(torch.rand(b, d, generator=gen, dtype=dtype) ** 0.3, dim=1)


def brute_select(p, cost, rate, min_length):
    out = []
    for row in p.tolist():
        best, best_w = -float("inf"), None
        for w in range(min_length, len(row) + 2):
            score = 1 + sum(row[:w - 1]) - rate * float(cost[w])
            if score > best + 1e-12:                   # strictly better: ties stay shorter
                best, best_w = score, w
        out.append(best_w)
    return out


@pytest.mark.parametrize("min_length", [1, 2])
def test_select_length_matches_brute_force(min_length):
    gen = torch.Generator().manual_seed(40 + min_length)
    p = random_p(gen, 300, 15)
    curve = (5 + torch.cumsum(torch.rand(16, generator=gen, dtype=torch.float64), 0)).tolist()
    cost = padded_curve(curve)
    rate = 0.8
    w0 = select_length(p, cost, rate, min_length)
    assert w0.dtype == torch.int64
    assert w0.tolist() == brute_select(p, cost, rate, min_length)
    assert expected_tokens(p)[:, 0].eq(1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_go_to_the_shorter_length(dtype):
    cost = padded_curve([1.0, 2.0, 3.0, 4.0]).to(dtype)  # C(w) = w
    p = torch.tensor([[0.5, 0.5, 0.25],                  # scores 0.5, 0.5, 0.25 at w = 2, 3, 4
                      [1.0, 1.0, 0.5],                   # 1.0, 1.5, 1.5
                      [1.0, 1.0, 1.0],                   # 1.0, 1.5, 2.0
                      [0.0, 0.0, 0.0]], dtype=dtype)     # 0.0, -0.5, -1.0
    assert select_length(p, cost, 0.5).tolist() == [2, 3, 4, 2]
    # W0 = {1..W}: w = 1 scores 1 - 0.5 = 0.5, tying with w = 2 on the first row
    assert select_length(p, cost, 0.5, min_length=1).tolist() == [1, 3, 4, 1]


def test_output_budget_caps_the_lengths():
    gen = torch.Generator().manual_seed(42)
    policy = Policy.from_params(hand_policy(draft_len=7, c=0.97, rate=0.05)).to(None, torch.float64)
    b = 64
    conf, ent = torch.rand(b, 7, generator=gen, dtype=torch.float64), torch.rand(b, 7, dtype=torch.float64)
    _, w0_free, _ = policy.draft_side(conf, ent)
    w_rem = torch.randint(2, 9, (b,), generator=gen)
    p, w0, u = policy.draft_side(conf, ent, w_rem)
    assert torch.equal(w0, w0_free) and (w0_free == 8).all()   # cheap tokens: verify all
    assert torch.equal(u, torch.minimum(w0 + 1, w_rem))
    assert torch.equal(stage0_length(w0, w_rem), u)
    # nominal execution (Algorithm 1 with the correction off) is min(w0, w_rem)
    assert (torch.minimum(w0, w_rem) <= w_rem).all()


def reference_new_counts(ids):
    out = []
    for seq in ids.tolist():
        seen, row = set(), []
        for token in seq:
            row.append(len(set(token) - seen))
            seen |= set(token)
        out.append(row)
    return torch.tensor(out)


def test_new_expert_counts():
    gen = torch.Generator().manual_seed(43)
    ids = torch.rand(40, 9, 32, generator=gen).argsort(dim=-1)[..., :4]   # distinct per token
    want = reference_new_counts(ids)
    assert torch.equal(new_expert_counts(ids, 32), want)
    w0 = torch.randint(0, 9, (40,), generator=gen)
    assert torch.equal(new_experts_at(ids, w0), want.gather(1, w0[:, None])[:, 0])


def routing_instance(gen, b=4000, d=15, topk=8):
    p = random_p(gen, b, d)
    curve = (4 + torch.cumsum(torch.rand(d + 1, generator=gen, dtype=torch.float64), 0)).tolist()
    cost = padded_curve(curve)
    n_all = torch.cat([torch.zeros(1), 20 + 60 * torch.rand(d, generator=gen)]).double()
    given = torch.sort(100 * torch.rand(d + 1, topk + 1, generator=gen, dtype=torch.float64)).values
    return p, cost, n_all, given


@pytest.mark.parametrize("seed", range(3))
def test_routing_correction_expands_only_when_stage0_saving_beats_expert_change(seed):
    gen = torch.Generator().manual_seed(50 + seed)
    d, topk, b = 15, 8, 4000
    p, cost, n_all, given = routing_instance(gen, b, d, topk)
    rate, s, eta = 0.5, 0.3, 0.01
    w0 = select_length(p, cost, rate)
    w_rem = torch.randint(2, d + 2, (b,), generator=gen)
    u = stage0_length(w0, w_rem)
    n_new = torch.randint(0, topk + 1, (b,), generator=gen)
    w = routing_correction(p, w0, u, n_new, w_rem, cost, rate, s, eta, n_all, given)
    expanded = w > torch.minimum(w0, w_rem)
    for r in range(b):
        wr, w0r, ur = int(w[r]), int(w0[r]), int(u[r])
        assert wr in (min(w0r, int(w_rem[r])), w0r + 1) and wr <= int(w_rem[r]) and wr <= ur
        if ur != w0r + 1:
            assert not expanded[r]
            continue
        d_exp = float(given[w0r, n_new[r]] - n_all[w0r])
        delta = float(cost[w0r + 1] - cost[w0r]) - s + eta * d_exp
        assert bool(expanded[r]) == (float(p[r, w0r - 1]) > rate * delta)     # Eq. 6 exactly
        if expanded[r]:
            assert s > eta * d_exp                     # the paper's necessary condition
    assert 50 < int(expanded.sum()) < b / 2, int(expanded.sum())


def test_routing_correction_hand_case():
    # D = 3, C(w) = w, rho = 0.3, p = (0.5, 0.25, 0.125): w0 = 2 (scores 0.9, 0.85, 0.675).
    # Expanding to w = 3 costs dL_c = 1 - s + eta (nbar(2 | n) - nbar(2)) = 0.9 + 0.01 * (t - 10)
    # and is kept iff 0.25 > 0.3 dL_c, i.e. iff t < 3.33: only n = 0 (t = 0) qualifies.
    p = torch.tensor([[0.5, 0.25, 0.125]] * 4, dtype=torch.float64)
    cost = padded_curve([1.0, 2.0, 3.0, 4.0])
    n_all = torch.tensor([0.0, 6.0, 10.0, 4.0], dtype=torch.float64)
    given = torch.tensor([[0, 0, 0], [1, 4, 7], [0, 5, 20], [2, 3, 4]], dtype=torch.float64)
    w0 = select_length(p, cost, 0.3)
    assert w0.tolist() == [2, 2, 2, 2]
    w_rem = torch.tensor([4, 4, 4, 2])
    u = stage0_length(w0, w_rem)
    assert u.tolist() == [3, 3, 3, 2]
    n_new = torch.tensor([0, 1, 2, 0])
    w = routing_correction(p, w0, u, n_new, w_rem, cost, 0.3, 0.1, 0.01, n_all, given)
    assert w.tolist() == [3, 2, 2, 2]                  # the last round: no budget for d_2


def brute_shared(p, cand, cost, rate, w_rem, active):
    best, best_w = -float("inf"), None
    g = expected_tokens(p)
    for w in cand.tolist():
        total = sum(float(g[b, min(w, int(w_rem[b])) - 1]) for b in range(p.shape[0]) if active[b])
        score = total - rate * float(cost[w])
        if score > best + 1e-12:
            best, best_w = score, w
    return best_w


@pytest.mark.parametrize("seed", range(5))
def test_shared_length_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(60 + seed)
    p = random_p(gen, 4, 15)
    cand = torch.tensor([2, 4, 8, 12, 16])
    curve = (8 + 1.2 * torch.arange(1, 17, dtype=torch.float64)
             + torch.rand(16, generator=gen, dtype=torch.float64)).tolist()
    cost = padded_curve(curve)
    w_rem = torch.randint(2, 17, (4,), generator=gen)
    active = torch.tensor([True, True, True, seed % 2 == 0])
    w = select_shared_length(p, cand, cost, 0.9, w_rem, active)
    assert w.ndim == 0 and int(w) == brute_shared(p, cand, cost, 0.9, w_rem, active)


def test_shared_length_ties_and_reduction_to_batch_one():
    cost = padded_curve([1.0, 2.0, 3.0, 4.0])
    p = torch.tensor([[0.5, 0.5, 0.25]])
    cand = torch.tensor([2, 3, 4])
    assert int(select_shared_length(p, cand, cost, 0.5)) == 2    # tie of w = 2 and 3
    # at B = 1 with every length a candidate the rule is Eq. 5
    gen = torch.Generator().manual_seed(61)
    p = random_p(gen, 1, 3)
    assert int(select_shared_length(p, cand, cost, 0.3)) == int(select_length(p, cost, 0.3)[0])


class NoHostReads(TorchDispatchMode):
    """Fails on the ops that read a device value on the host (``.item()``, ``bool(t)``, masks)."""

    SYNCING = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        if func in self.SYNCING or bool_index:
            raise AssertionError(f"host read in the per-round path: {func}")
        return func(*args, **(kwargs or {}))


def test_per_round_path_has_no_host_reads():
    gen = torch.Generator().manual_seed(62)
    routing = {"s": 0.1, "eta": 0.01, "experts_per_token": 8, "later_layers": True,
               "n_all": [30.0] * 15, "n_all_given": [[float(10 * n) for n in range(9)]] * 15}
    policy = Policy.from_params(hand_policy(draft_len=15, c=0.8, rate=0.2, routing=routing,
                                            quadratic=(6.0, 0.5, 0.0))).to(None, torch.float32)
    conf, ent = torch.rand(256, 15, generator=gen), torch.rand(256, 15, generator=gen)
    ids = torch.rand(256, 16, 64, generator=gen).argsort(dim=-1)[..., :8]
    w_rem = torch.randint(2, 17, (256,), generator=gen)
    with NoHostReads():
        p, w0, u = policy.draft_side(conf, ent, w_rem)
        w = policy.correct(p, w0, u, new_experts_at(ids, w0), w_rem)
    assert ((w >= 2) & (w <= w_rem)).all() and ((w == torch.minimum(w0, w_rem)) | (w == w0 + 1)).all()
