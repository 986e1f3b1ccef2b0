"""Corpus split: deterministic per file path, recorded, and checked against the files on disk."""

from __future__ import annotations

import random
import string

from vllm_hybridspec.train.reference.corpus import build_split, is_heldout, load_split, save_split, stdlib_files


def _fake_stdlib(root, n_files: int, seed: int):
    rng = random.Random(seed)
    names = []
    for i in range(n_files):
        sub = rng.choice(["", "pkg/", "pkg/sub/", "test/", "idlelib/idle_test/"])
        name = f"{sub}{''.join(rng.choices(string.ascii_lowercase, k=6))}_{i}.py"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"def f_{i}():\n    return {rng.randint(0, 10**6)}\n")
        names.append(name)
    return names


def test_split_is_deterministic_and_excludes_tests(tmp_path):
    names = _fake_stdlib(tmp_path, 200, seed=random.randrange(10**6))
    a = build_split(tmp_path, heldout_percent=10)
    b = build_split(tmp_path, heldout_percent=10)
    assert a.train == b.train and a.heldout == b.heldout
    assert a.meta["corpus_hash"] == b.meta["corpus_hash"]
    kept = [n for n in names if not n.startswith(("test/", "idlelib/idle_test/"))]
    assert sorted(a.train + a.heldout) == sorted(kept) == stdlib_files(tmp_path)
    assert not set(a.train) & set(a.heldout)
    assert all(is_heldout(f, 10) for f in a.heldout) and not any(is_heldout(f, 10) for f in a.train)
    # ~10% held out (binomial, 200 files: 3 sigma is about +-13)
    assert 0 < len(a.heldout) < 40


def test_split_file_round_trip_reports_changed_files(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    _fake_stdlib(root, 60, seed=random.randrange(10**6))
    split = build_split(root, heldout_percent=20)
    save_split(split, tmp_path / "split.json")
    same, bad = load_split(tmp_path / "split.json", root)
    assert bad == [] and same.train == split.train and same.heldout == split.heldout
    changed, removed = split.train[0], split.heldout[0]
    (root / changed).write_text("x = 1\n")
    (root / removed).unlink()
    again, bad = load_split(tmp_path / "split.json", root)
    assert sorted(bad) == sorted([changed, removed])
    assert changed not in again.train and removed not in again.heldout
    assert len(again.train) + len(again.heldout) == len(split.train) + len(split.heldout) - 2


def test_real_stdlib_split_is_stable():
    split = build_split(heldout_percent=5)
    assert split.meta["num_train"] > 300 and split.meta["num_heldout"] > 5
    assert "os.py" in split.train + split.heldout
    assert len(split.meta["corpus_hash"]) == 64
