"""The engine sampling check (``sampling.py``, its docstring says how) on the tiny dense Qwen3 target,
and the two planted samplers it must reject: every draft accepted; a rejected position resampled
from the target instead of the residual."""

from __future__ import annotations

import pytest
import torch

from .conftest import fresh_seed
from .sampling import RANDOM_CASES, V, draw_tables, engine, rejected_cases, save_drafter

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    from .conftest import tiny_qwen3_config

    root = tmp_path_factory.mktemp("sampling_dense")
    config = tiny_qwen3_config(vocab_size=V, initializer_range=0.3)
    torch.manual_seed(fresh_seed("sampling dense target weights"))
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(root / "target")
    save_drafter(config, root / "target", root / "hspec", "sampling dense", 5, 3)
    return root, draw_tables(model.double(), "dense")


@pytest.fixture(scope="module")
def dense_engine(dense):
    """One engine for the three tests: the planted samplers replace module functions that the rejection
    sampler looks up at every step."""
    root, tables = dense
    yield from engine(root, tables, "sampling dense engine")


def test_dense_target_keeps_the_joint_distribution(dense, dense_engine):
    _, tables = dense
    llm, oracle = dense_engine
    rejected, counts = rejected_cases(llm, tables, oracle, "dense, H-Spec, selected lengths")
    assert rejected == {}
    assert counts["drafted"] > counts["accepted"]  # rejections too: the residual was sampled


def test_the_check_rejects_a_sampler_that_always_accepts(dense, dense_engine, monkeypatch):
    """Planted: every uniform draw is 0, so ``p(draft) >= u`` holds and every draft is accepted."""
    import vllm.v1.sample.rejection_sampler as rs

    monkeypatch.setattr(rs, "generate_uniform_probs",
                        lambda num_tokens, *args, **kwargs: torch.zeros(num_tokens, dtype=torch.float64))
    _, tables = dense
    llm, oracle = dense_engine
    assert sorted(rejected_cases(llm, tables, oracle, "planted: always accept")[0]) == RANDOM_CASES


def test_the_check_rejects_resampling_from_the_target_after_a_rejection(dense, dense_engine, monkeypatch):
    """Planted: a rejected position draws from the target ``p`` instead of the residual (with
    point-mass drafts: ``p`` without the draft token)."""
    import vllm.v1.sample.rejection_sampler as rs

    def from_target(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                    target_probs, *args, **kwargs):
        return torch.multinomial(target_probs, 1).squeeze(1).to(draft_token_ids.dtype)

    monkeypatch.setattr(rs, "sample_recovered_tokens", from_target)
    _, tables = dense
    llm, oracle = dense_engine
    assert sorted(rejected_cases(llm, tables, oracle, "planted: resample from p")[0]) == RANDOM_CASES
