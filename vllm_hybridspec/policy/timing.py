"""``hybridspec calibrate time-selector``: the time of one round of verification-length selection for a
batch: the acceptance model and the Eq. 5 selector, optionally with the Layer-0 expert count and the
routing correction of Eq. 6 (HybridSpec paper, §4).

Default shape: B = 256 requests, D = 15 draft tokens, top-8 of 256 Layer-0 experts. On a GPU the
round is captured as one CUDA graph and timed by CUDA events around ``--replays`` graph replays,
``--samples`` times (eager launches are timed too); on the CPU it is timed with
``time.perf_counter``, and the output says so::

    hybridspec calibrate time-selector                          # fits a policy on synthetic records
    hybridspec calibrate time-selector --policy policy.json --routing --compile

Fitting needs scikit-learn; evaluating a policy file needs only torch. Where scikit-learn is missing,
fit on another machine (``hybridspec calibrate synth`` and ``calibrate fit``) and pass the file.
"""

from __future__ import annotations

import re

import statistics
import time
from pathlib import Path

import torch
import typer

from vllm_hybridspec.policy.errors import InputError
from vllm_hybridspec.policy.policy_file import Policy
from vllm_hybridspec.policy.records import Rounds
from vllm_hybridspec.policy.selector import new_experts_at
from vllm_hybridspec.policy.synthetic import synthesize


def synthetic_policy(draft_len: int, fit_rounds: int, device: str) -> Policy:
    """A policy fitted to synthetic records and costs (``policy/synthetic.py``)."""
    try:
        import sklearn  # noqa: F401  (fitting needs it; evaluating a policy file does not)
    except ImportError:
        raise InputError("scikit-learn is not installed here: pass --policy with a file written by "
                         "`hybridspec calibrate fit` on another machine") from None
    from vllm_hybridspec.policy.calibrate import fit_policy
    from vllm_hybridspec.policy.cost import CostFile
    from vllm_hybridspec.policy.synthetic import synthetic_costs

    rounds = Rounds.from_records(synthesize(fit_rounds, draft_len, seed=0))
    params, _ = fit_policy(rounds, CostFile.model_validate(synthetic_costs(draft_len)))
    return Policy.from_params(params).to(device, torch.float32)


def selection_round(policy: Policy, batch: int, experts: int, topk: int, routing: bool, device: torch.device):
    """A function that runs one selection round for ``batch`` requests with synthetic drafter signals
    (and distinct random top-k Layer-0 experts per token when ``routing``); it returns the lengths."""
    d = policy.draft_len
    rounds = Rounds.from_records(synthesize(batch, d, seed=1))
    conf, ent = rounds.conf.float().to(device), rounds.ent.float().to(device)  # [B, D]
    g = torch.Generator(device="cpu").manual_seed(0)
    expert_ids = torch.rand(batch, d + 1, experts, generator=g).argsort(dim=-1)[..., :topk].to(device)
    w_rem = torch.full((batch,), d + 1, dtype=torch.int64, device=device)

    def one_round() -> torch.Tensor:
        p, w0, u = policy.draft_side(conf, ent, w_rem)
        if not routing:
            return torch.minimum(w0, w_rem)
        return policy.correct(p, w0, u, new_experts_at(expert_ids, w0), w_rem)

    return one_round


