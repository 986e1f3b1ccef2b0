"""Replay capture-run rounds under different verification-length policies (``hybridspec simulate``).

A capture round verified all D draft tokens, so a length ``w`` would have accepted
``min(A_D, w - 1)`` of them and emitted one more token (HybridSpec paper, "Analysis of the
Throughput Objective").  Rounds cut by EOS or the output limit are left out, as in calibration, and
every policy's length is capped at the round's ``w_rem`` when the record logs ``remaining``.

Modelled round time, in the policy file's unit (ms)::

    T = fixed + C_tgt(w) + s (u - w) + eta sum_{j < w} (n_all_j - nbar_all(j))

The curve charges every verified draft token ``d_j`` the calibration-average expert cost; the last
term corrects it with the round's actual new (layer, expert) pairs ``n_all_j = n0_j + n_later_j``
(``n_later_j`` from the record, or its table mean given ``n0_j`` where the record has none), and is
zero when the policy or the records have no routing data.  ``u`` is the Stage-0 length: ``u = w``
except for the routing correction, whose Stage 0 runs ``min(w0 + 1, w_rem)`` tokens.

Policies: verify-all (``w = W``); the best static length (picked with hindsight on these rounds);
the per-round ratio rule of EVICT, ``argmax_{2..W} G(w) / (C_tgt(w) + fixed)`` with ``p_i`` the
product of raw confidences as EVICT forms them, and the same rule with HybridSpec's calibrated
``p_i`` (which isolates the objective); D-Cut, the raw-confidence ratio rule over its lengths
``{W/4, W/2, 3W/4, W}`` (``{4, 8, 12, 16}`` at W = 16); HybridSpec nominal-only (``w = w0``, the
paper's ablation) and with the routing correction.  When every record carries ``p_true``, the
oracle is the same selector fed the true probabilities, with its own Dinkelbach rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from .acceptance import acceptance_model
from .calibrate import capture_rate
from .errors import InputError
from .policy_file import Policy
from .records import Rounds
from .selector import (expected_tokens, routing_correction, select_length, select_shared_length,
                       stage0_length)


@dataclass
class Outcome:
    name: str
    throughput: float          # emitted tokens per second of modelled time
    mean_length: float         # mean executed verification length w
    acceptance_length: float   # emitted tokens per round (AL)
    rounds: int
    detail: str = ""
    lengths: torch.Tensor | None = field(default=None, repr=False)  # [N] executed w

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("lengths")
        return d


@dataclass
class Report:
    outcomes: list[Outcome]
    rounds: int
    truncated_excluded: int
    notes: list[str]

    def get(self, name: str) -> Outcome:
        return next(o for o in self.outcomes if o.name == name)

    def as_dict(self) -> dict:
        out = {"rounds": self.rounds, "truncated_excluded": self.truncated_excluded,
               "time_unit": "ms", "throughput_unit": "tokens/s",
               "policies": [o.as_dict() for o in self.outcomes], "notes": self.notes}
        names = {o.name for o in self.outcomes}
        out["oracle_ratio"] = {
            k: self.get(k).throughput / self.get(o).throughput
            for k, o in (("hybridspec", "oracle"), ("hybridspec+routing", "oracle+routing"))
            if k in names and o in names}
        return out


def emitted_tokens(accepted: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Tokens a nonterminal round emits at length ``w``: ``min(A_D, w - 1) + 1``.  [N] -> [N]."""
    return torch.minimum(accepted, w - 1) + 1


def round_time(w: torch.Tensor, u: torch.Tensor, cost: torch.Tensor, fixed: float, s: float,
               eta: float, deviation: torch.Tensor | None) -> torch.Tensor:
    """Modelled time of each round (module docstring).  w, u: [N]; cost: [W + 2] indexed by w;
    deviation: [N, W] with column ``w - 1`` = ``sum_{j < w} (n_all_j - nbar_all(j))``, or None."""
    t = fixed + cost[w] + s * (u - w).to(cost.dtype)
    if deviation is not None:
        t = t + eta * deviation.gather(1, (w - 1)[:, None])[:, 0]
    return t


def expert_deviation(rounds: Rounds, policy: Policy) -> torch.Tensor | None:
    """``[N, W]`` cumulative deviation of the rounds' expert counts from the table means, or None
    when the policy or some round lacks Layer-0 counts."""
    r = policy.routing
    if r is None or not (rounds.n_new_l0 >= 0).all():
        return None
    d = rounds.draft_len
    j = torch.arange(1, d + 1)
    n0 = rounds.n_new_l0.clamp(max=r.n_all_given.shape[1] - 1)               # [N, D]
    table_later = r.n_all_given[j, n0] - n0                                   # [N, D]
    later = torch.where(rounds.n_new_later >= 0, rounds.n_new_later.to(table_later.dtype),
                        table_later)
    dev = n0 + later - r.n_all[j]                                             # [N, D]
    return torch.cumsum(torch.nn.functional.pad(dev, (1, 0)), dim=1)        # [N, W]


