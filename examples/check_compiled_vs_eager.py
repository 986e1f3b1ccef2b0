"""Greedy output of one target served compiled (vLLM's default) and eagerly (``enforce_eager``), on the
CPU or a GPU, plain or with H-Spec: a check that no layer of the plugin is traced away by torch.compile.

    VLLM_TARGET_DEVICE=cpu python examples/check_compiled_vs_eager.py --model models/hybrid \
        [--hspec models/hybrid-hspec] [--tokens 16]

Prints both token lists and exits 1 when they differ (a float tie can also make them differ: look
at where)."""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--hspec", help="an H-Spec drafter checkpoint (K = 7); plain decoding without it")
    ap.add_argument("--prompts", default="models/prompts/heldout.jsonl", help="JSONL; its first prompt is used")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    import gc

    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        prompt = json.loads(f.readline())["prompt"]
    spec = None if args.hspec is None else {"method": "hspec", "model": args.hspec, "num_speculative_tokens": 7}
    outputs = {}
    for mode in ("eager", "compiled"):
        llm = LLM(model=args.model, dtype="float32", enforce_eager=mode == "eager", max_model_len=512, max_num_seqs=1,
                  seed=0, speculative_config=spec, mamba_ssm_cache_dtype="float32")  # GDN state fp32; unused by dense models
        out = llm.generate([prompt], SamplingParams(max_tokens=args.tokens, temperature=0))
        outputs[mode] = list(out[0].outputs[0].token_ids)
        del llm
        gc.collect()
    for mode, tokens in outputs.items():
        print(f"{mode:9s} {tokens}")
    same = outputs["eager"] == outputs["compiled"]
    print("compiled == eager" if same else "compiled != eager")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
