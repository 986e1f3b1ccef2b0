"""Model cards (``README.md`` next to each checkpoint), written from the stage records."""

from __future__ import annotations

import json
from pathlib import Path


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 1e6


def target_card(r: dict, out: Path) -> str:
    c = r["corpus"]
    cfg = json.loads((out / "config.json").read_text())
    return f"""# Reference {r['kind']} target ({cfg['architectures'][0]})

A small {cfg['model_type']} model pretrained on Python standard-library source, built by
`hybridspec models` (vllm-hybridspec, `train/reference/`). For tests and demos of speculative
decoding; not a useful code model.

| | |
|---|---|
| architecture | `{cfg['architectures'][0]}`, {r['parameters'] / 1e6:.2f} M parameters, {_size_mb(out):.1f} MB (bf16 safetensors) |
| shapes | {json.dumps(r['size'])} |
| data | `.py` files of the Python {c['python_version']} standard library (tests excluded), file-level split in `../split.json`: {c['num_train']} train files ({c['train_bytes'] / 1e6:.1f} MB, {r['train_tokens_total']:,} tokens), {c['num_heldout']} held-out files; file-list hash `{c['corpus_hash'][:16]}` |
| tokenizer | byte-level BPE, {cfg['vocab_size']} entries, trained on the train split (`../tokenizer/`), plain (chat-free) template |
| training | {r['steps_done']} steps x {r['spec']['batch_size']} x {r['spec']['seq_len']} tokens = {r['tokens_seen']:,} tokens, AdamW lr {r['spec']['lr']} (warmup {r['spec']['warmup_steps']}, cosine), seed {r['spec']['seed']} |
| time, hardware | {r['train_seconds'] / 60:.1f} min on {r['device']}, torch {r['torch']} |
| final train loss | {r['final_train_loss']:.3f} nats/token (mean of the last 20 steps) |
| held-out loss | **{r['heldout_loss']:.3f}** nats/token over {r['heldout_tokens']:,} held-out tokens |
| unigram baseline | {r['unigram_heldout_loss']:.3f} nats/token (add-one unigram of the train split, same held-out tokens) |

Loss curve: `loss_curve.png`, `loss_curve.json`; full record: `pretrain.json`.

Greedy continuation of `{r['sample'][:30]!r}...`:

```python
{r['sample']}
```
"""
