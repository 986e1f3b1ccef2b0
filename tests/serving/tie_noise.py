"""The measurement behind ``identity.TIES``: for each target the engine tests use, the largest
|plain - speculative| log-probability difference at identical output positions (``Verdict.noise``)
over several fresh draws (weights, drafters and prompts for the tiny targets; prompt sets for the
reference models), plain decoding against the tests' speculative configs (and a compiled one).

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 python -m tests.serving.tie_noise --draws 4 --targets tiny-hybrid

Prints one line per draw and the maximum per target; ``TIES`` holds 2.5x those maxima. One target per
process: engines of different model families do not share a process well, and a process's memory grows
with every engine it starts."""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("MAMBA_DETERMINISTIC", "1")

import torch  # noqa: E402

from . import identity  # noqa: E402
from ..seeds import fresh_seed  # noqa: E402

MODELS = Path(__file__).resolve().parents[2] / "models"
HYBRID = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 256,
          "max_num_seqs": 4, "max_num_batched_tokens": 64, "seed": 0, "mamba_ssm_cache_dtype": "float32"}
DENSE = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 256,
         "max_num_seqs": 8, "max_num_batched_tokens": 512, "seed": 0}
REFERENCE = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 512,
             "max_num_seqs": 8, "max_num_batched_tokens": 1024, "seed": 0}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def noise(model: str, engine: dict, configs: dict, prompts: list, max_tokens: int) -> dict[str, tuple[float, int]]:
    """``{config: (noise, identical prompts)}`` against plain decoding with ``engine``."""
    from vllm import LLM

    llm = LLM(model=model, **engine)
    plain = identity.generate(llm, prompts, max_tokens)
    del llm
    out = {}
    for name, (spec, extra) in configs.items():
        llm = LLM(model=model, **{**engine, **extra}, speculative_config=spec)
        ours = identity.generate(llm, prompts, max_tokens)
        del llm
        v = identity.judge(ours, plain, name, tie=float("inf"), min_identical=0)
        out[name] = (v.noise, v.identical)
    return out


def random_prompts(rng: random.Random, n: int, vocab: int, lo: int, hi: int) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))]} for _ in range(n)]


def tiny_hybrid(rng: random.Random, tmp: Path, layers: int, vocab: int, prompt_len=(3, 60), max_tokens=32,
                **engine) -> dict:
    from transformers import AutoConfig

    from vllm_hybridspec.drafter import HSpecDraftModel, default_layer_selection
    from vllm_hybridspec.train.tiny_target import save_tiny_qwen3_next

    target = save_tiny_qwen3_next(tmp / "target", torch.float32, rng.randrange(2**31), vocab_size=vocab,
                                  num_hidden_layers=layers, pad_token_id=0)
    config = AutoConfig.from_pretrained(target)
    selected, kv = default_layer_selection(config, num_selected=4 if layers > 4 else 3, num_kv_reuse=layers // 4)
    torch.manual_seed(rng.randrange(2**31))
    HSpecDraftModel.from_training_args(
        config, None, None, verifier_name_or_path=str(target), target_layer_ids=selected, kv_reuse_layer_ids=kv,
        mask_token_id=vocab - 1, mamba_num_heads=4, mamba_head_dim=16, markov_rank=16).save_pretrained(tmp / "hspec")
    configs = {"ngram": (NGRAM, {}), "hspec": ({"method": "hspec", "model": str(tmp / "hspec"),
                                                 "num_speculative_tokens": 7}, {})}
    if layers == 4:  # the compiled engine test's target
        configs["compiled ngram"] = (NGRAM, {"enforce_eager": False})
    return noise(str(target), {**HYBRID, **engine}, configs, random_prompts(rng, 24, vocab - 1, *prompt_len), max_tokens)


def tiny_dense(rng: random.Random, tmp: Path) -> dict:
    from transformers import Qwen3ForCausalLM

    from .conftest import save_hspec, tiny_qwen3_config

    torch.manual_seed(rng.randrange(2**31))
    Qwen3ForCausalLM(tiny_qwen3_config(initializer_range=0.3)).save_pretrained(tmp / "target")
    save_hspec(tmp / "target", tmp / "hspec", seed=rng.randrange(2**31))
    configs = {"hspec": ({"method": "hspec", "model": str(tmp / "hspec"), "num_speculative_tokens": 7}, {})}
    return noise(str(tmp / "target"), DENSE, configs, random_prompts(rng, 24, 95, 3, 40), 24)


def reference(rng: random.Random, kind: str) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS / kind)
    rows = [json.loads(line) for line in (MODELS / "prompts" / "heldout.jsonl").open()]
    prompts = [{"prompt_token_ids": tokenizer(r["prompt"], add_special_tokens=False).input_ids[-64:]}
               for r in rng.sample(rows, 20)]
    spec = {"method": "hspec", "model": str(MODELS / f"{kind}-hspec"), "num_speculative_tokens": 7}
    engine = {**REFERENCE, "mamba_ssm_cache_dtype": "float32"} if kind == "hybrid" else REFERENCE
    return noise(str(MODELS / kind), engine, {"hspec": (spec, {})}, prompts, 24)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--targets", default="tiny-hybrid,tiny-hybrid-8,tiny-hybrid-8-v12,tiny-dense,reference-dense,reference-hybrid")
    args = parser.parse_args()
    seed = fresh_seed("tie_noise_main")
    rng = random.Random(seed)
    worst: dict[str, float] = {}
    for target in args.targets.split(","):
        for draw in range(args.draws):
            with tempfile.TemporaryDirectory() as tmp:
                if target == "tiny-hybrid":
                    result = tiny_hybrid(rng, Path(tmp), 4, 12)
                elif target == "tiny-hybrid-8":
                    result = tiny_hybrid(rng, Path(tmp), 8, 48)
                elif target == "tiny-hybrid-8-v12":  # test_gdn_layer_engine's H-Spec test
                    result = tiny_hybrid(rng, Path(tmp), 8, 12, prompt_len=(3, 40), max_tokens=24,
                                         max_num_batched_tokens=128)
                elif target == "tiny-dense":
                    result = tiny_dense(rng, Path(tmp))
                else:
                    result = reference(rng, target.removeprefix("reference-"))
            print(f"NOISE {target} draw {draw}: " + ", ".join(f"{k} {v:.3g} ({n} identical)"
                                                           for k, (v, n) in result.items()), flush=True)
            worst[target] = max([worst.get(target, 0.0), *(v for v, _ in result.values())])
    for target, value in worst.items():
        print(f"WORST {target}: {value:.3g} nats -> tie 2.5x = {2.5 * value:.3g}")


if __name__ == "__main__":
    main()
