"""Prompts for the drafters: code cut at line starts from corpus files.

Drafter training uses prompts from the train split (the target answers them inside ``train/``'s
recipe, greedily); evaluation uses prompts from the held-out split. A prompt is the up to
``prompt_tokens`` tokens that precede a random line start of a random file, so the target continues
real code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def sample_prompts(split, which: str, tokenizer, n: int, prompt_tokens: int, seed: int) -> list[dict]:
    """``n`` prompts ``{"prompt", "file", "offset"}`` from split ``which``, deterministic in ``seed``.

    Files are drawn with probability proportional to their number of lines, cut points uniformly among
    line starts that leave at least ``prompt_tokens // 2`` tokens before them."""
    rng = random.Random(seed)
    files = getattr(split, which)
    texts = split.texts(which)
    weights = [t.count("\n") + 1 for t in texts]
    prompts = []
    while len(prompts) < n:
        i = rng.choices(range(len(files)), weights)[0]
        text = texts[i]
        starts = [k + 1 for k, ch in enumerate(text) if ch == "\n" and k + 1 < len(text)]
        if not starts:
            continue
        cut = rng.choice(starts)
        ids = tokenizer(text[:cut], add_special_tokens=False).input_ids
        if len(ids) < prompt_tokens // 2:
            continue
        prompt = tokenizer.decode(ids[-prompt_tokens:])
        prompts.append({"prompt": prompt, "file": files[i], "offset": cut})
    return prompts


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))


def stage_prompts(spec, split, tokenizer, force: bool = False) -> Path:
    """``<out_dir>/prompts/{train,heldout}.jsonl``."""
    out = Path(spec.out_dir) / "prompts"
    if (out / "heldout.jsonl").exists() and not force:
        return out
    for which, n, seed in (
        ("train", spec.num_train_prompts, spec.seed),
        ("heldout", spec.num_eval_prompts, spec.seed + 1),
    ):
        write_jsonl(sample_prompts(split, which, tokenizer, n, spec.prompt_tokens, seed), out / f"{which}.jsonl")
    return out
