"""Benchmark prompts: a JSONL file or a Hugging Face `datasets` name."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

Prompt = str | list[int]


def load_prompts(jsonl: Path | None = None, dataset: str | None = None, split: str = "train",
                 field: str = "prompt", limit: int = 1000) -> list[Prompt]:
    """Prompts as strings or token-id lists (the OpenAI completions API accepts both).

    A JSONL line is either ``{"<field>": "text" | [ids]}`` or a bare string / list of ids. A dataset
    name is read with ``datasets.load_dataset(dataset, split=split, streaming=True)``, taking ``field``
    from the first ``limit`` rows.
    """
    if (jsonl is None) == (dataset is None):
        raise ValueError("Give exactly one prompt source: a JSONL file (--prompts) or a dataset name "
                         "(--dataset).")
    prompts = _from_jsonl(Path(jsonl), field, limit) if jsonl is not None else \
        _from_dataset(dataset, split, field, limit)
    if not prompts:
        raise ValueError(f"No prompts found in {jsonl or dataset!s} (field {field!r}); expected at least one.")
    return prompts


def _checked(value, where: str) -> Prompt:
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        return value
    raise ValueError(f"{where}: a prompt must be a string or a non-empty list of token ids, got "
                     f"{type(value).__name__} {str(value)[:60]!r}.")


def _from_jsonl(path: Path, field: str, limit: int) -> list[Prompt]:
    if not path.is_file():
        raise ValueError(f"Prompt file {path} does not exist; expected a JSONL file of prompts.")
    prompts: list[Prompt] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno} is not JSON ({e}); expected one prompt per line.") from None
            if isinstance(row, dict):
                if field not in row:
                    raise ValueError(f"{path}:{lineno} has no field {field!r} (fields: {sorted(row)}); "
                                     "pick one with --prompt-field.")
                row = row[field]
            prompts.append(_checked(row, f"{path}:{lineno}"))
            if len(prompts) >= limit:
                break
    return prompts


def _from_dataset(name: str, split: str, field: str, limit: int) -> list[Prompt]:
    from datasets import load_dataset

    try:
        rows = iter(load_dataset(name, split=split, streaming=True))
        first = next(rows, None)
    except Exception as e:  # datasets' errors: many kinds (no such dataset, no network, no such split)
        text = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"Dataset {name!r} ({split}) could not be loaded ({text[:300]}); expected a `datasets` "
                         "name (or use --prompts FILE).") from None
    prompts: list[Prompt] = []
    for i, row in enumerate(rows if first is None else itertools.chain([first], rows)):
        if field not in row:
            raise ValueError(f"Dataset {name!r} ({split}) has no column {field!r} (columns: {sorted(row)}); "
                             "pick one with --prompt-field.")
        prompts.append(_checked(row[field], f"{name}[{i}]"))
        if len(prompts) >= limit:
            break
    return prompts
