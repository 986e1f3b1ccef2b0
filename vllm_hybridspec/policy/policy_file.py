"""The policy file (versioned JSON) holding every fitted parameter, and :class:`Policy`, the same
parameters as device tensors with the per-round calls of Algorithm 1.

Version 1 (``hybridspec calibrate fit`` writes it; times in milliseconds, lengths ``w = M + 1``)::

    {
      "format": "hybridspec-policy", "version": 1,
      "draft_len": 15,                      # D; W = D + 1
      "min_length": 2,                      # W0 = {min_length..W}; 1 allows verifying no draft token
      "time_unit": "ms",
      "acceptance": {
        "features": ["calibrated_conf", "position", "calibrated_conf*position",
                     "log1p_entropy", "entropy_change"],
        "entropy_eps": 1e-4,
        "isotonic": [{"x": [...], "y": [...]}, ...],      # D maps, x increasing, y in [0, 1]
        "coef": [5 floats], "intercept": float
      },
      "cost": {"measured_lengths": [...], "quadratic": [c0, c1, c2], "fixed": float,
               "curve": [W floats]},                    # C_tgt(w) = c0 + c1 w + c2 w^2 - fixed
      "rate": float,                                    # rho, tokens per ms
      "routing": null | {"s": float, "eta": float, "experts_per_token": k, "later_layers": bool,
                         "n_all": [D floats], "n_all_given": [D rows of k + 1 floats]},
      "batched": {"4": {"candidates": [2, 4, 8, 12, 16], "quadratic": [...], "fixed": float,
                        "curve": [W floats], "rate": float}},
      "gate": {"1": true, "64": false},                 # optional: speculate at batch size B?
      "speedup": {"1": 1.8, "64": 0.9},                 # optional: predicted tokens/s over plain at B
      "fit": {...}                                      # provenance, free-form
    }

``speedup`` (optional) is the batch gate's source: at each calibrated batch size, the fitted
speculation's tokens per ms over plain decoding's (``rho_B * plain_ms_B / B``). A step with ``B``
requests drafts when the predicted speedup at ``B`` is above 1 (:meth:`Policy.predicted_speedup`:
interpolated between calibrated sizes, and beyond the largest one never above what it was there nor
above that value scaled by ``B_max / B``, as if speculation's throughput stopped growing with the batch
while plain decoding's grew in proportion). Each prediction needs the ``batched`` costs at its size, and
``gate`` holds the same decisions at the same sizes (a file where they disagree is refused: one source);
a file with ``gate`` and no ``speedup`` (files without either load and never gate) takes, for ``B``
requests, the entry of the largest calibrated batch size ``<= B``, drafting below the smallest one.

``n_all[w0 - 1]`` is ``nbar_all(w0)`` and ``n_all_given[w0 - 1][n]`` is ``nbar_all(w0 | n)``.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .acceptance import FEATURES, AcceptanceModel, acceptance_model
from .cost import padded_curve
from .errors import InputError
from .files import read_json, read_model, write_text_atomic
from .ranges import (MAX_BATCH_RATE, MAX_COEF, MAX_EXPERTS_PER_TOKEN, MAX_LENGTH, MAX_MS,
                     MAX_NEW_EXPERTS, MAX_QUADRATIC, MAX_RATE, MAX_SPEEDUP, BatchKey, Length)
from .selector import expansion_table, routing_correction, select_length, select_shared_length, stage0_length

FORMAT = "hybridspec-policy"
VERSION = 1


def _finite(v: list[float]) -> list[float]:
    for i, x in enumerate(v):
        if not math.isfinite(x):
            raise ValueError(f"entry {i} is {x!r}; values must be finite")
    return v


def _check_curve(curve: list[float], quadratic: tuple[float, float, float], fixed: float,
                 draft_len: int, where: str) -> None:
    w_max = draft_len + 1
    if len(curve) != w_max:
        raise ValueError(f"'{where}.curve' has {len(curve)} values but needs {w_max} "
                         f"(C_tgt(w) for w = 1..{w_max}, draft_len {draft_len})")
    c0, c1, c2 = quadratic
    for w, got in enumerate(curve, start=1):
        want = c0 + c1 * w + c2 * w * w - fixed
        if abs(got - want) > 1e-6 * max(1.0, abs(want) + fixed):
            raise ValueError(f"'{where}.curve[{w - 1}]' is {got} but '{where}.quadratic' minus "
                             f"'{where}.fixed' gives {want} at w = {w}; the fields disagree")
        if not 0 < got + fixed <= MAX_MS:
            raise ValueError(f"'{where}.curve[{w - 1}]' + fixed = {got + fixed} at w = {w}; "
                             f"round times must lie in (0, {MAX_MS:g}] ms")


Unit = Annotated[float, Field(ge=0, le=1)]
NewExperts = Annotated[float, Field(ge=0, le=MAX_NEW_EXPERTS)]
Coef = Annotated[float, Field(ge=-MAX_COEF, le=MAX_COEF)]
Quadratic = Annotated[float, Field(ge=-MAX_QUADRATIC, le=MAX_QUADRATIC)]


class IsotonicMap(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    x: list[Unit] = Field(min_length=1)  # the drafter's confidence in the draft token, a probability
    y: list[float] = Field(min_length=1)

    _fin = field_validator("x", "y")(_finite)

    @model_validator(mode="after")
    def _monotone(self) -> IsotonicMap:
        if len(self.x) != len(self.y):
            raise ValueError(f"'x' has {len(self.x)} thresholds but 'y' has {len(self.y)}")
        if any(b <= a for a, b in zip(self.x, self.x[1:])):
            raise ValueError("'x' must be strictly increasing")
        if any(b < a for a, b in zip(self.y, self.y[1:])) or not all(0 <= y <= 1 for y in self.y):
            raise ValueError("'y' must be non-decreasing and lie in [0, 1]")
        return self


class AcceptanceParams(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    features: list[str]
    entropy_eps: float = Field(gt=0, le=1)
    isotonic: list[IsotonicMap]
    coef: list[Coef]
    intercept: Coef

    _fin = field_validator("coef")(_finite)

    @field_validator("features")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        if tuple(v) != FEATURES:
            raise ValueError(f"must be {list(FEATURES)} for this build, got {v}")
        return v

    @model_validator(mode="after")
    def _sizes(self) -> AcceptanceParams:
        if len(self.coef) != len(FEATURES):
            raise ValueError(f"'coef' has {len(self.coef)} weights but there are {len(FEATURES)} "
                             f"features")
        if not math.isfinite(self.intercept):
            raise ValueError(f"'intercept' is {self.intercept}; it must be finite")
        return self


class CostParams(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    measured_lengths: list[Length] = Field(min_length=3)
    quadratic: tuple[Quadratic, Quadratic, Quadratic]
    fixed: float = Field(ge=0, le=MAX_MS)
    curve: list[Annotated[float, Field(ge=-MAX_MS, le=MAX_MS)]]

    _fin = field_validator("curve")(_finite)


class BatchedParams(CostParams):
    candidates: list[Length] = Field(min_length=1)
    rate: float = Field(gt=0, le=MAX_BATCH_RATE)  # the batch's tokens per ms


class RoutingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    s: float = Field(ge=0, le=MAX_MS)
    eta: float = Field(ge=0, le=MAX_MS)
    experts_per_token: int = Field(ge=1, le=MAX_EXPERTS_PER_TOKEN)
    later_layers: bool
    n_all: list[NewExperts]        # expected new experts: counts
    n_all_given: list[list[NewExperts]]

    _fin = field_validator("n_all")(_finite)


class PolicyFile(BaseModel):
    """Schema of the policy file; see the module docstring."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    format: Literal["hybridspec-policy"] = FORMAT
    version: int = Field(default=VERSION, ge=VERSION, le=VERSION)  # an int: 1.0 is refused
    draft_len: int = Field(ge=1, le=MAX_LENGTH - 1)
    min_length: int = Field(default=2, ge=1, le=2)
    time_unit: Literal["ms"] = "ms"
    acceptance: AcceptanceParams
    cost: CostParams
    rate: float = Field(gt=0, le=MAX_RATE)
    routing: RoutingParams | None = None
    batched: dict[BatchKey, BatchedParams] = {}
    gate: dict[BatchKey, bool] = {}
    speedup: dict[BatchKey, Annotated[float, Field(gt=0, le=MAX_SPEEDUP)]] = {}
    fit: dict[str, Any] = {}

    @model_validator(mode="after")
    def _consistent(self) -> PolicyFile:
        d, w_max = self.draft_len, self.draft_len + 1
        if len(self.acceptance.isotonic) != d:
            raise ValueError(f"'acceptance.isotonic' has {len(self.acceptance.isotonic)} maps but "
                             f"draft_len is {d}; one map per draft position is needed")
        _check_curve(self.cost.curve, self.cost.quadratic, self.cost.fixed, d, "cost")
        m = self.cost.measured_lengths
        if m != sorted(set(m)) or not all(1 <= w <= w_max for w in m):
            raise ValueError(f"'cost.measured_lengths' is {m}; one entry per measured length, "
                             f"increasing, within 1..{w_max} (W = draft_len + 1)")
        if r := self.routing:
            if len(r.n_all) != d:
                raise ValueError(f"'routing.n_all' has {len(r.n_all)} values but needs draft_len "
                                 f"= {d} (one per w0 = 1..{d})")
            if len(r.n_all_given) != d:
                raise ValueError(f"'routing.n_all_given' has {len(r.n_all_given)} rows but needs "
                                 f"draft_len = {d}")
            for j, row in enumerate(r.n_all_given):
                if len(row) != r.experts_per_token + 1 or not all(map(math.isfinite, row)):
                    raise ValueError(f"'routing.n_all_given[{j}]' needs {r.experts_per_token + 1} "
                                     f"finite values (n = 0..experts_per_token), got {row}")
        for b, p in self.batched.items():
            _check_curve(p.curve, p.quadratic, p.fixed, d, f"batched.{b}")
            c = p.candidates
            if c != sorted(set(c)) or not all(1 <= w <= w_max for w in c):
                raise ValueError(f"'batched.{b}.candidates' is {c}; it must be increasing, "
                                 f"without repeats, within 1..{w_max}")
        self._one_gate()
        return self

    def _one_gate(self) -> None:
        """``speedup`` is the gate's one source: each prediction comes from the batched costs at its batch
        size, and ``gate``, when given beside it, holds the same decisions (speedup above 1) at the same sizes."""
        for b in sorted(self.speedup):
            if b not in self.batched:
                raise ValueError(f"'speedup.{b}' has no 'batched.{b}', the costs a prediction comes from; "
                                 f"batched sizes: {sorted(self.batched) or 'none'}")
        if self.speedup and self.gate:
            if set(self.gate) != set(self.speedup):
                raise ValueError(f"'gate' has batch sizes {sorted(self.gate)} but 'speedup' {sorted(self.speedup)}; "
                                 "the gate holds the prediction's decisions at the same sizes")
            for b in sorted(self.gate):
                if self.gate[b] != (self.speedup[b] > 1.0):
                    raise ValueError(f"'gate.{b}' is {str(self.gate[b]).lower()} but 'speedup.{b}' is "
                                     f"{self.speedup[b]:g}, which gives {str(self.speedup[b] > 1.0).lower()} "
                                     "(draft where the speedup is above 1); the two must agree")


