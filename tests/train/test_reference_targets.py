"""Reference target configs: they build, have the intended layout, load as vLLM configs, train."""

from __future__ import annotations

import torch
from vllm_hybridspec.train.reference.pretrain import PretrainSpec, pretrain, save_target
from vllm_hybridspec.train.reference.targets import DENSE, HYBRID, build_target, target_config
from vllm_hybridspec.train.target import use_torch_gated_delta_rule
from ..seeds import fresh_seed

SMALL = dict(num_hidden_layers=4, hidden_size=128)


def test_full_size_configs():
    hybrid = target_config(HYBRID, 8192, 0)
    assert hybrid.architectures is None or hybrid.model_type == "qwen3_next"
    assert hybrid.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert (hybrid.num_experts, hybrid.num_experts_per_tok, hybrid.head_dim) == (32, 4, 64)
    assert hybrid.linear_key_head_dim == hybrid.linear_value_head_dim == 64
    dense = target_config(DENSE, 8192, 0)
    assert dense.model_type == "qwen3" and dense.head_dim == 64 and dense.tie_word_embeddings


def _stream(vocab: int, n: int) -> torch.Tensor:
    # a learnable stream: random "words" of 4 tokens repeated in random order
    words = torch.randint(2, vocab, (16, 4))
    return words[torch.randint(0, 16, (n // 4,))].flatten()


def test_a_few_steps_lower_the_loss(tmp_path):
    gen = torch.Generator().manual_seed(fresh_seed("targets_pretrain"))
    use_torch_gated_delta_rule()
    torch.set_num_threads(1)
    spec = PretrainSpec(seq_len=32, batch_size=4, steps=12, lr=3e-3, warmup_steps=2, eval_every=12, eval_tokens=256,
                        seed=int(torch.randint(0, 1000, (), generator=gen)))
    for size in (HYBRID.model_copy(update=SMALL), DENSE.model_copy(update=SMALL)):
        model = build_target(size, 256, 0, seed=spec.seed)
        stream = _stream(256, 4096)
        record = pretrain(model, stream, stream[:512], spec, "cpu")
        first, last = record["evals"][0]["heldout_loss"], record["evals"][-1]["heldout_loss"]
        assert first > 5.0 and last < first - 0.5, (size.kind, first, last)
        assert record["steps_done"] == 12 and len(record["curve"]) == 12
        save_target(model, _FakeTok(), tmp_path / size.kind)
        assert (tmp_path / size.kind / "model.safetensors").exists()


class _FakeTok:
    eos_token_id = pad_token_id = 0

    def save_pretrained(self, path):
        pass


def test_hybrid_config_loads_in_vllm(tmp_path):
    from transformers import AutoConfig

    target_config(HYBRID, 8192, 0).save_pretrained(tmp_path)
    from vllm.transformers_utils.config import get_config

    config = get_config(str(tmp_path), trust_remote_code=False)
    assert config.model_type == "qwen3_next"
    assert config.layer_types == AutoConfig.from_pretrained(tmp_path).layer_types
    assert config.num_experts == 32 and config.moe_intermediate_size == 16
