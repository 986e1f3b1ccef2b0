"""Pretraining arithmetic: the unigram baseline, held-out windows, the LR schedule."""

from __future__ import annotations

import math

import torch
from vllm_hybridspec.train.reference.pretrain import PretrainSpec, eval_windows, lr_at, unigram_loss
from ..seeds import fresh_seed


def test_unigram_loss_by_hand():
    # train: token 0 x3, token 1 x1, vocab 3, add-one: p = (4/7, 2/7, 1/7)
    train = torch.tensor([0, 0, 0, 1])
    assert math.isclose(unigram_loss(train, torch.tensor([0, 1, 2]), 3),
                        -(math.log(4 / 7) + math.log(2 / 7) + math.log(1 / 7)) / 3, rel_tol=1e-12)


def test_unigram_loss_random_matches_formula():
    gen = torch.Generator().manual_seed(fresh_seed("pretrain_unigram_loss"))
    V = int(torch.randint(5, 50, (), generator=gen))
    train, held = torch.randint(0, V, (1000,), generator=gen), torch.randint(0, V, (300,), generator=gen)
    counts = torch.bincount(train, minlength=V).double()
    expected = -torch.log((counts[held] + 0.5) / (1000 + 0.5 * V)).mean()
    assert math.isclose(unigram_loss(train, held, V, alpha=0.5), float(expected), rel_tol=1e-12)


def test_eval_windows_cover_consecutive_tokens():
    gen = torch.Generator().manual_seed(fresh_seed("pretrain_eval_windows"))
    tokens = torch.randperm(1000, generator=gen)
    w = eval_windows(tokens, seq_len=64, max_tokens=300)
    assert w.shape == (4, 65)
    assert torch.equal(w[1, :], tokens[64:129]) and torch.equal(w[0, -1], w[1, 0])


def test_lr_schedule():
    spec = PretrainSpec(lr=1e-3, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert math.isclose(lr_at(0, spec), 1e-4) and math.isclose(lr_at(9, spec), 1e-3)
    assert math.isclose(lr_at(60, spec), 1e-3 * (0.1 + 0.9 * 0.5))
    assert math.isclose(lr_at(110, spec), 1e-4) and math.isclose(lr_at(500, spec), 1e-4)