def load_policy(path: str | Path) -> PolicyFile:
    """Read and validate a policy file; raise :class:`InputError` naming the bad field."""
    obj = read_json(path, "policy file")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise InputError(f"{path}: not a policy file (field 'format' must be '{FORMAT}')")
    if type(obj.get("version")) is not int or obj["version"] != VERSION:
        raise InputError(f"{path}: field 'version' is {obj.get('version')!r}; this build reads "
                         f"policy files of version {VERSION}")
    return read_model(path, "policy file", PolicyFile)


def save_policy(policy: PolicyFile, path: str | Path) -> None:
    """Write the policy file atomically: all of it, or nothing on failure."""
    write_text_atomic(path, policy.model_dump_json(indent=1) + "\n")


@dataclass
class RoutingTables:
    s: float
    eta: float
    n_all: torch.Tensor        # [D + 1] indexed by w0, entry 0 unused
    n_all_given: torch.Tensor  # [D + 1, topk + 1]


@dataclass
class BatchedCost:
    candidates: torch.Tensor   # [K] int64
    cost: torch.Tensor         # [W + 2] C_B indexed by w
    fixed: float
    rate: float


@dataclass
class Policy:
    """Fitted parameters as tensors on one device, and the per-round steps of Algorithm 1."""

    draft_len: int
    min_length: int
    acceptance: AcceptanceModel
    cost: torch.Tensor         # [W + 2] C_tgt indexed by w
    fixed: float
    rate: float
    routing: RoutingTables | None
    batched: dict[int, BatchedCost]
    gate: dict[int, bool] = field(default_factory=dict)
    speedup: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_params(cls, f: PolicyFile) -> Policy:
        a = f.acceptance
        routing = None
        if f.routing is not None:
            r = f.routing
            routing = RoutingTables(
                r.s, r.eta, torch.tensor([0.0] + r.n_all, dtype=torch.float64),
                torch.tensor([[0.0] * (r.experts_per_token + 1)] + r.n_all_given,
                             dtype=torch.float64))
        return cls(
            draft_len=f.draft_len, min_length=f.min_length,
            acceptance=AcceptanceModel.from_params([(m.x, m.y) for m in a.isotonic], a.coef,
                                                   a.intercept, a.entropy_eps),
            cost=padded_curve(f.cost.curve), fixed=f.cost.fixed, rate=f.rate, routing=routing,
            batched={b: BatchedCost(torch.tensor(p.candidates), padded_curve(p.curve), p.fixed,
                                    p.rate) for b, p in f.batched.items()},
            gate=dict(f.gate), speedup=dict(f.speedup),
        )

    @classmethod
    def load(cls, path: str | Path, device=None, dtype=torch.float32) -> Policy:
        return cls.from_params(load_policy(path)).to(device, dtype)

    def to(self, device=None, dtype=None) -> Policy:
        routing = self.routing and RoutingTables(
            self.routing.s, self.routing.eta, self.routing.n_all.to(device, dtype),
            self.routing.n_all_given.to(device, dtype))
        return Policy(
            self.draft_len, self.min_length, self.acceptance.to(device, dtype),
            self.cost.to(device, dtype), self.fixed, self.rate, routing,
            {b: BatchedCost(c.candidates.to(device), c.cost.to(device, dtype), c.fixed, c.rate)
             for b, c in self.batched.items()}, dict(self.gate), dict(self.speedup))

    def full_length(self, batch: int, device) -> torch.Tensor:
        return torch.full((batch,), self.draft_len + 1, dtype=torch.int64, device=device)

    def draft_side(self, conf: torch.Tensor, ent: torch.Tensor, w_rem: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Algorithm 1 lines 2-4.  conf, ent: [B, D]; w_rem: [B] int64 (default W).
        Returns ``p`` [B, D], the nominal length ``w0`` [B] and the Stage-0 length ``u`` [B]."""
        if w_rem is None:
            w_rem = self.full_length(conf.shape[0], conf.device)
        _, p = acceptance_model(conf, ent, self.acceptance)
        w0 = select_length(p, self.cost, self.rate, self.min_length)
        return p, w0, stage0_length(w0, w_rem)

    def correct(self, p: torch.Tensor, w0: torch.Tensor, u: torch.Tensor, n_new: torch.Tensor,
                w_rem: torch.Tensor | None = None) -> torch.Tensor:
        """Algorithm 1 lines 6-11: the executed length ``w`` [B] from Stage 0's ``n_new`` [B]."""
        if self.routing is None:
            raise InputError("this policy file has no 'routing' section (the cost file gave no "
                             "s and eta, or the records no Layer-0 expert counts)")
        if w_rem is None:
            w_rem = self.full_length(p.shape[0], p.device)
        r = self.routing
        return routing_correction(p, w0, u, n_new, w_rem, self.cost, self.rate, r.s, r.eta,
                                  r.n_all, r.n_all_given)

    def expansion_table(self, p: torch.Tensor, w0: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Algorithm 1 lines 6-10 ahead of Stage 0: ``[B, topk + 1]`` bool, whether ``d_{w0}`` is kept
        given ``n`` new Layer-0 experts (``selector.expansion_table``); :meth:`correct` looks it up."""
        if self.routing is None:
            raise InputError("this policy file has no 'routing' section (the cost file gave no "
                             "s and eta, or the records no Layer-0 expert counts)")
        r = self.routing
        return expansion_table(p, w0, u, self.cost, self.rate, r.s, r.eta, r.n_all, r.n_all_given)

    @property
    def experts_per_token(self) -> int | None:
        """The router's top-k the routing tables were made for (``None`` without them)."""
        return None if self.routing is None else self.routing.n_all_given.shape[1] - 1

    def speculate(self, batch: int) -> bool:
        """The batch gate: draft at all in a step with ``batch`` requests?  With a ``speedup`` table,
        where the predicted speedup is above 1; otherwise the ``gate`` entry of the largest calibrated
        batch size ``<= batch``, on below the smallest one and without a gate table."""
        if self.speedup:
            return self.predicted_speedup(batch) > 1.0
        return _at_or_below(self.gate, batch, True)

    def predicted_speedup(self, batch: int) -> float:
        """Speculation's predicted tokens per ms over plain decoding's at ``batch`` requests, from the
        ``speedup`` table: the smallest calibrated size's value below it; linear in ``log B`` between
        calibrated sizes; beyond the largest, ``B_max``, the line through the last two sizes with its
        slope capped at 0, and never above ``speedup[B_max] * B_max / batch`` (speculation's throughput
        taken as flat in ``B`` past the last measurement, plain decoding's as growing in proportion)."""
        sizes = sorted(self.speedup)
        if not sizes:
            raise InputError("this policy file has no 'speedup' table (fit it from costs with batch sizes)")
        r = [self.speedup[b] for b in sizes]
        if batch <= sizes[0]:
            return r[0]
        x = math.log(batch)
        i = bisect_right(sizes, batch)
        if i < len(sizes):
            x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
            return r[i - 1] + (r[i] - r[i - 1]) * (x - x0) / (x1 - x0)
        b_max, r_max = sizes[-1], r[-1]
        line = r_max
        if len(sizes) > 1:
            slope = (r_max - r[-2]) / (math.log(b_max) - math.log(sizes[-2]))
            line = r_max + min(slope, 0.0) * (x - math.log(b_max))
        return min(line, r_max * b_max / batch)

    def gate_ranges(self, k: int, big: int) -> list[list[int]]:
        """The gate as vLLM's ``num_speculative_tokens_per_batch_size`` schedule: ``[[start, end, K or 0],
        ...]`` covering batch sizes ``1..big``, adjacent sizes with the same decision merged. Beyond the
        largest calibrated size the decision changes at most once (the predicted speedup only falls
        there), so the sizes are scanned up to it and that one change is found by bisection."""
        decide = self.speculate
        sizes = sorted(self.speedup or self.gate) or [1]
        dense = min(sizes[-1], big)
        ranges: list[list[int]] = []

        def add(start: int, end: int, on: bool) -> None:
            if ranges and ranges[-1][2] == (k if on else 0) and ranges[-1][1] == start - 1:
                ranges[-1][1] = end
            else:
                ranges.append([start, end, k if on else 0])

        for b in range(1, dense + 1):
            add(b, b, decide(b))
        if dense < big:
            on = decide(dense + 1)
            if on and not decide(big):  # the first size past the last calibrated one that gates off
                lo, hi = dense + 1, big
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if decide(mid) else (lo, mid)
                add(dense + 1, lo, True)
                add(hi, big, False)
            else:
                add(dense + 1, big, on)
        return ranges

    def batched_cost(self, batch: int) -> BatchedCost:
        """The batched costs of the largest calibrated batch size ``<= batch`` (the smallest one
        when ``batch`` is below all of them)."""
        if not self.batched:
            raise InputError("this policy file has no 'batched' section (the cost file measured no "
                             "batch sizes)")
        return _at_or_below(self.batched, batch, self.batched[min(self.batched)])

    def shared_length(self, p: torch.Tensor, w_rem: torch.Tensor | None = None,
                      active: torch.Tensor | None = None) -> torch.Tensor:
        """The batched variant: one length for the B requests of ``p`` [B, D] (0-d tensor)."""
        b = p.shape[0]
        if b not in self.batched:
            raise InputError(f"no batched costs for batch size {b}; the policy has "
                             f"{sorted(self.batched) or 'none'}")
        c = self.batched[b]
        return select_shared_length(p, c.candidates, c.cost, c.rate, w_rem, active)


def _at_or_below(table: dict, key: int, default):
    keys = sorted(table)
    i = bisect_right(keys, key)
    return table[keys[i - 1]] if i else default
