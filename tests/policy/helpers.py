"""Shared builders for the policy tests: a hand-made policy file and record lists."""

from __future__ import annotations

from vllm_hybridspec.policy.acceptance import FEATURES
from vllm_hybridspec.policy.policy_file import PolicyFile
from vllm_hybridspec.policy.records import RoundRecord, Rounds


def hand_policy(draft_len: int = 3, c: float = 0.5, rate: float = 0.3, quadratic=(2.0, 1.0, 0.0),
                fixed: float = 2.0, routing: dict | None = None, min_length: int = 2) -> PolicyFile:
    """Every draft token has acceptance ``c`` (identity isotonic maps, zero weights, logit(c) bias),
    so ``p_i = c^i``; ``C_tgt(w) = c0 + c1 w + c2 w^2 - fixed``."""
    import math

    c0, c1, c2 = quadratic
    w_max = draft_len + 1
    return PolicyFile.model_validate({
        "draft_len": draft_len, "min_length": min_length,
        "acceptance": {"features": list(FEATURES), "entropy_eps": 1e-4,
                       "isotonic": [{"x": [0.0, 1.0], "y": [0.0, 1.0]}] * draft_len,
                       "coef": [0.0] * 5, "intercept": math.log(c / (1 - c))},
        "cost": {"measured_lengths": [1, 2, 3], "quadratic": list(quadratic), "fixed": fixed,
                 "curve": [c0 + c1 * w + c2 * w * w - fixed for w in range(1, w_max + 1)]},
        "rate": rate, "routing": routing,
    })


def rounds_of(accepted: list[int], draft_len: int, **per_round) -> Rounds:
    """Rounds with the given A_D, confidence 0.5 and entropy 1 everywhere, plus any other fields
    given as lists (one entry per round)."""
    recs = []
    for r, a in enumerate(accepted):
        extra = {k: v[r] for k, v in per_round.items()}
        recs.append(RoundRecord(conf=[0.5] * draft_len, ent=[1.0] * draft_len, accepted=a, **extra))
    return Rounds.from_records(recs)
