"""A few optimizer steps on a tiny random target lower the H-Spec loss; the DFlash baseline trains on
the same batches."""

from __future__ import annotations

import pytest
import torch
from speculators.models.dflash import DFlashDraftModel
from speculators.train.cli import create_transformer_layer_config
from speculators.train.data import ArrowDataset, CollateFn
from vllm_hybridspec.drafter import HSpecDraftModel
from vllm_hybridspec.train.target import AddTargetKV, TargetKV

from .conftest import KV_LAYERS, LAYERS


@pytest.fixture(scope="module")
def batch(data_dir, tiny_target):
    model, _ = tiny_target
    dataset = ArrowDataset(
        max_len=384, datapath=str(data_dir), on_missing="raise", train_ratio=0.75, split="train"
    )
    collate = CollateFn(
        384,
        64,
        num_target_layers=len(LAYERS),
        dtype=torch.float32,
        preprocess=AddTargetKV(TargetKV(model, KV_LAYERS, LAYERS)),
    )
    return collate([dataset[i] for i in range(len(dataset))])


def train_steps(model, batch, kwargs, steps=30, lr=1e-2):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses, metrics = [], None
    for step in range(steps):
        torch.manual_seed(step)  # same anchors for both drafters at each step
        _, loss, metrics = model(**batch, **kwargs)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses, metrics


def test_hspec_loss_decreases(batch, tiny_target_dir, tiny_target):
    model, tokenizer = tiny_target
    torch.manual_seed(0)
    drafter = HSpecDraftModel.from_training_args(
        model.config,
        verifier_name_or_path=str(tiny_target_dir),
        target_layer_ids=LAYERS,
        kv_reuse_layer_ids=KV_LAYERS,
        mask_token_id=tokenizer.mask_token_id,
        mamba_num_heads=4,
        mamba_head_dim=16,
        markov_rank=32,
    ).train()
    kwargs, _ = HSpecDraftModel.get_trainer_kwargs(
        loss_fn='{"ce": 0.1, "tv": 0.9}', loss_implementation="eager", max_anchors=24
    )
    frozen = {n: p.clone() for n, p in drafter.named_parameters() if not p.requires_grad}
    losses, metrics = train_steps(drafter, {k: v for k, v in batch.items() if k != "error_records"}, kwargs)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    for n, p in drafter.named_parameters():  # the target's embeddings, LM head and norm stay frozen
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert {"position_1_acc_sum", "position_7_acc_sum", "eal_sum", "accept_len_sum"} <= metrics.keys()


def test_dflash_baseline_trains_on_the_same_batches(batch, tiny_target_dir, tiny_target):
    _, tokenizer = tiny_target
    layer_config = create_transformer_layer_config(str(tiny_target_dir), 5, "qwen3", None, 2048, [])
    torch.manual_seed(0)
    dflash = DFlashDraftModel.from_training_args(
        layer_config,
        verifier_name_or_path=str(tiny_target_dir),
        target_layer_ids=LAYERS,
        draft_attn_impl="sdpa",
        block_size=8,
        mask_token_id=tokenizer.mask_token_id,
        draft_vocab_size=layer_config.vocab_size,
    ).train()
    kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn='{"ce": 0.1, "tv": 0.9}', loss_implementation="eager", max_anchors=24
    )
    inputs = {k: v for k, v in batch.items() if k not in ("error_records", "target_kv")}
    losses, metrics = train_steps(dflash, inputs, kwargs, steps=10)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert {"position_1_acc_sum", "eal_sum"} <= metrics.keys()
