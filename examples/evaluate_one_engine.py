"""Command line of ``vllm_hybridspec.tools.evaluate``: costs, a fitted policy and decode speed / greedy output
with drafting off, every draft verified and selected lengths, all on one engine start.

    # the Qwen3.6-35B-A3B shape, dummy weights, the dummy H-Spec drafter (examples/gpu_session.sh eval-35b
    # runs the same with the replay proposer and a plain engine's continuations as prompts and --reference)
    python examples/evaluate_one_engine.py --target /tmp/full-shape/target --random-prompts --vocab 248000 \\
        --speculative-config '{"method": "hspec", "model": "/tmp/full-shape/hspec", "num_speculative_tokens": 7,
                               "hybridspec": {"gdn_kernel": true}}' \\
        --engine-args '{"load_format": "dummy", "max_model_len": 2048, "mamba_ssm_cache_dtype": "float32",
                        "additional_config": {"gdn_prefill_backend": "triton"}}' \\
        --records models/hybrid-hspec/records.jsonl.gz --lengths 1,2,3,4,6,8 --batch-sizes 1,4 \\
        --out-dir out/evaluate-35b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_hybridspec.tools.compare import load_prompts
from vllm_hybridspec.tools.evaluate import MODES, evaluate, summary_markdown


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--speculative-config", required=True, help="JSON, as for vllm serve")
    ap.add_argument("--engine-args", default="{}", help="more vllm.LLM keyword arguments as JSON")
    ap.add_argument("--prompts", help="JSONL with a 'prompt' field (tokenised with the target's tokenizer)")
    ap.add_argument("--random-prompts", action="store_true", help="random token-id prompts instead")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--records", help="round records to fit the policy to (hybridspec calibrate capture)")
    ap.add_argument("--policy", help="a policy file to use as it is (instead of --records)")
    ap.add_argument("--lengths", type=ints, help="verification lengths to time (the cost file)")
    ap.add_argument("--batch-sizes", type=ints, default=[1])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-length", type=int, default=1, help="shortest length the policy may pick (1 or 2)")
    ap.add_argument("--reference", help="continuations of a plain engine (hybridspec replay-record) to compare "
                    "every mode's greedy output with")
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args()
    if not args.random_prompts and not args.prompts:
        ap.error("give --prompts FILE or --random-prompts")
    if args.records and args.policy:
        ap.error("give --records (fit a policy) or --policy (use one), not both")
    try:
        spec, engine_args = json.loads(args.speculative_config), json.loads(args.engine_args)
    except json.JSONDecodeError as e:
        ap.error(f"--speculative-config / --engine-args must be JSON: {e}")
    try:
        result = evaluate(args.target, spec, engine_args, load_prompts(args), args.out_dir, records=args.records,
                          policy=args.policy, lengths=args.lengths, batch_sizes=args.batch_sizes,
                          modes=[m for m in args.modes.split(",") if m], steps=args.steps, warmup=args.warmup,
                          max_tokens=args.max_tokens, min_length=args.min_length, reference=args.reference,
                          progress=lambda line: print(line, flush=True))
    except ValueError as e:  # bad settings, prompts, records or policy (InputError is a ValueError)
        ap.exit(2, f"error: {e}\n")
    table = summary_markdown(result)
    (args.out_dir / "summary.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
