"""Fit a whole policy file from capture-run records and a cost file (``hybridspec calibrate fit``).

HybridSpec paper, "Calibration data" and "GPU-resident selection of verification length": the
acceptance model is trained on the untruncated capture rounds, the cost curve on the fixed-length
timings, and ``rho`` is the Dinkelbach fixed point of the draft-side selector over the capture
rounds: the numerator sums ``1 + sum_{i < w0} p_i``, the denominator ``C_tgt(w0) + fixed``.
"""

from __future__ import annotations

import torch
from pydantic import ValidationError

from .acceptance import FEATURES, acceptance_model, fit_acceptance
from .cost import CostFile, cost_curve, expert_tables
from .errors import InputError, describe
from .policy_file import (AcceptanceParams, BatchedParams, CostParams, IsotonicMap, PolicyFile,
                          RoutingParams)
from .rate import dinkelbach
from .records import Rounds
from .selector import expected_tokens


def capture_rate(p: torch.Tensor, curve: list[float], fixed: float, min_length: int = 2) -> float:
    """``rho``: the draft-side selector's pooled throughput on rounds with estimates ``p`` [N, D]."""
    w = torch.arange(1, p.shape[1] + 2)
    time = torch.tensor(curve, dtype=torch.float64) + fixed                 # [W]
    rate, _ = dinkelbach(expected_tokens(p.double()), time, w >= min_length)
    return rate


def batched_rate(p: torch.Tensor, batch: int, candidates: list[int], curve: list[float],
                 fixed: float) -> float:
    """``rho_B`` over consecutive groups of ``batch`` rounds sharing one length from ``candidates``."""
    groups = p.shape[0] // batch
    if groups == 0:
        raise InputError(f"batched costs for B = {batch} need at least {batch} untruncated rounds")
    cand = torch.tensor(candidates)
    gain = expected_tokens(p[:groups * batch].double())[:, cand - 1]        # [groups * B, K]
    gain = gain.view(groups, batch, -1).sum(dim=1)                          # [groups, K]
    time = torch.tensor(curve, dtype=torch.float64)[cand - 1] + fixed
    rate, _ = dinkelbach(gain, time)
    return rate


def predicted_speedup(rate_b: float, batch: int, plain_ms: float) -> float:
    """The batched selector's pooled rate ``rho_B`` (tokens per ms) over plain decoding's
    ``batch / plain_ms``: the batch gate speculates at ``batch`` where it is above 1."""
    return rate_b * plain_ms / batch



def fit_policy(rounds: Rounds, costs: CostFile, min_length: int = 2,
               provenance: dict | None = None) -> tuple[PolicyFile, list[str]]:
    """Fit every parameter.  Returns the policy and notes worth telling the user.  Records and costs
    each within their ranges can still give a value beyond a policy's (a plain step a minute long beside
    rounds of a microsecond): that is one :class:`InputError` naming the field."""
    try:
        return _fit(rounds, costs, min_length, provenance)
    except ValidationError as e:
        raise InputError(f"{describe(e, 'the fitted policy')}; the records and costs give a value outside "
                         "a policy's ranges (docs/inputs.md)") from None


def _fit(rounds: Rounds, costs: CostFile, min_length: int, provenance: dict | None
         ) -> tuple[PolicyFile, list[str]]:
    notes: list[str] = []
    d, w_max = rounds.draft_len, rounds.draft_len + 1
    if min_length not in (1, 2):
        raise InputError(f"min_length is {min_length}; it must be 1 or 2")
    acc = fit_acceptance(rounds)
    iso = [IsotonicMap(x=x.tolist(), y=y.tolist()) for x, y in zip(*_unpad(acc.iso_x, acc.iso_y))]

    curve = cost_curve(costs.round_ms, w_max, costs.fixed_ms, "costs: round_ms")
    capture = rounds.select(~rounds.truncated)
    _, p = acceptance_model(capture.conf, capture.ent, acc)                 # [N, D] f64
    rate = capture_rate(p, curve.values(), curve.fixed, min_length)

    routing = None
    s, eta = costs.stage0_slope(), costs.expert_cost()
    has_l0 = bool((capture.n_new_l0 >= 0).all(dim=1).any())
    if s is None or eta is None:
        notes.append("no routing correction: the cost file gives no Stage-0 slope (s_ms or "
                     "stage0) or no expert cost (eta_ms or experts)")
    elif not has_l0:
        notes.append("no routing correction: no untruncated round carries 'n_new_l0'")
    else:
        k = costs.experts_per_token or max(int(capture.n_new_l0.max()), 1)
        if int(capture.n_new_l0.max()) > k:
            raise InputError(f"a record has n_new_l0 = {int(capture.n_new_l0.max())} but the cost "
                             f"file's experts_per_token is {k}; a token adds at most top-k experts")
        n_all, n_all_given, later = expert_tables(rounds, k)
        if not later:
            notes.append("no round carries 'n_new_later': the expert tables count Layer-0 "
                         "experts only, so the correction undercharges later-layer experts")
        routing = RoutingParams(s=s, eta=eta, experts_per_token=k, later_layers=later,
                                n_all=n_all, n_all_given=n_all_given)

    batched, gate, speedup = {}, {}, {}
    for b, bc in sorted(costs.batched.items()):
        where = f"costs: batched.{b}.round_ms"
        c = cost_curve(bc.round_ms, w_max, bc.fixed_ms, where)
        cand = bc.candidates or sorted(bc.round_ms)
        if cand != sorted(set(cand)) or not all(1 <= w <= w_max for w in cand):
            raise InputError(f"costs: batched.{b}.candidates is {cand}; it must be increasing "
                             f"lengths within 1..{w_max}")
        batched[b] = BatchedParams(
            measured_lengths=sorted(bc.round_ms), quadratic=c.quadratic, fixed=c.fixed,
            curve=c.values(), candidates=cand, rate=batched_rate(p, b, cand, c.values(), c.fixed))
        speedup[b] = predicted_speedup(batched[b].rate, b, bc.plain_ms or c.values()[0] + c.fixed)
        gate[b] = speedup[b] > 1.0
    if gate and not all(gate.values()):
        notes.append(f"batch gate: drafting off at batch sizes {[b for b, on in gate.items() if not on]}")

    policy = PolicyFile(
        draft_len=d, min_length=min_length,
        acceptance=AcceptanceParams(features=list(FEATURES), entropy_eps=acc.entropy_eps,
                                    isotonic=iso, coef=acc.coef.tolist(),
                                    intercept=float(acc.intercept)),
        cost=CostParams(measured_lengths=sorted(costs.round_ms), quadratic=curve.quadratic,
                        fixed=curve.fixed, curve=curve.values()),
        rate=rate, routing=routing, batched=batched, gate=gate, speedup=speedup,
        fit={"rounds": len(rounds), "untruncated_rounds": len(capture), **(provenance or {})},
    )
    return policy, notes


def _unpad(iso_x: torch.Tensor, iso_y: torch.Tensor):
    """Drop the repeated trailing thresholds that :meth:`AcceptanceModel.from_params` added."""
    xs, ys = [], []
    for x, y in zip(iso_x, iso_y):
        keep = torch.ones_like(x, dtype=torch.bool)
        keep[1:] = x[1:] > x[:-1]
        xs.append(x[keep])
        ys.append(y[keep])
    return xs, ys