def ratio_lengths(p: torch.Tensor, cost: torch.Tensor, fixed: float, candidates: torch.Tensor
                  ) -> torch.Tensor:
    """Per-round ``argmax_{w in candidates} G(w) / (C_tgt(w) + fixed)``, ties to the shorter."""
    ratio = expected_tokens(p)[:, candidates - 1] / (cost[candidates] + fixed)  # [N, K]
    return candidates[ratio.argmax(dim=1)]


def dcut_lengths(w_max: int) -> list[int]:
    """D-Cut's four fractions of the full target input: {4, 8, 12, 16} at W = 16."""
    return sorted({w for w in (round(f * w_max) for f in (0.25, 0.5, 0.75, 1.0)) if 2 <= w})


def simulate(rounds: Rounds, policy: Policy) -> Report:
    """Replay the untruncated rounds under every policy; see the module docstring."""
    policy = policy.to("cpu", torch.float64)
    if rounds.draft_len != policy.draft_len:
        raise InputError(f"the records have D = {rounds.draft_len} draft tokens per round but the "
                         f"policy was fitted for draft_len = {policy.draft_len}")
    total = len(rounds)
    rounds = rounds.select(~rounds.truncated)
    if len(rounds) == 0:
        raise InputError("every round is truncated (EOS or output limit); nothing to replay")
    notes: list[str] = []
    d, w_max = rounds.draft_len, rounds.draft_len + 1
    w_rem = rounds.length_limit()
    a = rounds.accepted
    cost, fixed = policy.cost, policy.fixed
    r = policy.routing
    s, eta = (r.s, r.eta) if r else (0.0, 0.0)
    dev = expert_deviation(rounds, policy)
    if r is not None and dev is None:
        notes.append("some rounds lack 'n_new_l0': expert-count deviations and the routing "
                     "correction are not simulated")

    def outcome(name: str, w: torch.Tensor, u: torch.Tensor | None = None, detail: str = ""):
        w = torch.minimum(w, w_rem)
        u = w if u is None else u
        tokens = emitted_tokens(a, w)
        time = round_time(w, u, cost, fixed, s, eta, dev)
        return Outcome(name, 1000.0 * float(tokens.sum() / time.sum()), float(w.double().mean()),
                       float(tokens.double().mean()), len(w), detail, w)

    full = torch.full_like(a, w_max)
    _, p = acceptance_model(rounds.conf, rounds.ent, policy.acceptance)      # [N, D]
    p_raw = torch.cumprod(rounds.conf, dim=1)                                # [N, D]
    lengths = torch.arange(2, w_max + 1)
    jobs = ["verify-all", "best static", "EVICT ratio", "ratio, calibrated", "D-Cut",
            "hybridspec", "hybridspec+routing"]
    if not torch.isnan(rounds.p_true).any():
        jobs += ["oracle", "oracle+routing"]
    outcomes: list[Outcome] = []
    for job in tqdm(jobs, desc="simulating", unit=" policies", disable=None, leave=False):
        if job == "verify-all":
            outcomes.append(outcome(job, full, detail=f"w = {w_max}"))
        elif job == "best static":
            best = max((outcome(job, torch.full_like(a, w), detail=f"w = {w}") for w in lengths),
                       key=lambda o: o.throughput)
            outcomes.append(best)
        elif job == "EVICT ratio":
            outcomes.append(outcome(job, ratio_lengths(p_raw, cost, fixed, lengths),
                                    detail="G/L, raw confidences"))
        elif job == "ratio, calibrated":
            outcomes.append(outcome(job, ratio_lengths(p, cost, fixed, lengths),
                                    detail="G/L, calibrated p"))
        elif job == "D-Cut":
            cand = dcut_lengths(w_max)
            outcomes.append(outcome(job, ratio_lengths(p_raw, cost, fixed, torch.tensor(cand)),
                                    detail=f"G/L over {cand}, raw confidences"))
        else:
            oracle = job.startswith("oracle")
            probs = rounds.p_true if oracle else p
            rate = capture_rate(probs, cost[1:w_max + 1].tolist(), fixed, policy.min_length) \
                if oracle else policy.rate
            w0 = select_length(probs, cost, rate, policy.min_length)
            if not job.endswith("+routing"):
                outcomes.append(outcome(job, w0, detail=f"rho = {rate:.5f} tokens/ms"))
            elif dev is not None:
                u = stage0_length(w0, w_rem)
                n_new = rounds.n_new_l0.gather(1, (w0.clamp(max=d) - 1)[:, None])[:, 0]
                w = routing_correction(probs, w0, u, n_new, w_rem, cost, rate, s, eta, r.n_all,
                                       r.n_all_given)
                expanded = float((w > torch.minimum(w0, w_rem)).double().mean())
                outcomes.append(outcome(job, w, u, detail=f"expanded {100 * expanded:.1f}% of "
                                                          f"rounds"))
    if r is None:
        notes.append("the policy has no routing section: no routing-correction rows")
    return Report(outcomes, len(rounds), total - len(rounds), notes)


