"""GPU check of the one-slot GDN layer (vllm_hybridspec/gdn_layer.py) on a tiny Qwen3-Next target
with random weights: greedy ngram spec decoding with the layer against plain decoding and against
vLLM's own GDN spec path, and the KV capacity each engine reports.

    source examples/device_setup.sh && python3 examples/gdn_layer_gpu_check.py [out.json]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from vllm_hybridspec.train.tiny_target import save_tiny_qwen3_next

VOCAB = 12
NUM_PROMPTS, MAX_TOKENS = 24, 32


def main(out_path: str | None) -> None:
    from vllm import LLM, SamplingParams
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    path = tempfile.mkdtemp(prefix="tiny_qwen3_next_")
    save_tiny_qwen3_next(path, dtype=torch.bfloat16, seed=1234, vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()}
               for n in torch.randint(3, 60, (NUM_PROMPTS,), generator=gen)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runs = {"plain": None, "one_slot": {**ngram, "hybridspec": {"gdn_kernel": True}},
            "vllm_gdn": {**ngram, "hybridspec": {"gdn_kernel": False}},
            "one_slot_k15": {**ngram, "num_speculative_tokens": 15, "hybridspec": {"gdn_kernel": True}}}
    results = {}
    for name, spec in runs.items():
        llm = LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=64, seed=0, mamba_ssm_cache_dtype="float32",
                  speculative_config=spec, disable_log_stats=False, gpu_memory_utilization=0.2,
                  additional_config={"gdn_prefill_backend": "triton"})
        core = llm.llm_engine.engine_core.engine_core
        tokens = get_kv_cache_capacity(llm.llm_engine.vllm_config, core.scheduler.kv_cache_config)[0]
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        entry = {"kv_tokens": tokens, "outputs": outputs}
        if spec is not None:
            m = {x.name: x for x in llm.get_metrics()}
            entry.update(drafts=m["vllm:spec_decode_num_drafts"].value,
                         draft_tokens=m["vllm:spec_decode_num_draft_tokens"].value,
                         accepted=m["vllm:spec_decode_num_accepted_tokens"].value)
            entry["identical_to_plain"] = sum(a == b for a, b in zip(outputs, results["plain"]["outputs"]))
        results[name] = entry
        print(name, {k: v for k, v in entry.items() if k != "outputs"}, flush=True)
        del llm
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
