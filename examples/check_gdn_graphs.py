"""The one-slot GDN layers' verification replayed from CUDA graphs against the same engine without them
(GPU check; ``vllm_hybridspec/gdn_graphs.py``).

One in-process engine with the one-slot layer and a fixed verification length; then, with the
layers' graphs on and off (switched between runs): greedy outputs of the prompts (must be equal), the
graphs' captures and replays, and decode-step times at each batch size.

    python examples/check_gdn_graphs.py --target models/hybrid --prompts models/prompts/heldout.jsonl \\
        --speculative-config '{"method": "hspec", "model": "models/hybrid-hspec", "num_speculative_tokens": 7,
                               "hybridspec": {"fixed_length": 8, "gdn_cudagraphs": true}}' \\
        --engine-args '{"mamba_ssm_cache_dtype": "float32", "additional_config": {"gdn_prefill_backend": "triton"}}' \\
        --out gdn_graphs.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", help="JSONL prompts (texts, or token-id lists)")
    ap.add_argument("--random-prompts", action="store_true")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative-config", required=True)
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_hybridspec.tools.compare import load_prompts
    from vllm_hybridspec.engine.gdn.layer import one_slot_layers
    from vllm_hybridspec.tools.costs import time_decode_steps
    from vllm_hybridspec.engine.compat import in_process_drafter, kv_capacity_tokens

    prompts = load_prompts(args)
    spec = json.loads(args.speculative_config)
    t0 = time.perf_counter()
    llm = LLM(model=args.target, skip_tokenizer_init=True, seed=0, async_scheduling=False,
              speculative_config=spec, disable_log_stats=False, **json.loads(args.engine_args))
    result = {"engine_start_s": round(time.perf_counter() - t0, 1), "kv_capacity_tokens": kv_capacity_tokens(llm),
              "speculative_config": spec, "runs": {}}
    layers = one_slot_layers(in_process_drafter(llm).runner)
    graphs = [layer.spec_graphs for layer in layers]
    result["one_slot_layers"] = len(layers)
    result["layers_with_graphs"] = sum(g is not None for g in graphs)
    if not result["layers_with_graphs"]:
        raise SystemExit('no one-slot layer has graphs: pass "hybridspec": {"gdn_cudagraphs": true} and run '
                         "without enforce_eager on a GPU")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    captures = replays = 0
    for name, on in (("graphs", True), ("eager", False), ("graphs_again", True)):
        for layer, g in zip(layers, graphs):
            layer.spec_graphs = g if on else None
        outs = llm.generate(prompts, params, use_tqdm=False)
        run = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "steps": {}}
        for b in (int(x) for x in args.batch_sizes.split(",")):
            run["steps"][str(b)] = time_decode_steps(llm, prompts, b, args.steps, args.warmup, f"{name}-{b}").summary()
        total_captures = sum(g.captures for g in graphs if g is not None)
        total_replays = sum(g.replays for g in graphs if g is not None)
        run["captures"], run["replays"] = total_captures - captures, total_replays - replays  # this run's
        captures, replays = total_captures, total_replays
        run["eager_sizes"] = sorted({s for g in graphs if g is not None for s in g.eager_sizes})
        result["runs"][name] = run
        steps = "  ".join(f"B={b}: {s['mean_ms']:.2f} ms/step (median {s['median_ms']:.2f}), "
                          f"{s['tokens_per_step']:.2f} tok/step" for b, s in run["steps"].items())
        print(f"{name:<13} captures {run['captures']:4d} replays {run['replays']:6d}  {steps}", flush=True)
        args.out.write_text(json.dumps(result))  # what has run so far, should a later run not finish
    from vllm_hybridspec.tools.compare import identical_prompts

    ref = result["runs"]["eager"]["outputs"]
    ok = result["runs"]["graphs"]["replays"] > 0 and result["runs"]["eager"]["replays"] == 0
    for name in ("graphs", "graphs_again"):
        same = identical_prompts(result["runs"][name]["outputs"], ref)
        result["runs"][name]["identical_to_eager"] = same
        ok = ok and same == len(ref)
        print(f"{name}: {same}/{len(ref)} prompts identical to the eager layers' output")
    result["passed"] = ok
    args.out.write_text(json.dumps(result))
    print("PASS" if ok else "FAIL: outputs differ, or the graphed runs replayed no graph")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
