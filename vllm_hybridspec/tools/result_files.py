"""The fields of ``hybridspec compare`` and ``hybridspec evaluate`` results that ``compare-report`` and
``plot-rounds`` read, as strict models (``policy/files.read_model``): no value coerced, every number finite
and within its range, the configs' outputs one list per prompt; other fields pass.  A file that does not
fit is one line naming the file, the field and the value."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_hybridspec.policy.errors import InputError
from vllm_hybridspec.policy.files import read_model
from vllm_hybridspec.policy.ranges import (MAX_BATCH, MAX_BATCH_RATE, MAX_COUNT, MAX_LENGTH, MAX_MS, MAX_NATS, MIN_MS,
                                           BatchSize, BatchText, Length, Seconds, Tokens)

# the fields named here are checked, the rest of a result passes as it is
RESULT_FIELDS = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
Ms = Annotated[float, Field(ge=MIN_MS, le=MAX_MS)]  # a measured step: tokens/s divide by it
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]  # vLLM's token ids are int32


class StepTimes(BaseModel):
    """Decode-step times at one batch size and verification length (``length`` null: drafting off or plain)."""

    model_config = RESULT_FIELDS
    batch: BatchSize
    length: Length | None = None
    steps: int = Field(ge=1, le=MAX_COUNT)
    mean_ms: Ms
    median_ms: Ms
    tokens_per_step: float = Field(ge=0, le=MAX_BATCH * MAX_LENGTH)

    @model_validator(mode="after")
    def _tokens(self) -> StepTimes:
        w = self.length or MAX_LENGTH  # null: no fixed length (plain decoding, or the policy's lengths)
        if self.tokens_per_step > self.batch * w:
            raise ValueError(f"'tokens_per_step' is {self.tokens_per_step:g} but a step of {self.batch} requests "
                             f"verifying at most {w} tokens each makes at most {self.batch * w}")
        return self


class CompareConfig(BaseModel):
    """One config of a ``hybridspec compare`` result: its outputs and counters, or the error that ended it."""

    model_config = RESULT_FIELDS
    name: str
    error: str | None = None
    outputs: list[list[TokenId]] | None = None
    kv_capacity_tokens: Tokens | None = None
    mean_acceptance_length: float | None = Field(default=None, ge=1, le=MAX_LENGTH)
    engine_start_s: Seconds | None = None
    top2_gaps: list[list[Annotated[float, Field(ge=0, le=MAX_NATS)] | None]] | None = None
    round_ms: dict[str, StepTimes | str] | None = None  # {"skipped": why} when no sweep ran

    @model_validator(mode="after")
    def _measured(self) -> CompareConfig:
        if self.error is None and (self.outputs is None or self.kv_capacity_tokens is None):
            raise ValueError(f"config {self.name!r} has no 'error', so it needs 'outputs' and 'kv_capacity_tokens'")
        if self.top2_gaps is not None and self.outputs is not None:
            if [len(g) for g in self.top2_gaps] != [len(o) for o in self.outputs]:
                raise ValueError(f"config {self.name!r}: 'top2_gaps' needs one gap per output token of each prompt")
        return self


class CompareResult(BaseModel):
    model_config = RESULT_FIELDS
    results: list[CompareConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _same_prompts(self) -> CompareResult:
        measured = [r for r in self.results if r.outputs is not None]
        for r in measured[1:]:
            if len(r.outputs) != len(measured[0].outputs):
                raise ValueError(f"config {r.name!r} has outputs of {len(r.outputs)} prompts but "
                                 f"{measured[0].name!r} of {len(measured[0].outputs)}; a comparison runs one prompt set")
        return self


class ModeSteps(StepTimes):
    tokens_per_s: float = Field(ge=0, le=MAX_BATCH_RATE * 1e3)


class EvaluateMode(BaseModel):
    model_config = RESULT_FIELDS
    steps: dict[BatchText, ModeSteps]  # by batch size

    @model_validator(mode="after")
    def _keyed_by_batch(self) -> EvaluateMode:
        for key, s in self.steps.items():
            if int(key) != s.batch:
                raise ValueError(f"'steps.{key}' holds batch size {s.batch}; each entry sits under its own batch size")
        return self


class EvaluateResult(BaseModel):
    """What ``plot-rounds`` reads of a ``hybridspec evaluate`` result: the step costs per batch size and
    length, and each mode's tokens/s at every batch size measured."""

    model_config = RESULT_FIELDS
    costs: list[StepTimes] = Field(min_length=1)
    modes: dict[str, EvaluateMode] = Field(min_length=1)

    @model_validator(mode="after")
    def _every_batch(self) -> EvaluateResult:
        batches = {str(c.batch) for c in self.costs}
        for name, mode in self.modes.items():
            missing = sorted(batches - set(mode.steps), key=int)
            if missing:
                raise ValueError(f"mode {name!r} has no 'steps' at batch size {missing[0]}, which 'costs' measured")
        return self


def _read(path: str | Path, what: str, model):
    """``model`` read from ``path``; a file that does not fit is ``PATH: not a hybridspec WHAT result: why``."""
    try:
        return read_model(path, f"hybridspec {what} result", model)
    except InputError as e:
        if not str(e).startswith(f"{path}: "):  # no such file, or a directory: said as it is
            raise
        raise InputError(f"{path}: not a hybridspec {what} result: {str(e).removeprefix(f'{path}: ')}") from None


def load_compare(path: str | Path) -> CompareResult:
    return _read(path, "compare", CompareResult)


def load_evaluate(path: str | Path) -> EvaluateResult:
    return _read(path, "evaluate", EvaluateResult)
