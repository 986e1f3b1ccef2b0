"""The rate ``rho``: the Dinkelbach fixed point of pooled throughput over a set of rounds.

HybridSpec paper, "Setting and throughput objective" (Eq. 4) and "GPU-resident selection of
verification length".  Pooled throughput ``sum_r G_r(M_r) / sum_r L_r(M_r)`` is a ratio of sums;
by Dinkelbach's theorem its maximum ``rho*`` is attained exactly when every round maximises
``G_r - rho* L_r``.  The iteration ``rho <- ratio(argmax_r (G_r - rho L_r))`` increases ``rho``
monotonically and stops after finitely many steps at ``rho*``.
"""

from __future__ import annotations

import torch


def dinkelbach(gain: torch.Tensor, time: torch.Tensor, allowed: torch.Tensor | None = None,
               max_iter: int = 200) -> tuple[float, torch.Tensor]:
    """Maximise pooled throughput over one choice per round.

    gain: [N, K] expected emitted tokens of each option, time: [N, K] (or [K]) positive latency,
    allowed: [N, K] or [K] bool (default all).  Ties go to the lower option index (the shorter
    length when options are sorted by length).
    Returns ``(rho*, choice)`` with ``choice`` [N] int64 the option each round takes at ``rho*``.
    """
    gain = gain.double()
    time = time.double().expand_as(gain)
    if allowed is None:
        allowed = torch.ones_like(gain, dtype=torch.bool)
    allowed = allowed.expand_as(gain)
    if not allowed.any(dim=1).all():
        raise ValueError("every round needs at least one allowed option")
    if not (time[allowed] > 0).all():
        raise ValueError("latencies of allowed options must be positive")
    neg_inf = torch.tensor(-torch.inf, dtype=torch.float64)
    rate = 0.0
    for _ in range(max_iter):
        choice = torch.where(allowed, gain - rate * time, neg_inf).argmax(dim=1)
        g = gain.gather(1, choice[:, None]).sum()
        t = time.gather(1, choice[:, None]).sum()
        new = float(g / t)
        # F(rate) = sum(G - rate L) >= 0, so new >= rate; equality (to rounding) is the fixed point
        if new <= rate * (1 + 1e-13):
            return new, choice
        rate = new
    raise RuntimeError(f"Dinkelbach iteration did not converge in {max_iter} steps (rate {rate})")
