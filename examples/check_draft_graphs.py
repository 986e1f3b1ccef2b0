"""GPU check of the drafter's CUDA graphs (``vllm_hybridspec/draft_graphs.py``) without an engine: a
tiny random H-Spec drafter reading random paged caches (the test fixture of
``tests/plugin/test_draft_round.py``), eager rounds against captured and replayed padded rounds.

    python examples/check_draft_graphs.py --out /tmp/draft_graphs.json

Prints and writes one JSON: per batch size, whether the replayed drafts equal the eager ones (tokens,
largest probability difference), and the median wall time of a round each way (host-bound at this
size: the difference is the host time the graphs save). On a machine without CUDA it runs the padded
rounds without capture (``--no-capture`` is then implied), which checks only the padding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,3,8")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--no-capture", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from tests.plugin.test_draft_round import K, build
    from vllm_hybridspec.engine.drafting.graphs import DraftGraphs

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    m = build(dtype, 2048, 16, "FLASH_ATTN", seed=3, num_blocks=96).to(device)
    for reader in m.kv_readers:
        reader.kv_cache = reader.kv_cache.to(device)
    m.upcast_ssm_parameters()
    graphs = DraftGraphs(m, batch_sizes=(1, 2, 4, 8, 16), capture=cuda and not args.no_capture)
    gen = torch.Generator().manual_seed(7)
    n_sel = len(m.config.aux_hidden_state_layer_ids)
    hidden = m.config.transformer_layer_config.hidden_size

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        times = []
        for _ in range(args.rounds):
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return out, statistics.median(times)

    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": args.dtype,
               "capture": graphs.capture, "batches": {}}
    for N in (int(b) for b in args.batches.split(",")):
        prefix_lens = torch.randint(1, 90, (N,), generator=gen, dtype=torch.int32).to(device)
        block_table = torch.stack([torch.randperm(96, generator=gen)[:8] for _ in range(N)]).to(torch.int32).to(device)
        last_hidden = torch.randn(N, n_sel * hidden, generator=gen).to(dtype).to(device)
        anchors = torch.randint(0, 95, (N,), generator=gen).to(device)
        capacity = int(prefix_lens.max()) + 2
        with torch.inference_mode():
            def eager():
                kv = m.gather_prefix_kv(block_table, capacity)
                return m.draft(last_hidden, anchors, kv, prefix_lens, K)

            def replay():
                return graphs.run(last_hidden, anchors, block_table, prefix_lens, capacity, K)

            ref, eager_ms = timed(eager)
            first = replay()  # the first round of a shape: eager padded round + capture
            got, graph_ms = timed(replay)
        results["batches"][N] = {
            "tokens_equal": bool(torch.equal(got.tokens, ref.tokens)),
            "first_round_tokens_equal": bool(torch.equal(first.tokens, ref.tokens)),
            "max_top1_prob_diff": float((got.top1_prob - ref.top1_prob).abs().max()),
            "max_entropy_diff": float((got.entropy - ref.entropy).abs().max()),
            "eager_round_ms": round(eager_ms, 3), "graph_round_ms": round(graph_ms, 3),
        }
    results["captures"], results["replays"] = graphs.captures, graphs.replays
    results["eager_keys"] = [list(k) for k in graphs.eager_keys]
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
