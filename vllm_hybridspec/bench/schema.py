"""The fields of a `hybridspec bench` result file that `hybridspec report` reads, checked when a file
is loaded, so a hand-edited, truncated or foreign file is refused with one line naming the file and
the field instead of a KeyError half-way through the plots."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hybridspec.policy.ranges import MAX_BATCH, MAX_BATCH_RATE, MAX_COUNT, MAX_LENGTH, MAX_S


class InvalidResult(ValueError):
    """A result file the report cannot read; the message names the file and the field."""


@dataclass(frozen=True)
class _Value:
    expected: str
    accepts: Callable[[object], bool]


@dataclass(frozen=True)
class _Object:
    required: dict
    optional: dict = field(default_factory=dict)
    nullable: bool = False

    @property
    def expected(self) -> str:
        keys = ", ".join(self.required) or "any fields"
        return f"an object with {keys}" + (" or null" if self.nullable else "")


@dataclass(frozen=True)
class _List:
    item: _Object | _Value
    expected: str


def _is_number(v) -> bool:
    # finite: Python's JSON reader accepts NaN and Infinity, which no measured quantity can be
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT


def _at_least(low: float, most: float = math.inf) -> Callable[[object], bool]:
    return lambda v: _is_number(v) and low <= v <= most


def _or_null(value: _Value) -> _Value:
    return _Value(f"{value.expected} or null", lambda v: v is None or value.accepts(v))


# tokens (or requests) per second of one engine: every verified token of a full batch in the shortest round
MAX_PER_S = MAX_BATCH_RATE * 1e3
_SECONDS = _Value(f"a finite number of seconds in 0..{MAX_S:g}", _at_least(0.0, MAX_S))  # latencies
_PER_S = _Value(f"a finite number per second in 0..{MAX_PER_S:.3g}", _at_least(0.0, MAX_PER_S))  # throughputs
_PER_S_OR_NULL = _or_null(_PER_S)
_SHARE_OR_NULL = _or_null(_Value("a share in [0, 1]", _at_least(0.0, 1.0)))  # KV cache usage
_COUNT = _Value(f"an integer in 0..{MAX_COUNT:,}", _is_count)
_TEXT = _Value("a string", lambda v: isinstance(v, str))
_SUMMARY = _Object({"mean": _or_null(_SECONDS), "p50": _or_null(_SECONDS), "p99": _or_null(_SECONDS)})
_LEVEL = _Object(
    required={"concurrency": _Value(f"an integer in 1..{MAX_BATCH:,}", lambda v: _is_count(v) and 1 <= v <= MAX_BATCH),
              "completed": _COUNT, "failed": _COUNT, "output_throughput": _PER_S_OR_NULL,
              "request_throughput": _PER_S_OR_NULL, "ttft_s": _SUMMARY, "itl_s": _SUMMARY, "e2e_s": _SUMMARY},
    optional={"not_sent": _COUNT, "status": _TEXT,
              # tokens per verifying round: the bonus token at least
              "mean_acceptance_length": _or_null(_Value(f"a finite number in 1..{MAX_LENGTH}",
                                                        _at_least(1.0, MAX_LENGTH))),
              "kv_cache_usage": _Object({}, {"mean": _SHARE_OR_NULL, "max": _SHARE_OR_NULL}, nullable=True),
              "output_throughput_spread": _Object({"min": _PER_S, "max": _PER_S,
                                                   "repeats": _List(_PER_S, "a list of numbers")}, nullable=True)})
_RESULT = _Object({"status": _TEXT, "levels": _List(_LEVEL, "a list of levels (objects with concurrency, completed, ...)")},
                  {"config": _Object({}), "error": _Value("a string or null", lambda v: v is None or isinstance(v, str))})


class _Bad(Exception):
    def __init__(self, where: str, text: str):
        super().__init__(f"{where}: {text}" if where else text)


def _check(value, spec, where: str) -> None:
    if isinstance(spec, _Object):
        if value is None and spec.nullable:
            return
        if not isinstance(value, dict):
            raise _Bad(where, f"expected {spec.expected}, got {_shown(value)}")
        for key, sub in spec.required.items():
            if key not in value:
                raise _Bad(where, f"no field {key!r} (expected {sub.expected})")
        for key, sub in {**spec.required, **spec.optional}.items():
            if key in value:
                _check(value[key], sub, f"{where}.{key}" if where else key)
    elif isinstance(spec, _List):
        if not isinstance(value, list):
            raise _Bad(where, f"expected {spec.expected}, got {_shown(value)}")
        for i, item in enumerate(value):
            _check(item, spec.item, f"{where}[{i}]")
    elif not spec.accepts(value):
        raise _Bad(where, f"expected {spec.expected}, got {_shown(value)}")


def _shown(value) -> str:
    if value is None:
        return "null"
    text = json.dumps(value)
    kind = {dict: "an object", list: "a list", str: "the string", bool: "the boolean"}.get(type(value), "the number")
    return f"{kind} {text if len(text) <= 40 else text[:40] + '...'}"


def load_result_json(path: Path) -> dict:
    """The result file at ``path``, checked; raises :class:`InvalidResult` in one line naming the file
    and the first field the report could not read (what is missing, or what was found instead)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidResult(f"{path}: cannot read it ({e.strerror or e}); expected a `hybridspec bench` result JSON.") from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InvalidResult(f"{path}: not JSON ({e}); expected a `hybridspec bench` result JSON.") from None
    if isinstance(doc, dict) and doc.get("kind") == "soak":
        raise InvalidResult(f"{path}: a `hybridspec soak` result; the report reads `hybridspec bench` results.")
    try:
        _check(doc, _RESULT, "")
        _consistent(doc)
    except _Bad as e:
        raise InvalidResult(f"{path}: {e}") from None
    return doc


def _consistent(doc: dict) -> None:
    """What the fields say together: one level per concurrency, a spread whose min is not above its max
    and holds its repeats."""
    seen = set()
    for i, level in enumerate(doc["levels"]):
        if level["concurrency"] in seen:
            raise _Bad(f"levels[{i}].concurrency", f"{level['concurrency']} is measured twice; one level per "
                                                   "concurrency")
        seen.add(level["concurrency"])
        spread = level.get("output_throughput_spread")
        if spread and not (spread["min"] <= min(spread["repeats"], default=spread["min"])
                           and max(spread["repeats"], default=spread["max"]) <= spread["max"]):
            raise _Bad(f"levels[{i}].output_throughput_spread",
                       f"min {spread['min']} and max {spread['max']} do not hold the repeats {spread['repeats']}")
