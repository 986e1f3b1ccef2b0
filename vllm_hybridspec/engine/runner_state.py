"""What the plugin keeps per vLLM model runner, in one object reached one way.

vLLM 0.26's ``GPUModelRunner`` has no place for an extension's state, and the plugin's per-step work
runs where different handles are at hand: the runner's own methods, wrapped, see the runner; the
layers inside the model's forward see vLLM's forward context, whose ``no_compile_layers`` is the
runner's static forward context (``vllm.forward_context.ForwardContext.no_compile_layers``, the
``compilation_config.static_forward_context`` dict); in-process tools reach the runner by
``compat.in_process_runner``. :class:`RunnerState` holds everything, :func:`state_of` reaches it from
the runner and :func:`state_of_forward` from inside a forward. It lives as long as the runner (a weak
key); its forward-context entry is dropped with it.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class RunnerState:
    """One model runner's plugin state; a field is ``None`` where its feature is off. The features' types
    are named, not imported: this module stands below every feature that reaches it
    (``tests/test_import_graph.py``)."""

    selector: Any = None  # LengthSelector: the proposer's length selector (engine/length/selector.py)
    # RoundLayout: the last drafting round's decisions (engine/length/selector.py), set by the proposer when
    # the round ends and read by the step that verifies it; ended at the next step's sampling
    round: Any = None
    cut: Any = None  # StepCut: the step's device-side cut (engine/length/cut.py), made with the selector
    capture: Any = None  # RoundCapture: calibration capture (engine/length/capture.py)
    rounds: Any = None  # PendingRounds: the one-slot GDN layer's rounds (engine/gdn/pending.py)
    # served steps per (w or "mixed", requests, graph mode) (engine/length/graphs.py: graph_mode_counts)
    graph_modes: Counter = field(default_factory=Counter)


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model runner -> RunnerState
_BY_CONTEXT: dict[int, RunnerState] = {}  # id(the runner's static forward context) -> its RunnerState


def state_of(runner) -> RunnerState:
    """The runner's state, made empty at the first call."""
    state = _STATES.get(runner)
    if state is None:
        state = _STATES[runner] = RunnerState()
        context = getattr(getattr(runner, "compilation_config", None), "static_forward_context", None)
        if context is not None:
            key = id(context)
            _BY_CONTEXT[key] = state
            weakref.finalize(runner, _BY_CONTEXT.pop, key, None)
    return state


def existing_state(runner) -> RunnerState | None:
    """The runner's state, or ``None`` where no feature has made one (a runner the plugin never touched:
    every wrapper passes through)."""
    return _STATES.get(runner)


def state_of_context(context: dict) -> RunnerState | None:
    """The state of the runner whose static forward context is ``context`` (the dict vLLM hands the
    layers as ``ForwardContext.no_compile_layers``)."""
    return _BY_CONTEXT.get(id(context))


def state_of_forward() -> RunnerState | None:
    """The state of the runner whose forward is running (``vllm.forward_context``), or ``None`` outside
    a forward."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return state_of_context(get_forward_context().no_compile_layers)
