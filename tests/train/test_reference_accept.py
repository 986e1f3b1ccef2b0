"""Acceptance through vLLM from its spec-decode counters: per prompt, the counters' differences."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_hybridspec.train.reference.accept import per_prompt_counts, spec_config
from ..seeds import fresh_seed


class FakeLLM:
    """Cumulative counters as vLLM's ``get_metrics`` reports them; each ``generate`` adds one prompt's
    rounds, whose accepted lengths are drawn at random and kept for the check."""

    def __init__(self, D: int, positions_reported: int | None = None):
        self.D, self.reported = D, positions_reported or D
        self.drafts, self.per_pos = 0, [0] * self.reported
        self.accepted: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(fresh_seed("reference_accept_fake_llm"))

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=self.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=sum(self.per_pos)),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=list(self.per_pos))]

    def generate(self, prompts, params, use_tqdm=False):
        a = torch.randint(0, self.D + 1, (int(torch.randint(1, 20, (), generator=self.gen)),), generator=self.gen)
        self.accepted.append(a)
        self.drafts += len(a)
        for k in range(self.reported):
            self.per_pos[k] += int((a >= k + 1).sum())


@pytest.fixture(autouse=True)
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))


def test_per_prompt_counts_are_the_counters_differences():
    D = 7
    llm = FakeLLM(D)
    llm.generate(None, None)  # a warm-up before the measurement is not counted
    rounds, ge = per_prompt_counts(llm, [{"prompt_token_ids": [1]}] * 5, 16, D)
    mine = llm.accepted[1:]
    assert rounds.tolist() == [len(a) for a in mine]
    expected = torch.stack([(a[:, None] >= torch.arange(1, D + 1)).sum(0) for a in mine]).double()
    assert torch.equal(ge, expected)


def test_a_drafter_of_another_length_is_refused():
    with pytest.raises(RuntimeError, match="5 draft positions; the drafter drafts 7"):
        per_prompt_counts(FakeLLM(7, positions_reported=5), [{"prompt_token_ids": [1]}], 16, 7)


def test_speculative_configs():
    assert spec_config("models", "hybrid", "hspec", 7) == {"method": "hspec", "model": "models/hybrid-hspec",
                                                            "num_speculative_tokens": 7}
    assert spec_config("m", "dense", "dflash", 7)["method"] == "dflash"


def test_a_pair_vllm_cannot_serve_is_skipped_with_a_reason(tmp_path, capsys):
    """DFlash on the hybrid target (GDN layers): no engine is started, nothing is written, one line says
    why; the committed pairs vLLM serves are measured."""
    from vllm_hybridspec.train.reference.accept import servable, stage_accept
    from vllm_hybridspec.train.reference.pipeline import BuildSpec

    models = Path(__file__).resolve().parents[2] / "models"
    assert servable(models, "hybrid", "dflash") is not None
    assert [servable(models, k, d) for k, d in (("hybrid", "hspec"), ("dense", "hspec"), ("dense", "dflash"))] == [None] * 3
    (tmp_path / "hybrid").mkdir()
    shutil.copy(models / "hybrid" / "config.json", tmp_path / "hybrid" / "config.json")
    (tmp_path / "hybrid-dflash").mkdir()
    assert stage_accept(BuildSpec(out_dir=str(tmp_path)), "hybrid", "dflash") is None
    assert list((tmp_path / "hybrid-dflash").iterdir()) == []
    assert capsys.readouterr().out.strip() == (
        "hybrid-dflash: not measured through vLLM: vLLM 0.26 serves DFlash only on targets whose layers share "
        "one KV-cache group (this one has GDN layers)")


def test_the_card_reports_the_acceptance_through_vllm(tmp_path):
    """The committed H-Spec drafters' cards, rendered again from their files, carry the vLLM figures."""
    import json

    from vllm_hybridspec.train.reference.cards import drafter_card

    models = Path(__file__).resolve().parents[2] / "models"
    for pair in ("hybrid-hspec", "dense-hspec"):
        d = tmp_path / pair
        shutil.copytree(models / pair, d)
        measured = json.loads((d / "acceptance_vllm.json").read_text())
        card = drafter_card(d)
        for name in ("heldout", "outside"):
            assert f"**tau = {measured[name]['tau']:.3f}**" in card
        (d / "acceptance_vllm.json").unlink()
        assert "through vLLM" not in drafter_card(d)
