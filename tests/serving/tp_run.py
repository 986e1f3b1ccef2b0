"""Run by ``test_tp_engine.py`` in a subprocess: one engine with tensor parallelism (vLLM's
multiprocessing executor, which a pytest process cannot host), greedy generation on the given token-id
prompts; prints one JSON line with the outputs, their top-2 tokens and log-probabilities at every
position (``hybridspec compare``'s ``"top2"``), the spec-decode counters and each rank's selector and
cut counters (``HybridSpecWorkerExtension.hybridspec_stats``)."""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    from vllm_hybridspec.tools.compare import top2_of

    llm = LLM(model=args["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=512, max_num_seqs=8, max_num_batched_tokens=1024, seed=0,
              tensor_parallel_size=args["tp"], distributed_executor_backend="mp", disable_log_stats=False,
              mamba_ssm_cache_dtype="float32", speculative_config=args.get("speculative_config"),
              worker_extension_cls="vllm_hybridspec.engine.length.control.HybridSpecWorkerExtension")
    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
    counters = {m.name: m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num_") and not m.name.endswith("per_pos")}
    ranks = llm.collective_rpc("hybridspec_stats") if args.get("speculative_config") else []
    print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs], "counters": counters,
                                  "ranks": ranks,
                                  "top2": [[top2_of(lp) for lp in o.outputs[0].logprobs] for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