def cuda_median_us(fn, samples: int, replays: int) -> float:
    """Median microseconds per call of ``fn`` over ``samples`` samples of ``replays`` calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        fn()
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            fn()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / replays)
    return statistics.median(times)


def time_on_cuda(one_round, samples: int, replays: int) -> tuple[float, float]:
    """(graph replay, eager) median microseconds per round; the replayed lengths must equal eager ones."""
    torch.backends.cuda.matmul.allow_tf32 = False
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            one_round()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one_round()
    graph.replay()
    torch.cuda.synchronize()
    if not torch.equal(out, one_round()):
        raise RuntimeError("the CUDA graph replay of the selection round disagrees with eager execution")
    return cuda_median_us(graph.replay, samples, replays), cuda_median_us(one_round, samples, replays)


def time_on_cpu(one_round, samples: int, replays: int) -> float:
    """Median microseconds per round (``time.perf_counter``)."""
    for _ in range(5):
        one_round()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(replays):
            one_round()
        times.append(1e6 * (time.perf_counter() - t0) / replays)
    return statistics.median(times)


def time_selector(
    batch: int = typer.Option(256, min=1, help="requests selected for in one round"),
    draft_len: int | None = typer.Option(None, min=1, help="draft tokens per request (default: the "
                                                           "policy's draft_len, or 15 for the fitted one)"),
    policy: Path = typer.Option(None, help="policy file (default: fit one on synthetic records)"),
    fit_rounds: int = typer.Option(20000, min=100, help="synthetic rounds to fit the default policy to"),
    routing: bool = typer.Option(False, help="also count new Layer-0 experts and apply the routing correction"),
    compile: bool = typer.Option(False, help="torch.compile the round (fuses its small kernels) before timing"),
    experts: int = typer.Option(256, min=1, help="Layer-0 experts"),
    topk: int = typer.Option(8, min=1, help="experts per token"),
    samples: int = typer.Option(50, min=1),
    replays: int = typer.Option(20, min=1),
    device: str = typer.Option("cuda" if torch.cuda.is_available() else "cpu"),
) -> None:
    """Time one round of length selection (acceptance model + selector [+ routing correction])."""
    if topk > experts:
        raise typer.BadParameter(f"--topk {topk} exceeds --experts {experts}")
    count = torch.cuda.device_count()
    cuda = re.fullmatch(r"cuda(:(\d+))?", device)
    if device != "cpu" and not (cuda and int(cuda.group(2) or 0) < count):
        raise typer.BadParameter(f"--device {device!r} is not a device here ({count} CUDA devices); use cpu"
                                 + (" or cuda[:N]" if count else ""))
    try:
        pol = (Policy.load(str(policy), device, torch.float32) if policy
               else synthetic_policy(draft_len or 15, fit_rounds, device))
    except (InputError, ValueError) as e:
        typer.echo(f"hybridspec calibrate time-selector: error: {e}", err=True)
        raise typer.Exit(2) from None
    if draft_len is not None and pol.draft_len != draft_len:
        typer.echo(f"hybridspec calibrate time-selector: error: {policy} has draft_len {pol.draft_len}, not "
                   f"--draft-len {draft_len}; leave --draft-len out to use the policy's", err=True)
        raise typer.Exit(2)
    draft_len = pol.draft_len
    dev = torch.device(device)
    one_round = selection_round(pol, batch, experts, topk, routing, dev)
    if compile:
        one_round = torch.compile(one_round, fullgraph=True, dynamic=False)
    what = "acceptance model + selector" + (" + routing correction" if routing else "")
    what += " (torch.compile)" if compile else ""
    if dev.type == "cuda":
        graph_us, eager_us = time_on_cuda(one_round, samples, replays)
        typer.echo(f"{torch.cuda.get_device_name(dev)}: B = {batch}, D = {draft_len}, {what}")
        typer.echo(f"  CUDA graph replay: median {graph_us:.1f} us per round ({samples} samples of {replays} replays)")
        typer.echo(f"  eager launches:    median {eager_us:.1f} us per round")
    else:
        us = time_on_cpu(one_round, samples, replays)
        typer.echo(f"CPU ({torch.get_num_threads()} threads), not the GPU figure: B = {batch}, D = {draft_len}, {what}")
        typer.echo(f"  median {us:.1f} us per round ({samples} samples of {replays} calls)")
    w = one_round()
    typer.echo(f"  lengths chosen: mean {w.double().mean().item():.2f}, min {w.min().item()}, max {w.max().item()}")
