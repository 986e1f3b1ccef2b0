"""The engine sampling check (``sampling.py``, its docstring says how) on the tiny GDN + MoE hybrid
with the one-slot GDN layer, and a planted one-slot commit one token short that it must reject."""

from __future__ import annotations

import pytest
import torch

from .conftest import fresh_seed
from .sampling import CASES, SAMPLES, V, draw_tables, engine, rejected_cases, save_drafter
from .test_cpu_gdn_engine import TINY_QWEN3_NEXT

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_hybridspec.train.target import use_torch_gated_delta_rule

    use_torch_gated_delta_rule()  # transformers' torch GDN, not fla's Triton kernels
    root = tmp_path_factory.mktemp("sampling_hybrid")
    # 4 layers (GDN, GDN, GDN, full attention), as in test_identity_controls.py: every path the check
    # covers (one-slot verify and lazy commit, MoE, the drafter reading the attention layer's K/V) at
    # half the cost per request of the 8 layers this test had
    config = AutoConfig.for_model(**{**TINY_QWEN3_NEXT, "vocab_size": V, "num_hidden_layers": 4, "pad_token_id": 0,
                                     "initializer_range": 0.3})
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(fresh_seed("sampling hybrid target weights"))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(root / "target")
    save_drafter(config, root / "target", root / "hspec", "sampling hybrid", 3, 1)
    model.set_experts_implementation("eager")  # the grouped-mm experts refuse float64
    return root, draw_tables(model.double(), "hybrid")


@pytest.fixture(scope="module")
def hybrid_engine(hybrid):
    """One engine for both tests: the planted commit replaces a method that the one-slot layer looks up
    at every step."""
    root, tables = hybrid
    yield from engine(root, tables, "sampling hybrid engine")


def gdn_is_one_slot(llm) -> bool:
    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN

    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    layers = [m for name, m in context.items() if ".linear_attn" in name]
    return bool(layers) and all(isinstance(m, HSpecQwenGDN) and m.one_slot for m in layers)


def test_hybrid_target_keeps_the_joint_distribution(hybrid, hybrid_engine):
    _, tables = hybrid
    llm, oracle = hybrid_engine
    assert gdn_is_one_slot(llm)
    rejected, counts = rejected_cases(llm, tables, oracle, "hybrid, one-slot GDN, H-Spec, selected lengths")
    assert rejected == {}
    assert counts["drafted"] > counts["accepted"]  # rejections too: the residual was sampled


def test_the_check_rejects_a_one_slot_commit_one_token_short(hybrid, hybrid_engine, monkeypatch):
    """Planted in the one-slot layer: each round's lazy commit advances the state by one token fewer
    than it accepted (``test_identity_controls.py``'s ``commit m - 1``). Token 3 then comes from a
    wrong state whenever token 2 rejected its draft, which the rejected-often case does in about 90 % of
    its samples; a fifth of the samples suffice."""
    from .test_identity_controls import plant_commit_one_short

    plant_commit_one_short(monkeypatch)
    for case in CASES:
        if case.temperature > 0:
            monkeypatch.setattr(case, "samples", SAMPLES // 5)
    _, tables = hybrid
    llm, oracle = hybrid_engine
    assert gdn_is_one_slot(llm)
    assert "T=1.3, third-ranked drafts" in rejected_cases(llm, tables, oracle, "planted: one-slot commit m - 1")[0]
