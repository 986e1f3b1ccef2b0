"""Cost model: the target-cost curve ``C_tgt(w)``, the Stage-0 slope ``s``, the per-expert cost
``eta`` and the expert tables ``nbar_all(w0)``, ``nbar_all(w0 | n)``.

HybridSpec paper, "GPU-resident selection of verification length" (cost calibration).  A quadratic
in ``w`` is fitted to the mean decode time per round measured at fixed verification lengths, and
``C_tgt(w) = fit(w) - fixed`` where ``fixed`` is the per-round cost that does not depend on ``w``
(drafting, launch, commit).  Only ``C_tgt`` differences enter the selector, but ``C_tgt + fixed``
is the modelled round time that the rate and the simulator divide by.

Cost file (JSON, times in milliseconds)::

    {
      "version": 1,
      "round_ms": {"2": 8.9, "4": [11.3, 11.4, 11.2], "8": 14.4, "16": 18.1},
      "fixed_ms": 2.2,
      "stage0": {"tokens": [2, 4, 8, 16], "ms": [0.41, 0.44, 0.50, 0.62]},
      "eta_ms": 0.00418,
      "experts_per_token": 8,
      "batched": {"4": {"round_ms": {"2": 10.1, "4": 12.9, "8": 17.2, "12": 20.0, "16": 23.4},
                        "fixed_ms": 2.9}}
    }

``round_ms``          mean decode time per round (a number, or the samples) at each fixed length
                      ``w``; at least three lengths, all within 1..W.
``fixed_ms``          optional; defaults to the quadratic's constant term (0 where that is negative).
``s_ms`` | ``stage0`` the Stage-0 cost of one more token, given directly or as Stage-0 latency
                      against tokens (its least-squares slope).  Optional: without ``s`` and
                      ``eta`` the policy has no routing correction.
``eta_ms`` | ``experts`` the latency of one more distinct expert in one MoE layer, directly or as
                      ``{"distinct_experts": [...], "ms": [...]}`` (slope).
``experts_per_token`` optional top-k of the router; defaults to the largest ``n_new_l0`` recorded.
``batched``           optional, per batch size ``B``: the same ``round_ms``/``fixed_ms`` measured
                      with ``B`` requests per round, and optionally ``candidates`` (default: the
                      measured lengths), for the shared-length batched selector; and optionally
                      ``plain_ms``, the step time of plain decoding (no drafter) with ``B`` requests,
                      for the batch gate (default: the fitted round time at ``w = 1``, which still
                      pays the drafter, so the gate then leans towards speculating).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import InputError
from .files import read_model
from .ranges import (MAX_BATCH, MAX_EXPERTS_PER_TOKEN, MAX_LENGTH, MAX_MS, MAX_NEW_EXPERTS, MIN_MS, BatchKey,
                     Length, LengthKey)
from .records import Rounds

MIN_CELL_TOKENS = 30  # paper: sparser cells of nbar_all(w0 | n) use a linear fit in n


# the range a measured time can have is policy/ranges.py's (MIN_MS..MAX_MS milliseconds)
Ms = Annotated[float, Field(ge=0, le=MAX_MS)]


def _positive_times(v: dict[int, float | list[float]]) -> dict[int, float | list[float]]:
    for w, t in v.items():
        samples = t if isinstance(t, list) else [t]
        if not samples:
            raise ValueError(f"length {w} has an empty list of samples")
        for x in samples:
            if not (math.isfinite(x) and MIN_MS <= x <= MAX_MS):
                raise ValueError(f"length {w} has time {x!r} ms; a round time must be finite and within "
                                 f"{MIN_MS:g}..{MAX_MS:g} ms")
        if not 1 <= w <= MAX_LENGTH:
            raise ValueError(f"length {w} is not a verification length (1..{MAX_LENGTH})")
    return v


def _fixed_below_rounds(round_ms: dict[int, float | list[float]], fixed_ms: float | None, where: str) -> None:
    """``fixed`` is the part of a round that does not depend on ``w``: less than every measured round."""
    if fixed_ms is None or not round_ms:
        return
    shortest = min(float(np.mean(t)) for t in round_ms.values())
    if fixed_ms >= shortest:
        raise ValueError(f"'{where}fixed_ms' is {fixed_ms} ms, not below the shortest mean round time "
                         f"{shortest:g} ms; it is the part of a round that does not depend on w")


class LatencySeries(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    tokens: list[Annotated[float, Field(ge=0, le=MAX_BATCH * MAX_LENGTH)]] | None = None  # tokens in one step
    distinct_experts: list[Annotated[float, Field(ge=0, le=MAX_NEW_EXPERTS)]] | None = None
    ms: list[Ms]

    @model_validator(mode="after")
    def _paired(self) -> LatencySeries:
        x = self.tokens if self.tokens is not None else self.distinct_experts
        if x is None:
            raise ValueError("give the x values as 'tokens' (stage0) or 'distinct_experts' (experts)")
        if len(x) != len(self.ms) or len(x) < 2 or len(set(x)) < 2:
            raise ValueError(f"needs at least two distinct x values, each with one 'ms' entry; got "
                             f"{len(x)} x values and {len(self.ms)} times")
        return self

    def slope(self) -> float:
        x = self.tokens if self.tokens is not None else self.distinct_experts
        return float(np.polyfit(np.asarray(x, float), np.asarray(self.ms, float), 1)[0])


class BatchCosts(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    round_ms: dict[LengthKey, float | list[float]]
    fixed_ms: Ms | None = None
    candidates: list[Length] | None = None
    plain_ms: float | None = Field(default=None, ge=MIN_MS, le=MAX_MS)

    _times = field_validator("round_ms")(_positive_times)

    @model_validator(mode="after")
    def _fixed(self) -> BatchCosts:
        _fixed_below_rounds(self.round_ms, self.fixed_ms, "")
        return self


class CostFile(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    version: int = Field(default=1, ge=1, le=1)  # an int, so that 1.0 is refused as the other numbers are
    time_unit: Literal["ms"] = "ms"
    round_ms: dict[LengthKey, float | list[float]]
    fixed_ms: Ms | None = None
    s_ms: Ms | None = None
    stage0: LatencySeries | None = None
    eta_ms: Ms | None = None
    experts: LatencySeries | None = None
    experts_per_token: int | None = Field(default=None, ge=1, le=MAX_EXPERTS_PER_TOKEN)
    batched: dict[BatchKey, BatchCosts] = {}

    _times = field_validator("round_ms")(_positive_times)


    @model_validator(mode="after")
    def _one_source(self) -> CostFile:
        if self.s_ms is not None and self.stage0 is not None:
            raise ValueError("give 's_ms' or 'stage0', not both")
        if self.eta_ms is not None and self.experts is not None:
            raise ValueError("give 'eta_ms' or 'experts', not both")
        _fixed_below_rounds(self.round_ms, self.fixed_ms, "")
        return self

    def stage0_slope(self) -> float | None:
        """``s``: latency one more token adds to the Layer-0 GDN layer and router."""
        return self.s_ms if self.stage0 is None else max(self.stage0.slope(), 0.0)

    def expert_cost(self) -> float | None:
        """``eta``: latency one more distinct expert adds to one MoE layer."""
        return self.eta_ms if self.experts is None else max(self.experts.slope(), 0.0)


def load_costs(path: str | Path) -> CostFile:
    """Read and validate a cost file; raise :class:`InputError` naming the bad field."""
    return read_model(path, "cost file", CostFile)


@dataclass
class CostCurve:
    """``fit(w) = c0 + c1 w + c2 w^2``; ``C_tgt(w) = fit(w) - fixed``; round time = ``fit(w)``."""

    quadratic: tuple[float, float, float]
    fixed: float
    max_len: int  # W

    def round_time(self, w) -> np.ndarray:
        w = np.asarray(w, dtype=np.float64)
        c0, c1, c2 = self.quadratic
        return c0 + c1 * w + c2 * w * w

    def values(self) -> list[float]:
        """``C_tgt(w)`` for ``w = 1..W``."""
        return (self.round_time(np.arange(1, self.max_len + 1)) - self.fixed).tolist()


def cost_curve(round_ms: dict[int, float | list[float]], max_len: int, fixed: float | None = None,
               where: str = "round_ms") -> CostCurve:
    """Quadratic least-squares fit of the mean round time against the verification length."""
    lengths = sorted(round_ms)
    bad = [w for w in lengths if not 1 <= w <= max_len]
    if bad:
        raise InputError(f"{where}: length {bad[0]} is outside 1..{max_len} (W = D + 1 for the "
                         f"records' D = {max_len - 1})")
    if len(lengths) < 3:
        raise InputError(f"{where}: a quadratic needs times at three or more lengths, got "
                         f"{len(lengths)} ({lengths})")
    mean = [float(np.mean(round_ms[w])) for w in lengths]
    c2, c1, c0 = np.polyfit(np.asarray(lengths, float), np.asarray(mean, float), 2)
    # without a measured fixed cost, the constant term stands for it (a cost: not below 0 ms)
    curve = CostCurve((float(c0), float(c1), float(c2)), max(float(c0), 0.0) if fixed is None else fixed,
                      max_len)
    if np.any(curve.round_time(np.arange(1, max_len + 1)) <= 0):
        raise InputError(f"{where}: the quadratic fit of {dict(zip(lengths, mean))} predicts a "
                         f"non-positive round time within 1..{max_len}; measure more lengths")
    return curve


def expert_tables(rounds: Rounds, experts_per_token: int, min_cell: int = MIN_CELL_TOKENS
                  ) -> tuple[list[float], list[list[float]], bool]:
    """``nbar_all(w0)`` and ``nbar_all(w0 | n)`` for ``w0 = 1..D`` (draft token ``d_{w0}``),
    ``n = 0..experts_per_token``; and whether later-layer counts were recorded.

    ``nbar_all(w0)`` is the mean new Layer-0 experts of ``d_{w0}`` plus its mean new later-layer
    (layer, expert) pairs; the conditional table replaces the first mean with ``n`` and the second
    with its mean over the tokens at that position that add ``n`` Layer-0 experts, or, for cells
    with fewer than ``min_cell`` tokens, a per-position linear fit in ``n``.
    """
    rounds = rounds.select(~rounds.truncated)
    l0 = rounds.n_new_l0[(rounds.n_new_l0 >= 0).all(dim=1)].double()       # [N0, D]
    if len(l0) == 0:
        raise InputError("no untruncated round carries 'n_new_l0'; the routing correction needs "
                         "the Layer-0 expert counts of a capture run")
    both = (rounds.n_new_l0 >= 0).all(dim=1) & (rounds.n_new_later >= 0).all(dim=1)
    n0, later = rounds.n_new_l0[both].double(), rounds.n_new_later[both].double()  # [N1, D]
    has_later = len(n0) > 0
    n = np.arange(experts_per_token + 1, dtype=np.float64)
    n_all, n_all_given = [], []
    for j in range(rounds.draft_len):
        if not has_later:
            n_all.append(float(l0[:, j].mean()))
            n_all_given.append(n.tolist())
            continue
        x, y = n0[:, j].numpy(), later[:, j].numpy()
        if np.ptp(x) > 0:
            slope, intercept = np.polyfit(x, y, 1)
        else:
            slope, intercept = 0.0, float(y.mean())
        row = []
        for k in range(experts_per_token + 1):
            cell = y[x == k]
            mean_later = cell.mean() if len(cell) >= min_cell else max(intercept + slope * k, 0.0)
            row.append(k + float(mean_later))
        n_all.append(float(l0[:, j].mean()) + float(y.mean()))
        n_all_given.append(row)
    return n_all, n_all_given, has_later


def padded_curve(values: list[float]) -> torch.Tensor:
    """``[W + 2]`` tensor indexed by ``w``: entry 0 and entry ``W + 1`` are unused padding so that
    ``cost[w0 + 1]`` can be gathered for every ``w0`` without a bounds branch."""
    return torch.tensor([0.0] + list(values) + [math.inf], dtype=torch.float64)
