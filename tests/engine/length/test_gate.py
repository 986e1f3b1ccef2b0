"""The batch gate as vLLM's scheduler applies it (``engine/length/gate.py``, no engine): a gate table
becomes the dynamic speculative-decoding schedule whose lookup drafts exactly where the policy does;
such a schedule keeps the engine's full CUDA graphs where any other is left to vLLM; a running
scheduler found by its config follows the selector's settings; and a step that verified and drafts
nothing skips the drafting round. Engine-level: ``tests/serving/test_selection.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

from vllm_hybridspec.engine.length import gate as gate_module
from vllm_hybridspec.engine.length.gate import gate_schedule, is_gate_schedule, sync_scheduler
from vllm_hybridspec.engine.length.selector import LengthSelector, RoundLayout
from vllm_hybridspec.policy.policy_file import Policy, _at_or_below

from ...seeds import fresh_seed


class _Obj(SimpleNamespace):
    """A namespace the weak registries can hold (as they hold vLLM's schedulers and runners)."""

    __slots__ = ("__weakref__",)
    __hash__ = object.__hash__


@pytest.mark.parametrize("draw", range(4))
def test_the_schedule_drafts_where_the_gate_table_does(draw):
    gen = torch.Generator().manual_seed(fresh_seed(f"gate table {draw}"))
    k, max_num_seqs = 15, 300
    sizes = sorted(set(torch.randint(1, 257, (int(torch.randint(1, 7, (), generator=gen)),), generator=gen).tolist()))
    gate = {b: bool(torch.rand((), generator=gen) < 0.5) for b in sizes}
    policy = SimpleNamespace(gate=gate, speedup={})
    policy.speculate = lambda b: _at_or_below(gate, b, True)
    policy.gate_ranges = lambda k, big: Policy.gate_ranges(policy, k, big)
    lookup = build_dynamic_sd_schedule_lookup(gate_schedule(policy, k), vllm_max_batch_size=max_num_seqs,
                                              vllm_num_speculative_tokens=k)
    assert lookup[1:] == [k if _at_or_below(gate, b, True) else 0 for b in range(1, max_num_seqs + 1)], gate
    assert is_gate_schedule(gate_schedule(policy, k), k)
    assert not is_gate_schedule([[1, 4, k], [5, 8, 3]], k) and not is_gate_schedule(None, k)


def test_a_gate_schedule_keeps_full_graphs_and_any_other_is_vllms():
    seen = []
    wrapped = gate_module._full_graphs_for_a_gate(lambda self: seen.append(self) or "piecewise")

    def config(schedule, options=True):
        return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens_per_batch_size=schedule,
                                                                  num_speculative_tokens=7),
                               additional_config={"hybridspec": {}} if options else {})

    assert wrapped(config([[1, 4, 7], [5, 8, 0]])) is None and not seen
    assert wrapped(config([[1, 4, 7], [5, 8, 3]])) == "piecewise"  # another K: vLLM's reason holds
    assert wrapped(config([[1, 4, 7], [5, 8, 0]], options=False)) == "piecewise"  # not ours
    assert len(seen) == 2


def test_a_running_scheduler_follows_the_selector():
    scheduler = _Obj(scheduler_config=SimpleNamespace(max_num_seqs=16), dynamic_sd_lookup=None)
    config = SimpleNamespace(instance_id=f"test-{fresh_seed('instance')}")
    policy = SimpleNamespace(gate={1: True, 4: False}, speedup={})
    policy.speculate = lambda b: _at_or_below(policy.gate, b, True)
    policy.gate_ranges = lambda k, big: Policy.gate_ranges(policy, k, big)
    selector = SimpleNamespace(k=7, drafting=True, gates=True, policy=policy)
    assert not sync_scheduler(config, selector)  # no scheduler in this process
    gate_module._SCHEDULERS[config.instance_id] = scheduler
    assert sync_scheduler(config, selector)
    assert scheduler.dynamic_sd_lookup[1:] == [7, 7, 7] + [0] * 13
    selector.drafting = False
    sync_scheduler(config, selector)
    assert scheduler.dynamic_sd_lookup[1:] == [0] * 16
    selector.drafting, selector.gates = True, False
    sync_scheduler(config, selector)
    assert scheduler.dynamic_sd_lookup is None  # vLLM's static K


def test_a_step_without_drafts_either_way_skips_the_drafting_round():
    """``GPUModelRunner.propose_draft_token_ids``: skipped (an empty drafts tensor from the selector's
    gate) only when the step verified no draft and the next one schedules none."""
    from vllm_hybridspec.engine.runner_state import state_of

    calls = []
    wrapped = gate_module._no_round_when_nothing_is_drafted(lambda self, *a: calls.append(a) or "drafted")
    gated = []
    selector = SimpleNamespace(gated=lambda drafts: gated.append(drafts) or RoundLayout(drafts, gated=True),
                               no_drafts=LengthSelector.no_drafts.__get__(SimpleNamespace(_no_drafts={})))
    runner = _Obj(input_batch=SimpleNamespace(num_reqs=3), device=torch.device("cpu"))
    state_of(runner).selector = selector
    out = SimpleNamespace(num_spec_tokens_to_schedule=0)
    drafts = wrapped(runner, out, None, None, None, None, None, None, None, None)
    assert drafts.shape == (3, 0) and gated == [drafts] and not calls
    assert state_of(runner).round.drafts is drafts and not state_of(runner).round.gated_with_drafts
    assert wrapped(runner, out, *[None] * 8) is drafts  # made once per batch size, not per step
    assert wrapped(runner, out, None, None, None, None, None, "spec metadata", None, None) == "drafted"
    assert wrapped(runner, SimpleNamespace(num_spec_tokens_to_schedule=7), *[None] * 8) == "drafted"
    assert len(calls) == 2
