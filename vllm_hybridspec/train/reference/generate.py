"""Prompts for the drafters: code cut at line starts from source files.

Drafter training uses prompts from the train split (the target answers them inside ``train/``'s
recipe, greedily); evaluation uses prompts from the held-out split, and a second set from outside the
corpus altogether: the installed sources of a few pure-Python packages (``OUTSIDE_PACKAGES``), which
neither the targets nor the drafters saw. A prompt is the up to ``prompt_tokens`` tokens that precede
a random line start of a random file, so the target continues real code.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import random
from pathlib import Path

# the second evaluation set: widely installed pure-Python packages, none of them in the standard library
OUTSIDE_PACKAGES = ("click", "jinja2", "requests", "rich", "packaging", "urllib3")


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


def outside_split(packages=OUTSIDE_PACKAGES):
    """The installed packages' ``.py`` files as a split whose ``train`` side holds them all (root: their
    common site directory), and the ``name version`` of each package found; packages not installed
    are left out."""
    from vllm_hybridspec.train.reference.corpus import Split

    found, roots, files = [], set(), []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        pkg_dir = Path(next(iter(spec.submodule_search_locations)))
        roots.add(pkg_dir.parent)
        files += sorted(p.relative_to(pkg_dir.parent).as_posix() for p in pkg_dir.rglob("*.py"))
        found.append(f"{name} {importlib.metadata.version(name)}")
    if len(roots) != 1:
        raise RuntimeError(f"packages {list(packages)} are not installed in one site directory (found {sorted(roots)})")
    return Split(roots.pop(), files, [], {"packages": found}), found


def stage_prompts(spec, split, tokenizer, force: bool = False) -> Path:
    """``<out_dir>/prompts/{train,heldout,outside}.jsonl``; each file is written only when missing (or
    with ``force``), so the train set can grow without touching the evaluation sets."""
    out = Path(spec.out_dir) / "prompts"
    for which, n, seed in (
        ("train", spec.num_train_prompts, spec.seed),
        ("heldout", spec.num_eval_prompts, spec.seed + 1),
    ):
        if force or not (out / f"{which}.jsonl").exists():
            write_jsonl(sample_prompts(split, which, tokenizer, n, spec.prompt_tokens, seed), out / f"{which}.jsonl")
    if force or not (out / "outside.jsonl").exists():
        outside, packages = outside_split()
        rows = sample_prompts(outside, "train", tokenizer, spec.num_outside_prompts, spec.prompt_tokens, spec.seed + 2)
        versions = dict(p.split(" ") for p in packages)
        for row in rows:
            row["package"] = f"{row['file'].split('/')[0]} {versions[row['file'].split('/')[0]]}"
        write_jsonl(rows, out / "outside.jsonl")
    return out
