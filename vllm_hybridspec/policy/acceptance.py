"""Acceptance model: conditional acceptance ``c_i`` and prefix probabilities ``p_i`` of draft tokens.

HybridSpec paper, "GPU-resident selection of verification length" (draft-side selector) and
"Calibration data".  The confidence of draft position ``i`` is calibrated by a per-position isotonic
regression ``q_i = iso_i(conf_i)``; a logistic model then combines

    q_i,  i / D,  q_i * i / D,  log(1 + h_i),  log(h_i / hbar_{i-1})

where ``hbar_i = (h_i + hbar_{i-1}) / 2`` with ``hbar_0 = h_1`` is the moving average of the entropy
within the proposal block, into ``c_i ~ P(A_D >= i | A_D >= i - 1, I)``.  The prefix probabilities
``p_i = prod_{j <= i} c_j`` satisfy ``1 >= p_1 >= ... >= p_D >= 0``.

Training (:func:`fit_acceptance`, scikit-learn) uses the label ``1[A_D >= i]`` among rounds with
``A_D >= i - 1``, and excludes rounds cut short by EOS or the output limit.  Evaluation
(:func:`acceptance_model`) is one batched torch function with no host sync and no loop over the
batch, on whatever device its inputs are on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .errors import InputError
from .records import Rounds

FEATURES = ("calibrated_conf", "position", "calibrated_conf*position", "log1p_entropy",
            "entropy_change")
DEFAULT_ENTROPY_EPS = 1e-4  # keeps log(h_i / hbar_{i-1}) finite for a drafter that is sure (h = 0)


def ema_matrix(draft_len: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """``A`` with ``(h @ A.T)[:, i-1] = hbar_{i-1}``, the moving average before position ``i``.

    Unrolled, ``hbar_{i-1} = 2^{-(i-2)} h_1 + sum_{j=2}^{i-1} 2^{-(i-j)} h_j`` for ``i >= 2``, and
    ``hbar_0 = h_1``; one small matmul replaces a loop over the D positions.
    """
    a = torch.zeros(draft_len, draft_len, dtype=torch.float64)
    a[0, 0] = 1.0
    for i in range(2, draft_len + 1):
        a[i - 1, 0] = 2.0 ** -(i - 2)
        for j in range(2, i):
            a[i - 1, j - 1] = 2.0 ** -(i - j)
    return a.to(dtype=dtype, device=device)


@dataclass
class AcceptanceModel:
    """Fitted acceptance parameters as tensors (move with :meth:`to`)."""

    iso_x: torch.Tensor      # [D, K] isotonic thresholds per position, non-decreasing (padded)
    iso_y: torch.Tensor      # [D, K] calibrated confidence at each threshold
    coef: torch.Tensor       # [5] logistic weights, in FEATURES order
    intercept: torch.Tensor  # [] logistic bias
    ema: torch.Tensor        # [D, D] ema_matrix(D)
    position: torch.Tensor   # [D] i / D
    entropy_eps: float
    # Derived for the per-round path (acceptance_model), so that it reads no value on the host:
    segments: torch.Tensor   # [D, K + 1, 3] (x, y, slope) of the segment left of each threshold
    q_scale: torch.Tensor    # [D] coef[0] + coef[2] * i / D
    offset: torch.Tensor     # [D] coef[1] * i / D + intercept
    w_entropy: tuple[float, float]  # coef[3], coef[4] as Python numbers

    @property
    def draft_len(self) -> int:
        return self.iso_x.shape[0]

    @classmethod
    def from_params(cls, isotonic: list[tuple[list[float], list[float]]], coef: list[float],
                    intercept: float, entropy_eps: float = DEFAULT_ENTROPY_EPS) -> AcceptanceModel:
        """Build from per-position ``(x, y)`` threshold lists (as in the policy file)."""
        d = len(isotonic)
        k = max(2, max(len(x) for x, _ in isotonic))
        # pad by repeating the last threshold: rows stay sorted for searchsorted, values unchanged
        x = torch.tensor([list(x) + [x[-1]] * (k - len(x)) for x, _ in isotonic], dtype=torch.float64)
        y = torch.tensor([list(y) + [y[-1]] * (k - len(y)) for _, y in isotonic], dtype=torch.float64)
        dx, dy = x[:, 1:] - x[:, :-1], y[:, 1:] - y[:, :-1]
        slope = torch.where(dx > 0, dy / dx.clamp_min(1e-300), torch.zeros_like(dx))
        # entry i describes the segment starting at threshold i - 1 (what searchsorted(right=True)
        # returns for a value inside it); entry 0 is never read once values are clamped to x[:, 0]
        seg = torch.stack([x, y, F.pad(slope, (0, 1))], dim=-1)            # [D, K, 3]
        seg = torch.cat([seg[:, :1], seg], dim=1)                           # [D, K + 1, 3]
        coef_t = torch.tensor(coef, dtype=torch.float64)
        position = torch.arange(1, d + 1, dtype=torch.float64) / d
        return cls(
            iso_x=x, iso_y=y, coef=coef_t, intercept=torch.tensor(float(intercept), dtype=torch.float64),
            ema=ema_matrix(d), position=position, entropy_eps=float(entropy_eps), segments=seg,
            q_scale=coef_t[0] + coef_t[2] * position, offset=coef_t[1] * position + float(intercept),
            w_entropy=(float(coef[3]), float(coef[4])),
        )

    def to(self, device=None, dtype=None) -> AcceptanceModel:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, v in moved.items():
            if isinstance(v, torch.Tensor):
                moved[name] = v.to(device=device, dtype=dtype)
        return AcceptanceModel(**moved)


def isotonic_calibrate(conf: torch.Tensor, model: AcceptanceModel) -> torch.Tensor:
    """Per-position piecewise-linear isotonic map, clipped at the ends (as sklearn's ``predict``).

    conf: [B, D] -> [B, D] (a transposed view of a [D, B] tensor).
    """
    v = conf.transpose(0, 1).contiguous()                                # [D, B]
    v = torch.clamp(v, model.iso_x[:, :1], model.iso_x[:, -1:])
    seg = torch.searchsorted(model.iso_x, v, right=True)                 # [D, B] in 1..K
    x, y, slope = model.segments.gather(
        1, seg[:, :, None].expand(-1, -1, 3)).unbind(-1)                # [D, B] each
    return torch.addcmul(y, slope, v - x).transpose(0, 1)


def acceptance_features(q: torch.Tensor, ent: torch.Tensor, model: AcceptanceModel) -> torch.Tensor:
    """The logistic model's inputs, by definition.  q (calibrated confidence), ent: [B, D]
    -> [B, D, 5] in FEATURES order.  Fitting uses this; :func:`acceptance_model` computes the same
    logit with fewer kernels."""
    eps = model.entropy_eps
    h_prev = ent @ model.ema.T                                           # [B, D] hbar_{i-1}
    pos = model.position.expand_as(q)
    return torch.stack(
        [q, pos, q * pos, torch.log1p(ent), torch.log((ent + eps) / (h_prev + eps))], dim=-1)


def acceptance_model(conf: torch.Tensor, ent: torch.Tensor, model: AcceptanceModel
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional and prefix acceptance probabilities for a batch of proposal blocks.

    conf, ent: [B, D] float (top-1 confidence, entropy), on any device.
    Returns ``c, p``: [B, D] in the inputs' dtype, ``p`` non-increasing along D.
    """
    model = model.to(conf.device, conf.dtype)
    eps = model.entropy_eps
    w_log1p, w_change = model.w_entropy
    q = isotonic_calibrate(conf, model)                                  # [B, D]
    # logit = coef . acceptance_features + intercept, with the position terms folded per position
    logit = torch.addcmul(model.offset, q, model.q_scale)
    logit = logit.add_(torch.log1p(ent), alpha=w_log1p)
    ent_eps = ent + eps
    h_prev = ent_eps @ model.ema.T          # hbar_{i-1} + eps: every row of ema sums to 1
    logit = logit.add_(torch.log(ent_eps), alpha=w_change).sub_(torch.log(h_prev), alpha=w_change)
    c = torch.sigmoid(logit)
    return c, torch.cumprod(c, dim=1)


def training_labels(rounds: Rounds) -> tuple[torch.Tensor, torch.Tensor]:
    """``eligible[r, i-1] = A_D >= i - 1`` and ``label[r, i-1] = A_D >= i``: [N, D] bool each."""
    i = torch.arange(1, rounds.draft_len + 1)
    a = rounds.accepted[:, None]
    return a >= i - 1, a >= i


def fit_acceptance(rounds: Rounds, entropy_eps: float = DEFAULT_ENTROPY_EPS,
                   regularization: float = 10.0) -> AcceptanceModel:
    """Fit isotonic calibrations and the logistic model on untruncated capture rounds."""
    # imported here so that evaluating a fitted model (the serving path) needs no scikit-learn
    from sklearn.isotonic import IsotonicRegression
    from sklearn.linear_model import LogisticRegression

    rounds = rounds.select(~rounds.truncated)
    if len(rounds) == 0:
        raise InputError("no untruncated rounds to fit the acceptance model on; rounds cut by EOS "
                         "or the output limit carry no acceptance labels")
    eligible, label = training_labels(rounds)
    d = rounds.draft_len
    isotonic: list[tuple[list[float], list[float]]] = []
    for i in tqdm(range(d), desc="isotonic calibration", unit=" positions", disable=None,
                  leave=False):
        rows = eligible[:, i]
        if not rows.any():
            # no round reached this position: reuse the previous position's calibration
            isotonic.append(isotonic[-1])
            continue
        iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
        iso.fit(rounds.conf[rows, i].numpy(), label[rows, i].numpy().astype(np.float64))
        isotonic.append((iso.X_thresholds_.tolist(), iso.y_thresholds_.tolist()))

    model = AcceptanceModel.from_params(isotonic, [0.0] * len(FEATURES), 0.0, entropy_eps)
    q = isotonic_calibrate(rounds.conf, model)
    x = acceptance_features(q, rounds.ent, model)[eligible].numpy()     # [samples, 5]
    y = label[eligible].numpy()
    if y.all() or not y.any():
        raise InputError(f"all {y.size} training labels are {int(y[0])}: the records need both "
                         f"accepted and rejected draft tokens to fit an acceptance model")
    logit = LogisticRegression(C=regularization, max_iter=2000).fit(x, y)
    return AcceptanceModel.from_params(isotonic, logit.coef_[0].tolist(), float(logit.intercept_[0]),
                                       entropy_eps)
