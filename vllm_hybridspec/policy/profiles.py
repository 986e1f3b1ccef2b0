"""Named acceptance profiles: seeded capture-run records that reproduce a published drafter's
acceptance, so that a benchmark can replay it at a full-size target shape without the weights
(``hybridspec calibrate synth --profile NAME``).

A profile is data, one :class:`AcceptanceProfile` entry in :data:`PROFILES`, and
:func:`synthesize_profile` turns any entry into records.  Generative model (one seeded generator;
a request, then its rounds, then draft positions ``i = 1..D``):

* true logit ``t_i = mu + first_bonus [i = 1] - decay (i - 1) + request_sd u + round_sd z +
  token_sd e_i`` with standard normal effects of the request (``u``), the round (``z``) and the
  draft token (``e_i``); the first draft token, predicted next to the target's own last hidden
  state, is the likeliest to be accepted.  The target accepts ``d_i`` given ``d_1..d_{i-1}`` with probability ``c_i = sigmoid(t_i)``, so
  ``p_true = cumprod(c)`` and ``A_D`` is drawn with ``P(A_D >= i) = p_i`` (the leading successes
  of independent ``Bernoulli(c_i)``).  The request and round terms give easy and hard stretches
  of text; a large round term, which the drafter's confidence also sees, makes whole rounds
  predictable, as the paper's HybridSpec row of Table 3 (AL 4.57 at mean length 6.2) needs.
* the drafter's top-1 confidence ``conf_i = sigmoid(t_i + conf_noise_sd n_i + conf_bias +
  overconfidence (i - 1))``, ``n_i`` standard normal: it sees the true logit through noise (so it
  ranks imperfectly) and decays less with position than acceptance does (so it is over-confident
  late in the block).
* entropy: ``conf_i`` on top and the rest spread over ``20 exp(0.8 (r n_i + sqrt(1 - r^2) x_i))``
  tokens, ``r = entropy_corr``, ``x_i`` standard normal: at equal confidence a flatter tail goes
  with an over-stated confidence, which gives the acceptance model's entropy features a little to
  add.  Expert counts as :func:`~vllm_hybridspec.policy.synthetic.expert_counts`.
* a request emits up to ``max_tokens`` tokens and ends early after a round with probability
  ``eos_prob``; the round that reaches EOS or the limit is truncated; ``remaining`` is the budget.

So that a file's statistics depend little on its seed, ``u`` runs through normal quantiles at a
golden-ratio sequence over requests, and ``z``, ``e_i`` and the uniform that decides ``A_D`` are
Latin-hypercube samples over blocks of 64 rounds (each value marginally as above).  Values are
rounded (3 decimals; ``p_true`` 4) to keep committed files small.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.special import ndtri

from .errors import InputError
from .records import RoundRecord
from .synthetic import expert_counts, top1_entropy

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
STRATUM_BLOCK = 64


class AcceptanceProfile(BaseModel):
    """One named profile: the generative model's parameters (module docstring), where they come
    from, and the measured statistics they were chosen to reproduce."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str
    source: str
    draft_len: int = Field(ge=1)
    mu: float
    first_bonus: float = 0.0
    decay: float
    request_sd: float = Field(ge=0)
    round_sd: float = Field(ge=0)
    token_sd: float = Field(ge=0)
    conf_noise_sd: float = Field(ge=0)
    conf_bias: float
    overconfidence: float
    entropy_corr: float = Field(ge=-1, le=1)
    max_tokens: int = Field(ge=1)
    eos_prob: float = Field(ge=0, le=1)
    experts_per_token: int = Field(default=8, ge=1)
    targets: dict[str, float]


PROFILES: dict[str, AcceptanceProfile] = {
    "paper-dflash-qwen3.6": AcceptanceProfile(
        description="vanilla DFlash on Qwen3.6-35B-A3B, greedy decoding, batch size 1, D = 15",
        source="HybridSpec paper, Table 3 (vanilla DFlash, w = 16: AL 4.79; static length 7: "
               "AL 3.99) and its evaluation details, Appendix E (at most 1,024 new tokens per "
               "request, thinking mode on); confidence AUC 0.8 and late over-confidence are a "
               "design choice",
        draft_len=15, mu=2.4826, first_bonus=0.2, decay=0.1894, request_sd=0.3, round_sd=1.2,
        token_sd=2.0, conf_noise_sd=1.9, conf_bias=0.55, overconfidence=0.1, entropy_corr=0.6,
        max_tokens=1024, eos_prob=0.001,
        targets={"acceptance_length": 4.79, "static_acceptance_length_7": 3.99, "auc": 0.80},
    ),
}


