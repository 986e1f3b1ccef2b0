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


def drafter_card(out: Path) -> str:
    """Card of a drafter directory from ``train_summary.json``, ``recipe.yaml`` and ``eval.json``."""
    import yaml

    s = json.loads((out / "train_summary.json").read_text())
    r = yaml.safe_load((out / "recipe.yaml").read_text())
    e = json.loads((out / "eval.json").read_text())
    name = {"hspec": "H-Spec", "dflash": "DFlash"}[s["drafter"]]
    d, t = r["data"], r["training"]
    timing = (f"{s['train_seconds'] / 60:.1f} min on {s['device']}" if "train_seconds" in s
              else "one NVIDIA H200 (time per drafter not recorded by this build: the four drafters, response "
                   "generation and hidden-state capture included, took about 13 minutes)")
    val = s.get("val_last", {})
    rows = "\n".join(
        f"| {k + 1} | {a:.3f} | [{lo:.3f}, {hi:.3f}] |" for k, (a, (lo, hi)) in enumerate(zip(e["alpha"], e["alpha_ci95"]))
    )
    return f"""# {name} drafter for the reference {e['target']} target

Built by `hybridspec models` (vllm-hybridspec, `train/reference/`) with `train/`'s recipe
(`recipe.yaml`): a tiny drafter for tests and demos of speculative decoding. Use it with
`--speculative-config '{{"method": "{'hspec' if s['drafter'] == 'hspec' else 'dflash'}", "model": "{out}", "num_speculative_tokens": {e['block_size'] - 1}}}'`
and the target `{s['target']}`.

| | |
|---|---|
| drafter | {name}, block size {e['block_size']} ({e['block_size'] - 1} draft tokens), {s['trainable_parameters'] / 1e6:.2f} M trainable parameters, {_size_mb(out):.1f} MB (bf16 safetensors) |
| target layers | hidden states of {s['target_layer_ids']}{'; K/V read in place from ' + str(s['kv_reuse_layer_ids']) if s['drafter'] == 'hspec' else ''} |
| data | the target's greedy responses ({d['max_new_tokens']} tokens, temperature {d['temperature']}) to {d['max_prompts']} prompts of up to {d['max_prompt_tokens']} tokens cut from train-split files (`../prompts/train.jsonl`); {d['val_fraction']:.2%} held out for validation |
| training | {t['epochs']} epochs, {s['steps']} steps, lr {t['lr']}, seed {r['seed']}; {timing} |
| loss | {s['train_loss_first']:.3f} first step, {s['train_loss_last']:.3f} last step (train); validation CE {val.get('ce_loss_epoch', float('nan')):.3f}, validation acceptance length {val.get('eal_epoch', float('nan')):.2f} |

## Acceptance on held-out prompts (outside vLLM)

Target and drafter in plain PyTorch on {e['device']}, greedy, every round verifies all {e['block_size'] - 1}
draft tokens; {e['rounds']} untruncated rounds of {e['prompts']} held-out prompts (`../prompts/heldout.jsonl`),
95% intervals from {e['bootstrap']} bootstrap resamples of prompts.

Mean accepted length (tokens per round, bonus token included): **tau = {e['tau']:.3f}**
[{e['tau_ci95'][0]:.3f}, {e['tau_ci95'][1]:.3f}].

| block position k | P(accepted >= k) | 95% interval |
|---|---|---|
{rows}

The rounds are in `records.jsonl.gz` (the length policy's round-record format), for
`hybridspec calibrate fit` / `hybridspec simulate`.
{_vllm_section(out)}"""


def _vllm_section(out: Path) -> str:
    """The card's acceptance through vLLM (``acceptance_vllm.json``, ``accept.py``), where measured."""
    path = out / "acceptance_vllm.json"
    if not path.exists():
        return ""
    a = json.loads(path.read_text())
    sets = [name for name in ("heldout", "outside") if name in a]
    label = {"heldout": "held-out prompts", "outside": "prompts from outside the corpus"}
    engine = a["engine"]
    head = " | ".join(f"{label[n]}: P(accepted >= k) [95%]" for n in sets)
    head = head[0].upper() + head[1:]
    rows = "\n".join(
        f"| {k + 1} | " + " | ".join(f"{a[n]['alpha'][k]:.3f} [{a[n]['alpha_ci95'][k][0]:.3f}, "
                                     f"{a[n]['alpha_ci95'][k][1]:.3f}]" for n in sets) + " |"
        for k in range(len(a[sets[0]]["alpha"]))
    )
    taus = "; ".join(f"{label[n]} (`../prompts/{n}.jsonl`, {a[n]['prompts']} prompts, {a[n]['rounds']} rounds): "
                     f"**tau = {a[n]['tau']:.3f}** [{a[n]['tau_ci95'][0]:.3f}, {a[n]['tau_ci95'][1]:.3f}]"
                     for n in sets)
    taus = taus[0].upper() + taus[1:]
    return f"""
## Acceptance through vLLM

The pair served by vLLM ({engine['dtype']}, {'eager' if engine['enforce_eager'] else 'CUDA graphs'}), every draft verified, greedy, {a['max_tokens']} tokens per prompt, one prompt at a time; per prompt vLLM's spec-decode counters
(`num_drafts`, `num_accepted_tokens_per_pos`), 95% intervals resampling prompts (`acceptance_vllm.json`,
`train/reference/accept.py`). {taus}.

| k | {head} |
|---|{'---|' * len(sets)}
{rows}
"""
