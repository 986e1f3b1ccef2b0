"""Time one round of verification-length selection for a batch: acceptance model + Eq. 5 selector
(+ optionally the Layer-0 expert count and the routing correction of Eq. 6).

Default shape: B = 256 requests, D = 15 draft tokens, top-8 of 256 Layer-0 experts.  On a GPU the
round is captured as one CUDA graph and timed by CUDA events around ``--replays`` graph replays,
``--samples`` times; the median per round is printed (eager launches are timed too).  On the CPU
the same round is timed with ``time.perf_counter``, and the output says so.

    python examples/bench_policy.py                       # fits a policy on synthetic records
    python examples/bench_policy.py --policy policy.json --routing [--compile]

Fitting needs scikit-learn; evaluating a policy file needs only torch, numpy, pydantic and tqdm.
Where scikit-learn is missing (the GPU machine), fit on the CPU machine first and pass the file:

    hybridspec calibrate synth --out /tmp/r.jsonl --costs-out /tmp/c.json
    hybridspec calibrate fit --records /tmp/r.jsonl --costs /tmp/c.json --out examples/policy_synth.json
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from vllm_hybridspec.policy import Policy, Rounds, new_experts_at
from vllm_hybridspec.policy.synthetic import synthesize


def make_policy(args) -> Policy:
    if args.policy:
        return Policy.load(args.policy, args.device, torch.float32)
    try:
        import sklearn  # noqa: F401  (fitting needs it; evaluating a policy file does not)
    except ImportError:
        sys.exit("scikit-learn is not installed here: pass --policy with a file written by "
                 "`hybridspec calibrate fit` on another machine")
    from vllm_hybridspec.policy import fit_policy
    from vllm_hybridspec.policy.cost import CostFile
    from vllm_hybridspec.policy.synthetic import synthetic_costs

    rounds = Rounds.from_records(synthesize(args.fit_rounds, args.draft_len, seed=0))
    params, _ = fit_policy(rounds, CostFile.model_validate(synthetic_costs(args.draft_len)))
    return Policy.from_params(params).to(args.device, torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--draft-len", type=int, default=15)
    ap.add_argument("--policy", help="policy file (default: fit one on synthetic records)")
    ap.add_argument("--fit-rounds", type=int, default=20000)
    ap.add_argument("--routing", action="store_true",
                    help="also count new Layer-0 experts and apply the routing correction")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the round (fuses its small kernels) before timing")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    policy = make_policy(args)
    if policy.draft_len != args.draft_len:
        sys.exit(f"the policy has draft_len {policy.draft_len}, not --draft-len {args.draft_len}")
    b, d, dev = args.batch, args.draft_len, torch.device(args.device)
    rounds = Rounds.from_records(synthesize(b, d, seed=1))    # drafter signals of B requests
    conf, ent = rounds.conf.float().to(dev), rounds.ent.float().to(dev)          # [B, D]
    g = torch.Generator(device="cpu").manual_seed(0)
    expert_ids = torch.rand(b, d + 1, args.experts, generator=g).argsort(dim=-1)[..., :args.topk]
    expert_ids = expert_ids.to(dev)                                  # [B, W, topk], distinct per token
    w_rem = torch.full((b,), d + 1, dtype=torch.int64, device=dev)

    def one_round() -> torch.Tensor:
        p, w0, u = policy.draft_side(conf, ent, w_rem)
        if not args.routing:
            return torch.minimum(w0, w_rem)
        return policy.correct(p, w0, u, new_experts_at(expert_ids, w0), w_rem)

    if args.compile:
        one_round = torch.compile(one_round, fullgraph=True, dynamic=False)
    what = "acceptance model + selector" + (" + routing correction" if args.routing else "")
    what += " (torch.compile)" if args.compile else ""
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    if dev.type == "cuda":
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
        assert torch.equal(out, one_round()), "graph replay disagrees with eager execution"

        def median_us(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(5):
                fn()
            times = []
            for _ in range(args.samples):
                torch.cuda.synchronize()
                start.record()
                for _ in range(args.replays):
                    fn()
                end.record()
                end.synchronize()
                times.append(1000.0 * start.elapsed_time(end) / args.replays)
            return statistics.median(times)

        graph_us, eager_us = median_us(graph.replay), median_us(one_round)
        print(f"{torch.cuda.get_device_name(dev)}: B = {b}, D = {d}, {what}")
        print(f"  CUDA graph replay: median {graph_us:.1f} us per round "
              f"({args.samples} samples of {args.replays} replays)")
        print(f"  eager launches:    median {eager_us:.1f} us per round")
    else:
        for _ in range(5):
            one_round()
        times = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            for _ in range(args.replays):
                one_round()
            times.append(1e6 * (time.perf_counter() - t0) / args.replays)
        print(f"CPU ({torch.get_num_threads()} threads), not the GPU figure: B = {b}, D = {d}, {what}")
        print(f"  median {statistics.median(times):.1f} us per round "
              f"({args.samples} samples of {args.replays} calls)")
    w = one_round()
    print(f"  lengths chosen: mean {w.double().mean().item():.2f}, "
          f"min {w.min().item()}, max {w.max().item()}")
    print(f"command: {command}")


if __name__ == "__main__":
    main()
