"""Command line of ``vllm_hybridspec.tools.compare``: one target, several speculative configs, side by side.

Usage, outputs and full-size (dummy-weight) runs: see the docstring of vllm_hybridspec/compare.py.
"""

from __future__ import annotations

import argparse
import json

from vllm_hybridspec.tools.compare import load_prompts, run_all, summary_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--config", action="append", required=True, help="NAME=JSON or NAME=none")
    ap.add_argument("--prompts", help="JSONL with a 'prompt' field (tokenised with the target's tokenizer)")
    ap.add_argument("--random-prompts", action="store_true", help="random token-id prompts instead")
    ap.add_argument("--vocab", type=int, default=1000, help="token-id range of random prompts")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--bs1-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--hf-overrides")
    ap.add_argument("--additional-config")
    ap.add_argument("--llm-kwargs", help="more LLM(...) keyword arguments as JSON")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isolate", action="store_true", help="run each config in its own process (GPU: an "
                    "engine's memory is only certainly freed when its process ends)")
    ap.add_argument("--logprobs", action="store_true", help="record the top-2 log-probability gap of every "
                    "greedy output position (tells floating-point near-ties from real divergences)")
    ap.add_argument("--sweep-lengths", type=lambda t: [int(x) for x in t.split(",")],
                    help="also time decode steps at these verification lengths, for configs with "
                    '"hybridspec": {"fixed_length": K + 1} (and plain decoding once)')
    ap.add_argument("--sweep-batches", type=lambda t: [int(x) for x in t.split(",")], default=[1])
    ap.add_argument("--sweep-steps", type=int, default=32)
    ap.add_argument("--sweep-warmup", type=int, default=4, help="untimed steps first (the first use of a shape "
                    "may compile kernels)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not args.random_prompts and not args.prompts:
        ap.error("give --prompts FILE or --random-prompts")

    prompts = load_prompts(args)
    configs = []
    for item in args.config:
        name, _, raw = item.partition("=")
        configs.append((name, None if raw.strip() == "none" else json.loads(raw)))
    results = run_all(configs, args, prompts, args.out)
    print(summary_table(results, len(prompts)))
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f)


if __name__ == "__main__":
    main()
