"""A focused launch-configuration sweep of our GDN round at the 35B shape (GPU only, no vLLM needed).

Where ``bench_gdn_kernels.py`` misses the issue's targets (batch 4: w = 2 against vLLM, w = 16 for 4x
and the floor), time each candidate configuration of the commit, the chunkwise verify and the
recurrent verify alone, all 30 layers in one CUDA graph, median of ``--samples`` samples of 10 replays.
Writes one JSON line per measurement to ``--out`` and prints the fastest per (part, w, B).

    python examples/tune_gdn_round.py --out tune.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_gdn_kernels import Ours, Round, graph_of, log, median_time_ms  # noqa: E402

COMMIT = [dict(BV=bv, BK=bk, num_warps=nw, precision=p) for bv, bk, nw, p in (
    (32, 64, 2, "ieee"), (64, 128, 4, "ieee"), (64, 128, 8, "ieee"), (128, 128, 8, "ieee"), (32, 128, 4, "ieee"),
    (16, 128, 2, "ieee"), (32, 64, 2, "tf32"), (64, 64, 4, "tf32"), (64, 32, 2, "ieee"), (128, 64, 4, "ieee"))]
CHUNK = [dict(method="chunk", BV=bv, BK=bk, num_warps=nw) for bv, bk, nw in (
    (64, 128, 4), (128, 128, 8), (128, 64, 8), (128, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8), (32, 64, 2),
    (32, 128, 2), (16, 128, 2), (16, 128, 1), (16, 64, 1))] + [
    dict(method="chunk", BV=bv, BK=128, num_warps=nw, series_from=9) for bv, nw in ((64, 4), (32, 2), (16, 1))]
RECURRENT = [dict(method="recurrent", BV=bv, num_warps=nw) for bv, nw in (
    (8, 1), (4, 1), (16, 1), (8, 2), (32, 8), (128, 4), (2, 1), (16, 2), (32, 4))]
CASES = {"commit": [(2, 4), (16, 4), (2, 1)], "chunk": [(16, 4), (3, 4), (16, 1), (2, 4)],
         "recurrent": [(2, 4), (3, 4), (2, 1)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--samples", type=int, default=15)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    best = {}
    with args.out.open("w") as f:
        for part, configs in (("commit", COMMIT), ("chunk", CHUNK), ("recurrent", RECURRENT)):
            for (w, B) in CASES[part]:
                r = Round(B, w)
                for cfg in configs:
                    try:
                        if part == "commit":
                            o = Ours(r, w, {}, cfg)
                            o.round()
                            fn = o.commit
                        else:
                            o = Ours(r, w, cfg, {})
                            o.verify()
                            fn = o.verify
                        ms = median_time_ms(graph_of(fn), args.samples)[0]
                    except Exception as e:  # noqa: BLE001 - a configuration that does not compile
                        log(f"{part} w={w} B={B} {cfg}: failed {type(e).__name__}: {str(e)[:150]}")
                        continue
                    f.write(json.dumps(dict(part=part, w=w, B=B, cfg=cfg, ms=ms)) + "\n")
                    f.flush()
                    log(f"{part} w={w} B={B} {cfg}: {ms:.4f} ms")
                    key = (part, w, B)
                    if key not in best or ms < best[key][1]:
                        best[key] = (cfg, ms)
                    del o
                torch.cuda.empty_cache()
    for (part, w, B), (cfg, ms) in best.items():
        log(f"best {part} w={w} B={B}: {cfg} {ms:.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
