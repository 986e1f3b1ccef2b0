"""The length selector the proposers call each round (no engine): counts, budget cap, gate, signals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridspec.engine.options import HybridSpecOptions
from vllm_hybridspec.policy.acceptance import FEATURES
from vllm_hybridspec.policy.policy_file import Policy, PolicyFile, save_policy
from vllm_hybridspec.engine.length.selector import LengthSelector, draft_signals, remaining_budget
from ...seeds import fresh_seed

K = 7


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(fresh_seed("selector_gen"))


def policy_file(tmp_path, gate=None, batched=False, routing_topk=None):
    curve = [float(w) for w in range(1, K + 2)]
    obj = {"draft_len": K, "min_length": 1,
           "acceptance": {"features": list(FEATURES), "entropy_eps": 1e-4,
                          "isotonic": [{"x": [0.0, 1.0], "y": [0.0, 1.0]}] * K,
                          "coef": [12.0, 0.0, 0.0, 0.0, 0.0], "intercept": -6.0},
           "cost": {"measured_lengths": [1, 2, 3], "quadratic": [1.0, 1.0, 0.0], "fixed": 1.0, "curve": curve},
           "rate": 0.4, "gate": gate or {}}
    if batched:
        obj["batched"] = {"4": {"measured_lengths": [1, 2, 3], "quadratic": [1.0, 4.0, 0.0], "fixed": 1.0,
                                "curve": [4.0 * w for w in range(1, K + 2)], "candidates": [1, 4, 8], "rate": 0.4}}
    if routing_topk is not None:  # n_all_given rising with n: a draft that brings more new experts costs more
        obj["routing"] = {"s": 0.2, "eta": 0.3, "experts_per_token": routing_topk, "later_layers": False,
                          "n_all": [float(routing_topk)] * K,
                          "n_all_given": [[float(routing_topk) + 2.0 * (n - routing_topk / 2) for n in range(routing_topk + 1)]] * K}
    path = tmp_path / "policy.json"
    save_policy(PolicyFile.model_validate(obj), path)
    return str(path)


def test_draft_signals_equal_softmax_in_any_chunking(gen):
    logits = 4 * torch.randn(37, 96, generator=gen)
    probs = logits.double().softmax(-1)
    top1, ent = draft_signals(logits, rows_per_chunk=8)
    torch.testing.assert_close(top1.double(), probs.max(-1).values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent.double(), -(probs * probs.log()).sum(-1), rtol=1e-5, atol=1e-5)
    assert top1.dtype == ent.dtype == torch.float32


def test_selected_counts_are_the_policy_lengths_capped_by_the_budget(tmp_path, gen):
    path = policy_file(tmp_path)
    selector = LengthSelector(HybridSpecOptions(policy=path), K, torch.device("cpu"), max_num_reqs=64)
    n = 40
    conf, ent = torch.rand(n, K, generator=gen), torch.rand(n, K, generator=gen)
    w_rem = torch.randint(1, K + 2, (n,), generator=gen)
    drafts = torch.randint(0, 96, (n, K), generator=gen)
    req_ids = [f"r{i}" for i in range(n)]
    layout = selector.select(drafts, conf, ent, w_rem, req_ids)
    w = layout.w
    _, w0, _ = Policy.load(path).draft_side(conf, ent, w_rem)
    assert w.dtype == torch.int32 and torch.equal(w.long(), torch.minimum(w0, w_rem))
    assert len(set(w0.tolist())) >= 3  # the confidences spread the lengths
    assert layout.selected and layout.drafts is drafts and not layout.gated and not layout.gated_with_drafts
    assert layout.rows == {r: i for i, r in enumerate(req_ids)} and layout.expand is None
    stats = selector.stats()
    assert sum(stats["rows_at_length"].values()) == n and stats["steps"] == 1
    assert stats["rows_at_length"] == {length: int((w == length).sum()) for length in range(1, K + 2)
                                       if int((w == length).sum())}


def test_batched_mode_shares_one_length_except_where_the_budget_cuts(tmp_path, gen):
    selector = LengthSelector(HybridSpecOptions(policy=policy_file(tmp_path, batched=True), batched=True),
                              K, torch.device("cpu"), max_num_reqs=64)
    n = 6  # no costs for 6: those of 4, the largest calibrated size below
    w_rem = torch.full((n,), K + 1)
    w_rem[0] = 2
    w = selector.select(torch.zeros(n, K, dtype=torch.long), torch.rand(n, K, generator=gen),
                        torch.rand(n, K, generator=gen), w_rem, list("abcdef")).w
    shared = int(w[1])
    assert shared in (1, 4, 8) and (w[1:] == shared).all() and int(w[0]) == min(shared, 2)


def test_fixed_length_and_gate(tmp_path, gen):
    selector = LengthSelector(HybridSpecOptions(fixed_length=5), K, torch.device("cpu"), max_num_reqs=8)
    w_rem = torch.tensor([1, 3, 5, 8])
    w = selector.select(torch.zeros(4, K, dtype=torch.long), torch.rand(4, K, generator=gen),
                        torch.rand(4, K, generator=gen), w_rem,
                        list("abcd")).w
    assert w.tolist() == [1, 3, 5, 5] and selector.speculate(1000)  # no policy: no gate
    gated = LengthSelector(HybridSpecOptions(policy=policy_file(tmp_path, gate={1: True, 8: False})), K,
                           torch.device("cpu"), max_num_reqs=16)
    assert [gated.speculate(b) for b in (1, 7, 8, 16)] == [True, True, False, False]
    drafts = torch.zeros(8, K, dtype=torch.long)
    layout = gated.gated(drafts)
    assert layout.drafts is drafts and layout.gated_with_drafts and not layout.selected
    assert not gated.gated(drafts[:, :0]).gated_with_drafts  # a step the scheduler gated: no drafts to trim
    assert gated.stats()["gated_steps"] == 2
    off = LengthSelector(HybridSpecOptions(policy=policy_file(tmp_path, gate={1: False}), gate=False), K,
                         torch.device("cpu"), max_num_reqs=16)
    assert off.speculate(1)  # "gate": false ignores the table


def test_remaining_budget_caps_by_max_tokens_and_max_model_len():
    prompt, max_tokens = [10, 10, 10, 250], [20, 20, None, 20]
    runner = SimpleNamespace(
        max_model_len=256,
        input_batch=SimpleNamespace(req_ids=["a", "b", "c", "d"]),
        requests={r: SimpleNamespace(num_prompt_tokens=p, sampling_params=SimpleNamespace(max_tokens=m))
                  for r, p, m in zip("abcd", prompt, max_tokens)})
    # cached tokens (the anchor not yet): a has 1 token left to emit after the anchor, b 19, ...
    prefix_lens = torch.tensor([28, 10, 100, 251])
    w_rem = remaining_budget(runner, prefix_lens, K)
    assert w_rem.tolist() == [1, K + 1, K + 1, 4]


def test_configure_switches_a_running_selector_between_modes(tmp_path, gen):
    """``configure`` (what ``calibrate costs`` and ``evaluate.py`` call between measurements): a fixed
    length cuts every row to it; drafting off gates every step (and makes the runner patches act);
    a policy selects its lengths and brings its gate, unless ``gate=False``; no argument verifies
    everything; a bad value is a ValueError naming it and leaves the selector as it was."""
    path = policy_file(tmp_path, gate={"4": False})
    selector = LengthSelector(HybridSpecOptions(fixed_length=K + 1), K, torch.device("cpu"), max_num_reqs=64)
    n = 6
    conf, ent = torch.rand(n, K, generator=gen), torch.rand(n, K, generator=gen)
    drafts = torch.randint(0, 96, (n, K), generator=gen)
    w_rem = torch.full((n,), K + 1)
    ids = [f"r{i}" for i in range(n)]

    selector.configure(fixed_length=3)
    assert selector.select(drafts, conf, ent, w_rem, ids).w.tolist() == [3] * n
    selector.configure(drafting=False)
    assert selector.active and not selector.speculate(1) and not selector.speculate(64)
    selector.configure(policy=path)
    _, w0, _ = Policy.load(path).draft_side(conf, ent, w_rem)
    assert torch.equal(selector.select(drafts, conf, ent, w_rem, ids).w.long(), w0)
    assert selector.speculate(2) and not selector.speculate(4)  # the policy's gate
    selector.configure(policy=path, gate=False)
    assert selector.speculate(4)
    selector.configure()
    assert selector.select(drafts, conf, ent, w_rem, ids).w.tolist() == [K + 1] * n and selector.speculate(4)
    # trim=False: every draft verified without the selector (inactive: the runner patches pass through)
    selector.configure(trim=False)
    assert not selector.active and not selector.trims and selector.speculate(4)
    with pytest.raises(ValueError, match="trim=False verifies every draft without the selector"):
        selector.configure(fixed_length=3, trim=False)
    assert not selector.active
    selector.configure()
    assert selector.active and selector.trims
    with pytest.raises(ValueError, match=r"fixed_length=9 exceeds num_speculative_tokens \+ 1 = 8"):
        selector.configure(fixed_length=K + 2)
    with pytest.raises(ValueError, match="does not exist"):
        selector.configure(policy=str(tmp_path / "missing.json"))
    assert selector.options.fixed_length == K + 1 and selector.speculate(4)
    # None takes the engine's own setting each time, not the previous call's
    selector.configure(policy=path, gate=False)
    selector.configure(policy=path)
    assert not selector.speculate(4)
    batched = LengthSelector(HybridSpecOptions(policy=policy_file(tmp_path, batched=True), batched=True), K,
                             torch.device("cpu"), max_num_reqs=64)
    batched.configure(fixed_length=3)
    batched.configure(policy=batched.engine_options.policy)
    assert batched.options.batched
    batched.configure(policy=batched.engine_options.policy, batched=False)
    assert not batched.options.batched


def test_configure_refuses_trimmed_lengths_when_the_gdn_layers_run_vllms_own_path(tmp_path, gen):
    """A selector whose target's GDN layers run vLLM's own spec path (``verifies_every_draft``) keeps
    verifying every draft: a fixed length below K + 1 or a policy is refused, naming the way out, and
    the selector stays as it was; verify-everything and drafting off still switch."""
    path = policy_file(tmp_path)
    selector = LengthSelector(HybridSpecOptions(fixed_length=K + 1), K, torch.device("cpu"), max_num_reqs=64,
                              verifies_every_draft=True)
    for kwargs in ({"fixed_length": 3}, {"fixed_length": K}, {"policy": path}):
        with pytest.raises(ValueError, match=r"vLLM's own spec-decode path.*\"gdn_kernel\": true"):
            selector.configure(**kwargs)
        assert selector.options.fixed_length == K + 1 and not selector.options.select
    n = 5
    conf, ent = torch.rand(n, K, generator=gen), torch.rand(n, K, generator=gen)
    drafts = torch.randint(0, 96, (n, K), generator=gen)
    assert selector.select(drafts, conf, ent, torch.full((n,), K + 1), list("abcde")).w.tolist() == [K + 1] * n
    selector.configure(fixed_length=K + 1)
    selector.configure(drafting=False)
    assert not selector.speculate(1)
    # the same calls pass on a selector without the restriction
    free = LengthSelector(HybridSpecOptions(fixed_length=K + 1), K, torch.device("cpu"), max_num_reqs=64)
    free.configure(fixed_length=3)
    free.configure(policy=path)


def test_with_routing_tables_the_selector_hands_stage0_each_rows_expansion_table(tmp_path, gen):
    """HybridSpec's routing correction: the selector keeps the nominal ``w0`` (capped by the budget) and,
    per count of new Layer-0 experts, whether ``d_{w0}`` is kept (``Policy.expansion_table``), which
    Stage 0 looks up at the first MoE router; only where the engine's cut runs Stage 0."""
    path = policy_file(tmp_path, routing_topk=4)
    policy = Policy.load(path)
    n = 32
    conf, ent = torch.rand(n, K, generator=gen), torch.rand(n, K, generator=gen)
    w_rem = torch.randint(1, K + 2, (n,), generator=gen)
    drafts = torch.randint(0, 96, (n, K), generator=gen)
    ids = [f"r{i}" for i in range(n)]
    selector = LengthSelector(HybridSpecOptions(policy=path), K, torch.device("cpu"), max_num_reqs=64)
    assert selector.routes and not selector.stage0_ready
    layout = selector.select(drafts, conf, ent, w_rem, ids)
    w = layout.w
    assert layout.expand is None  # no Stage 0 in this engine: the nominal lengths only
    selector.stage0_ready = True
    layout = selector.select(drafts, conf, ent, w_rem, ids)
    assert torch.equal(layout.w, w)
    p, w0, u = policy.draft_side(conf, ent, w_rem)
    table = policy.expansion_table(p, w0, u)
    assert torch.equal(w.long(), torch.minimum(w0, w_rem)) and torch.equal(layout.expand, table)
    assert table.shape == (n, 5) and table.any() and not table.all()  # both answers drawn
    # the lookup is the policy's Stage 1 (Algorithm 1 line 11) at every count of new experts
    for new in range(5):
        n_new = torch.full((n,), new, dtype=torch.int64)
        want = policy.correct(p, w0, u, n_new, w_rem)
        assert torch.equal(torch.minimum(w0 + table[:, new].long(), w_rem), want)
    layout = selector.gated(drafts)
    assert layout.expand is None and layout.gated
    off = LengthSelector(HybridSpecOptions(policy=path, routing=False), K, torch.device("cpu"), max_num_reqs=64)
    assert not off.routes
    batched = LengthSelector(HybridSpecOptions(policy=policy_file(tmp_path, batched=True, routing_topk=4), batched=True),
                             K, torch.device("cpu"), max_num_reqs=64)
    assert not batched.routes  # one shared length per batch: no per-request correction


def test_routing_options_that_cannot_hold_are_refused(tmp_path):
    import pytest

    with pytest.raises(ValueError, match='"routing": true corrects lengths selected per request'):
        HybridSpecOptions(routing=True)
    with pytest.raises(ValueError, match='"routing": true corrects lengths selected per request'):
        HybridSpecOptions(policy=policy_file(tmp_path, batched=True, routing_topk=4), batched=True, routing=True)
    plain = HybridSpecOptions(policy=policy_file(tmp_path), routing=True)
    with pytest.raises(ValueError, match="routing=True needs a policy file with a 'routing' section"):
        plain.check(K)