def get_profile(name: str) -> AcceptanceProfile:
    if name not in PROFILES:
        raise InputError(f"unknown profile '{name}'; valid profiles: {', '.join(sorted(PROFILES))}")
    return PROFILES[name]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def stratified(rng: np.random.Generator, n: int, block: int = STRATUM_BLOCK) -> np.ndarray:
    """``n`` uniforms; each run of ``block`` consecutive ones has one in each ``1 / block`` stratum,
    in random order (Latin hypercube sampling)."""
    m = -(-n // block) * block
    strata = np.concatenate([rng.permutation(block) for _ in range(m // block)])
    return ((strata + rng.random(m)) / block)[:n]


def _request(prof: AcceptanceProfile, rng: np.random.Generator, u: float) -> dict[str, np.ndarray]:
    """The rounds of one request with effect ``u``, cut where it ends.  Every draw is made for
    ``max_tokens`` rounds (a round emits at least one token), so the draws of later requests do
    not depend on where this one ends."""
    n, d = prof.max_tokens, prof.draft_len
    i = np.arange(d)
    z = ndtri(stratified(rng, n))[:, None]
    e = ndtri(np.stack([stratified(rng, n) for _ in range(d)], axis=1))
    noise, x = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    t = prof.mu + prof.first_bonus * (i == 0) - prof.decay * i + prof.request_sd * u \
        + prof.round_sd * z + prof.token_sd * e
    p_true = np.cumprod(sigmoid(t), axis=1)                                 # [n, D]
    conf = sigmoid(t + prof.conf_noise_sd * noise + prof.conf_bias + prof.overconfidence * i)
    r = prof.entropy_corr
    spread = np.exp(math.log(20.0) + 0.8 * (r * noise + math.sqrt(1 - r * r) * x))
    accepted = (stratified(rng, n)[:, None] < p_true).sum(axis=1)          # [n]
    n0, later = expert_counts(rng, n, d, prof.experts_per_token)
    eos, cut = rng.random(n) < prof.eos_prob, rng.random(n)

    emitted = np.cumsum(accepted + 1)
    remaining = prof.max_tokens - emitted + accepted + 1                   # budget before a round
    last = int(np.argmax(eos | (emitted >= prof.max_tokens)))
    keep = slice(0, last + 1)
    accepted, truncated = accepted[keep].copy(), np.arange(last + 1) == last
    # the last round stops early: EOS falls anywhere in its output, the limit cuts it to the budget
    accepted[last] = int(cut[last] * (accepted[last] + 1)) if eos[last] else \
        min(accepted[last], remaining[last] - 1)
    return dict(conf=conf[keep], ent=top1_entropy(conf[keep], spread[keep]), p_true=p_true[keep],
                accepted=accepted, truncated=truncated, remaining=remaining[keep],
                n0=n0[keep], later=later[keep])


def _requests(prof: AcceptanceProfile, n_rounds: int, seed: int):
    """``(request index, rounds)`` until ``n_rounds`` rounds, the last request cut to fit."""
    rng = np.random.default_rng(seed)
    start, total, request = rng.random(), 0, 0
    while total < n_rounds:
        q = _request(prof, rng, float(ndtri((start + request * GOLDEN) % 1.0)))
        q = {k: v[:n_rounds - total] for k, v in q.items()}
        total += len(q["accepted"])
        yield request, q
        request += 1


def synthesize_profile(prof: AcceptanceProfile, n_rounds: int, seed: int = 0, routing: bool = True
                       ) -> list[RoundRecord]:
    """``n_rounds`` capture-run rounds of profile ``prof`` (the module docstring).  The same seed
    gives the same rounds, and a longer run starts with the rounds of a shorter one."""
    records = []
    for request, q in _requests(prof, n_rounds, seed):
        conf, ent, p_true = (np.round(q[k], dec).tolist() for k, dec in
                             (("conf", 3), ("ent", 3), ("p_true", 4)))
        for j in range(len(q["accepted"])):
            records.append(RoundRecord(
                conf=conf[j], ent=ent[j], accepted=int(q["accepted"][j]),
                truncated=bool(q["truncated"][j]), remaining=int(q["remaining"][j]),
                request=request, p_true=p_true[j],
                n_new_l0=q["n0"][j].tolist() if routing else None,
                n_new_later=q["later"][j].tolist() if routing else None))
    return records


def acceptance_lengths(prof: AcceptanceProfile, n_rounds: int, seeds: tuple[int, ...],
                       static: int) -> np.ndarray:
    """``[AL over all rounds, AL had every untruncated round verified `static` tokens]`` of the
    profile's rounds (the definitions of :mod:`~vllm_hybridspec.policy.stats`)."""
    acc, trunc = [], []
    for seed in seeds:
        for _, q in _requests(prof, n_rounds, seed):
            acc.append(q["accepted"])
            trunc.append(q["truncated"])
    a, t = np.concatenate(acc), np.concatenate(trunc)
    return np.array([1 + a.mean(), 1 + np.minimum(a[~t], static - 1).mean()])


def solve_lengths(prof: AcceptanceProfile, acceptance_length: float, static: int,
                  static_length: float, n_rounds: int = 150_000, seeds: tuple[int, ...] = (0, 1),
                  steps: int = 3) -> AcceptanceProfile:
    """The profile with ``mu`` and ``decay`` set so that its AL is ``acceptance_length`` and its
    AL at the fixed length ``static`` is ``static_length`` (Table 3's vanilla and static-length
    rows fix how fast acceptance decays): Newton's method with finite differences on the same
    random draws (``seeds``, ``n_rounds`` rounds each)."""
    target = np.array([acceptance_length, static_length])
    x = np.array([prof.mu, prof.decay])

    def f(v: np.ndarray) -> np.ndarray:
        return acceptance_lengths(prof.model_copy(update={"mu": v[0], "decay": v[1]}), n_rounds,
                                  seeds, static)

    for _ in range(steps):
        y = f(x)
        jac = np.stack([(f(x + h) - y) / h[k] for k, h in enumerate(np.diag([0.02, 0.01]))], 1)
        x = x + np.linalg.solve(jac, target - y)
    return prof.model_copy(update={"mu": round(float(x[0]), 4), "decay": round(float(x[1]), 4)})
