"""``engine/runner_state.py``: one object per model runner, reached from the runner and from inside
its forward, gone with the runner; and the vLLM 0.26 contract it rests on (the forward context's
``no_compile_layers`` is the runner's ``compilation_config.static_forward_context``)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from vllm_hybridspec.engine import runner_state
from vllm_hybridspec.engine.runner_state import existing_state, state_of, state_of_context


def _runner():
    runner = type("Runner", (), {})()  # weak-referenceable, as vLLM's runner is
    runner.compilation_config = SimpleNamespace(static_forward_context={"layer": object()})
    return runner


def test_one_state_per_runner_reached_from_the_runner_and_its_forward_context():
    a, b = _runner(), _runner()
    assert existing_state(a) is None  # a runner no feature touched: every wrapper passes through
    state = state_of(a)
    assert state_of(a) is state and existing_state(a) is state
    assert (state.selector, state.cut, state.capture, state.rounds) == (None, None, None, None)
    assert state_of(b) is not state
    assert state_of_context(a.compilation_config.static_forward_context) is state
    assert state_of_context(b.compilation_config.static_forward_context) is state_of(b)
    assert state_of_context({"layer": object()}) is None


def test_the_state_and_its_context_entry_go_with_the_runner():
    runner = _runner()
    context = runner.compilation_config.static_forward_context
    state_of(runner).selector = "selector"
    key = id(context)
    assert runner_state._BY_CONTEXT[key].selector == "selector"
    del runner
    gc.collect()
    assert key not in runner_state._BY_CONTEXT and len(runner_state._STATES) == len(dict(runner_state._STATES))


def test_the_forward_context_names_the_runners_static_forward_context():
    """vLLM 0.26 ``set_forward_context`` hands the layers ``compilation_config.static_forward_context``
    as ``no_compile_layers``: the one-slot GDN layer and the MoE router find the runner's state by it."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    from vllm_hybridspec.engine.runner_state import state_of_forward

    config = VllmConfig()
    runner = type("Runner", (), {})()
    runner.compilation_config = config.compilation_config
    assert state_of_forward() is None  # outside a forward
    state = state_of(runner)
    with set_forward_context(None, config):
        assert state_of_forward() is state
