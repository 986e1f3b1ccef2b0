"""The prompt sets: each file written only when missing, the train set growing without touching the
evaluation sets, and the second evaluation set drawn from outside the corpus."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from tests.train.test_reference_corpus import _fake_stdlib
from vllm_hybridspec.train.reference import generate
from vllm_hybridspec.train.reference.corpus import build_split
from vllm_hybridspec.train.reference.generate import outside_split, stage_prompts
from vllm_hybridspec.train.reference.pipeline import BuildSpec

MODELS = __import__("pathlib").Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODELS / "tokenizer")


def _rows(path):
    return [json.loads(line) for line in path.open()]


def test_the_train_set_grows_without_touching_the_evaluation_sets(tmp_path, tokenizer):
    root = tmp_path / "lib"
    root.mkdir()
    _fake_stdlib(root, 80, seed=random.randrange(10**6))
    split = build_split(root, heldout_percent=30)
    spec = BuildSpec(out_dir=str(tmp_path / "out"), num_train_prompts=6, num_eval_prompts=4, num_outside_prompts=3,
                     prompt_tokens=8)
    out = stage_prompts(spec, split, tokenizer)
    heldout, outside, train = (_rows(out / f"{n}.jsonl") for n in ("heldout", "outside", "train"))
    assert (len(train), len(heldout), len(outside)) == (6, 4, 3)
    assert {r["file"] for r in train} <= set(split.train) and {r["file"] for r in heldout} <= set(split.heldout)
    # outside: installed packages' files, never the corpus's, each row naming its package and version
    packages = {p.split(" ")[0] for p in outside_split()[1]}
    assert all(r["file"].split("/")[0] in packages and r["package"].split(" ")[0] == r["file"].split("/")[0]
               for r in outside)
    held_bytes = (out / "heldout.jsonl").read_bytes()
    (out / "train.jsonl").unlink()
    stage_prompts(spec.model_copy(update={"num_train_prompts": 12}), split, tokenizer)
    grown = _rows(out / "train.jsonl")
    assert len(grown) == 12 and grown[:6] == train  # same seed: the first draws repeat
    assert (out / "heldout.jsonl").read_bytes() == held_bytes
    # force rewrites every file
    stage_prompts(spec.model_copy(update={"num_eval_prompts": 2}), split, tokenizer, force=True)
    assert len(_rows(out / "heldout.jsonl")) == 2


def test_outside_split_refuses_packages_from_two_site_directories(monkeypatch, tmp_path):
    def fake_spec(name):
        return SimpleNamespace(submodule_search_locations=[str(tmp_path / name / name)])

    for name in ("a", "b"):
        (tmp_path / name / name).mkdir(parents=True)
    monkeypatch.setattr(generate.importlib.util, "find_spec", fake_spec)
    monkeypatch.setattr(generate.importlib.metadata, "version", lambda name: "1.0")
    with pytest.raises(RuntimeError, match="one site directory"):
        outside_split(("a", "b"))


def test_committed_outside_prompts_come_from_no_corpus_file():
    split = json.loads((MODELS / "split.json").read_text())
    corpus = set(split["train"]) | set(split["heldout"])
    rows = _rows(MODELS / "prompts" / "outside.jsonl")
    assert len(rows) >= 32 and not {r["file"] for r in rows} & corpus
    assert all(r["package"].split(" ")[0] in generate.OUTSIDE_PACKAGES for r in rows)
