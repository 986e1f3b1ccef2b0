"""Pretraining a reference target on the corpus: a plain torch loop (AdamW, warmup + cosine), the
held-out loss, and a unigram baseline on the same held-out tokens.

Outputs in ``out_dir``: the checkpoint (``save_pretrained`` in bf16, tokenizer included),
``loss_curve.json`` / ``loss_curve.png`` and ``pretrain.json`` (settings, seed, timings, losses),
from which ``cards.py`` writes the model card.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from tqdm import tqdm


class PretrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seq_len: int = 256
    batch_size: int = 16
    steps: int = 2000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 200
    eval_tokens: int = 65536
    max_minutes: float | None = None  # stop early (and still save) after this much training time
    seed: int = 0


def token_stream(docs: list[list[int]]) -> torch.Tensor:
    """All documents (each ending in eos) concatenated: ``[num_tokens]`` int64."""
    return torch.tensor([t for d in docs for t in d], dtype=torch.long)


def unigram_loss(train_tokens: torch.Tensor, eval_targets: torch.Tensor, vocab_size: int, alpha: float = 1.0):
    """Cross-entropy (nats/token) of ``eval_targets`` under the add-``alpha`` unigram distribution of
    ``train_tokens``: ``-mean log((count[t] + alpha) / (N + alpha * V))``."""
    counts = torch.bincount(train_tokens, minlength=vocab_size).double()
    logp = torch.log((counts + alpha) / (counts.sum() + alpha * vocab_size))
    return float(-logp[eval_targets].mean())


def eval_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len + 1]`` windows (inputs + next-token targets) from the start of ``tokens``."""
    n = min(len(tokens) - 1, max_tokens) // seq_len
    if n == 0:
        raise ValueError(f"{len(tokens)} held-out tokens are fewer than one window of {seq_len + 1}")
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)
    return tokens[idx]


@torch.no_grad()
def device_auto() -> torch.device:
    """CUDA where there is a device, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def heldout_loss(model, windows: torch.Tensor, batch_size: int, device) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        w = windows[start : start + batch_size].to(device)
        with _autocast(device):
            logits = model(input_ids=w[:, :-1]).logits.float()  # [b, T, V]
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    model.train()
    return total / count


def _autocast(device):
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def lr_at(step: int, spec: PretrainSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    t = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def pretrain(model, train_tokens: torch.Tensor, heldout_tokens: torch.Tensor, spec: PretrainSpec, device) -> dict:
    """Train ``model`` in place on random ``seq_len`` windows of ``train_tokens``; return the record
    (loss curve, held-out losses, unigram baseline, timings)."""
    device = torch.device(device)
    model.to(device).train()
    gen = torch.Generator().manual_seed(spec.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    windows = eval_windows(heldout_tokens, spec.seq_len, spec.eval_tokens)
    unigram = unigram_loss(train_tokens, windows[:, 1:].flatten(), model.config.vocab_size)
    curve: list[dict] = []
    evals: list[dict] = [{"step": 0, "heldout_loss": heldout_loss(model, windows, spec.batch_size, device)}]
    start, steps_done = time.perf_counter(), 0
    bar = tqdm(range(spec.steps), desc=f"pretraining {model.config.model_type}")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        starts = torch.randint(0, len(train_tokens) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = train_tokens[starts[:, None] + torch.arange(spec.seq_len + 1)].to(device)  # [B, T + 1]
        with _autocast(device):
            logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        steps_done = step + 1
        curve.append({"step": steps_done, "loss": float(loss.detach()), "lr": opt.param_groups[0]["lr"]})
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        elapsed = time.perf_counter() - start
        out_of_time = spec.max_minutes is not None and elapsed > 60 * spec.max_minutes
        if steps_done % spec.eval_every == 0 or steps_done == spec.steps or out_of_time:
            evals.append({"step": steps_done, "heldout_loss": heldout_loss(model, windows, spec.batch_size, device)})
        if out_of_time:
            break
    train_seconds = time.perf_counter() - start
    return {
        "spec": spec.model_dump(),
        "steps_done": steps_done,
        "tokens_seen": steps_done * spec.batch_size * spec.seq_len,
        "train_seconds": train_seconds,
        "device": _device_name(device),
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": sum(c["loss"] for c in curve[-20:]) / max(1, len(curve[-20:])),
        "heldout_loss": evals[-1]["heldout_loss"],
        "heldout_tokens": int(windows[:, 1:].numel()),
        "unigram_heldout_loss": unigram,
        "curve": curve,
        "evals": evals,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def save_curve(record: dict, out_dir: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    (out_dir / "loss_curve.json").write_text(
        json.dumps({"train": record["curve"], "heldout": record["evals"], "unigram": record["unigram_heldout_loss"]})
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([c["step"] for c in record["curve"]], [c["loss"] for c in record["curve"]], lw=0.6, label="train")
    ax.plot([e["step"] for e in record["evals"]], [e["heldout_loss"] for e in record["evals"]], "o-", label="held-out")
    ax.axhline(record["unigram_heldout_loss"], ls="--", c="gray", label="unigram (held-out)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", ylim=(0, None))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss_curve.png", dpi=100)
    plt.close(fig)


def untie_for_vllm(model) -> None:
    """Give a tied Qwen3-Next its own ``lm_head`` (a copy of the embedding; same function).

    vLLM 0.26's ``Qwen3NextForCausalLM`` ignores ``tie_word_embeddings`` and expects an
    ``lm_head.weight`` tensor; a tied checkpoint loads without error and then predicts a uniform
    distribution (its LM head is never filled)."""
    if model.config.model_type != "qwen3_next" or not model.config.tie_word_embeddings:
        return
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())


def save_target(model, tokenizer, out_dir: str | Path) -> None:
    """bf16 ``save_pretrained`` with the tokenizer and greedy generation defaults."""
    out_dir = Path(out_dir)
    untie_for_vllm(model)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = False
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.float()
    tokenizer.save_pretrained(out_dir)