def simulate_batched(rounds: Rounds, policy: Policy, batch: int) -> Report:
    """Consecutive groups of ``batch`` untruncated rounds share one length per round ("Batched
    decoding"); modelled time ``fixed_B + C_B(w)`` per batched round, tokens summed over requests."""
    policy = policy.to("cpu", torch.float64)
    if batch not in policy.batched:
        raise InputError(f"the policy has no batched costs for B = {batch} (it has "
                         f"{sorted(policy.batched) or 'none'}); add them to the cost file and refit")
    c = policy.batched[batch]
    total = len(rounds)
    rounds = rounds.select(~rounds.truncated)
    groups = len(rounds) // batch
    if groups == 0:
        raise InputError(f"fewer than {batch} untruncated rounds; cannot form one batch")
    n = groups * batch
    a = rounds.accepted[:n].view(groups, batch)
    w_rem = rounds.length_limit()[:n].view(groups, batch)
    _, p = acceptance_model(rounds.conf[:n], rounds.ent[:n], policy.acceptance)
    p = p.view(groups, batch, -1)

    def outcome(name: str, w: torch.Tensor, detail: str = "") -> Outcome:   # w: [groups]
        per_req = torch.minimum(w[:, None], w_rem)
        tokens = emitted_tokens(a, per_req).sum(dim=1)
        time = c.fixed + c.cost[w]
        return Outcome(name, 1000.0 * float(tokens.sum() / time.sum()), float(w.double().mean()),
                       float(tokens.double().mean() / batch), groups, detail, w)

    cand = c.candidates
    shared = torch.stack([select_shared_length(p[g], cand, c.cost, c.rate, w_rem[g])
                          for g in tqdm(range(groups), desc="batched selection", disable=None,
                                        leave=False)])
    full = torch.full((groups,), int(cand[-1]))
    best = max((outcome(f"B={batch} best static", torch.full((groups,), int(w)), f"w = {int(w)}")
                for w in cand), key=lambda o: o.throughput)
    outs = [outcome(f"B={batch} longest candidate", full, f"w = {int(cand[-1])}"), best,
            outcome(f"B={batch} shared length", shared, f"rho_B = {c.rate:.5f} tokens/ms")]
    return Report(outs, groups, total - len(rounds),
                  [f"{groups} batches of {batch} consecutive rounds; AL is per request"])


def format_report(report: Report) -> str:
    base = report.outcomes[0].throughput
    lines = [f"{report.rounds} rounds replayed ({report.truncated_excluded} truncated rounds "
             f"excluded); modelled time in ms; 'vs first' is the speedup over the first row",
             f"{'policy':<24}{'tokens/s':>10}{'vs first':>10}{'mean w':>8}{'AL':>7}  detail"]
    for o in report.outcomes:
        lines.append(f"{o.name:<24}{o.throughput:>10.1f}{o.throughput / base:>9.3f}x"
                     f"{o.mean_length:>8.2f}{o.acceptance_length:>7.2f}  {o.detail}")
    for k, v in report.as_dict()["oracle_ratio"].items():
        lines.append(f"{k} / its oracle: {v:.4f}")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def plot_report(report: Report, path: str) -> None:
    """Throughput per policy and the distribution of executed lengths, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [o.name for o in report.outcomes]
    values = [o.throughput for o in report.outcomes]
    ax0.barh(names, values, color="tab:blue")
    ax0.set_xlim(0.95 * min(values), 1.01 * max(values))  # the differences are a few percent
    ax0.invert_yaxis()
    ax0.set_xlabel("pooled throughput (tokens/s, modelled)")
    for o in report.outcomes:
        if o.lengths is not None and o.name in ("EVICT ratio", "D-Cut", "hybridspec",
                                                 "hybridspec+routing"):
            ax1.hist(o.lengths.numpy(), bins=range(1, int(o.lengths.max()) + 2), histtype="step",
                     label=o.name, align="left", linewidth=1.5)
    ax1.set_xlabel("verification length w")
    ax1.set_ylabel("rounds")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
