"""Training data from the target itself: prompts -> target-generated responses -> captured hidden
states, written in speculators' on-disk format so speculators' ``ArrowDataset`` reads it.

Layout of ``data_dir`` (what ``speculators prepare-data`` + ``generate-offline-data`` produce):

* an Arrow dataset (``datasets.save_to_disk``) with ``input_ids``, ``loss_mask`` (1 on response
  tokens) and ``seq_len``;
* ``hidden_states/hs_{i}.safetensors`` with ``hidden_states`` ``[T, len(layer_ids) + 1, hidden]`` and
  ``token_ids`` ``[T]`` (see ``target.py`` for the layer convention);
* ``token_freq.pt`` (response-token counts, for pruning the draft vocabulary);
* ``capture.json``, the settings it was made with; a later run with the same settings reuses it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field
from tqdm import tqdm
from vllm_hybridspec.policy.errors import USER_FILE
from vllm_hybridspec.policy.files import atomic_dir
from vllm_hybridspec.train.target import capture_hidden_states


class DataSpec(BaseModel):
    model_config = USER_FILE

    prompts: str = Field(
        min_length=1,
        description="A local .jsonl/.json/.parquet file, a directory saved by datasets' "
        "save_to_disk, or a Hugging Face hub dataset name",
    )
    split: str = "train"
    prompt_field: str | None = Field(
        default=None,
        description="Column holding the prompt (default: the first "
        "of messages, conversations, prompt, instruction, question, text)",
    )
    max_prompts: int = Field(default=64, ge=2, description="train and validation prompts together")
    max_prompt_tokens: int = Field(default=128, ge=1)
    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0, description="0: greedy responses")
    top_p: float = Field(default=1.0, gt=0, le=1)
    generation_batch_size: int = Field(default=8, ge=1)
    val_fraction: float = Field(
        default=0.125, gt=0, lt=1, description="share of the prompts held out for validation"
    )


_PROMPT_FIELDS = ("messages", "conversations", "prompt", "instruction", "question", "text")
_ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system"}
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_SAVED_DATASET = ("dataset_info.json", "state.json", "dataset_dict.json")


def check_prompts(spec: DataSpec, seed: int) -> int:
    """The number of prompt rows a run of ``spec`` uses, read with the same code the run reads them
    with; a ``ValueError`` naming ``data.prompts`` (file, line or row) or ``data.val_fraction`` when
    they cannot be used. Nothing is written (``datasets`` may fill its own cache)."""
    path = Path(spec.prompts).expanduser()
    source = f"field 'data.prompts': {spec.prompts!r}"
    local = path.exists() or spec.prompts.startswith(("/", ".", "~")) or path.suffix in _FILE_SUFFIXES
    if local and not path.exists():
        raise ValueError(f"{source} does not exist; expected a .jsonl/.json/.parquet file, a "
                         "save_to_disk directory or a Hugging Face hub dataset name")
    if path.is_dir() and not any((path / name).exists() for name in _SAVED_DATASET):
        raise ValueError(f"{source} is a directory without datasets' save_to_disk files "
                         f"({', '.join(_SAVED_DATASET)}); give a .jsonl/.json/.parquet file or such a directory")
    if path.is_file() and path.suffix not in _FILE_SUFFIXES:
        raise ValueError(f"{source}: expected a .jsonl/.json/.parquet file or a save_to_disk directory")
    if path.is_file() and path.suffix == ".jsonl":
        from vllm_hybridspec.policy.records import iter_jsonl_objects

        for _ in iter_jsonl_objects(path, "a JSON object with a prompt field"):  # line-numbered errors
            pass
    import datasets

    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # a refusal is one line on stderr, not progress bars and a line
    try:
        rows = load_prompts(spec, seed)
    except Exception as e:  # datasets' errors: many kinds, many lines
        text = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{source} could not be read ({text[:300]})") from None
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    if len(rows) < 2:
        raise ValueError(f"{source} has {len(rows)} prompt rows; training needs at least 2 (one to "
                         "train on, one to validate with)")
    for i, row in enumerate(rows):
        try:
            messages = prompt_messages(row, spec.prompt_field)
            ok = bool(messages) and all(isinstance(m["content"], str) for m in messages)
        except (ValueError, AttributeError, TypeError, KeyError) as e:
            raise ValueError(f"{source}, row {i}: {e}") from None
        if not ok:
            raise ValueError(f"{source}, row {i}: no user text before the first assistant turn, or a "
                             f"turn whose content is not text: {str(row)[:100]}")
    n = len(rows)
    n_train = int(n * (1.0 - spec.val_fraction))  # speculators' split (ArrowDataset)
    if not 1 <= n_train < n:
        raise ValueError(f"field 'data.val_fraction': {spec.val_fraction} of {n} prompts leaves the "
                         f"{'training' if n_train < 1 else 'validation'} split empty; pick a fraction "
                         f"between {1 / n:.3g} and {1 - 1 / n:.3g}, or more prompts")
    return n


def load_prompts(spec: DataSpec, seed: int):
    """The prompt rows, shuffled with ``seed`` and cut to ``spec.max_prompts``."""
    from datasets import load_dataset, load_from_disk

    path = Path(spec.prompts)
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
        ds = load_from_disk(str(path))
    elif path.suffix in (".jsonl", ".json"):
        ds = load_dataset("json", data_files=str(path), split="train")
    elif path.suffix == ".parquet":
        ds = load_dataset("parquet", data_files=str(path), split="train")
    elif path.exists():
        raise ValueError(
            f"prompts={spec.prompts!r}: expected a .jsonl/.json/.parquet file or a save_to_disk directory"
        )
    else:
        ds = load_dataset(spec.prompts, split=spec.split)
    if hasattr(ds, "keys") and not hasattr(ds, "column_names"):  # a DatasetDict from save_to_disk
        ds = ds[spec.split]
    ds = ds.shuffle(seed=seed)
    return ds.select(range(min(spec.max_prompts, len(ds))))


def prompt_messages(row: dict[str, Any], field: str | None) -> list[dict[str, str]]:
    """The conversation up to (not including) its first assistant turn, as chat messages."""
    field = field or next((f for f in _PROMPT_FIELDS if row.get(f) is not None), None)
    if field is None or row.get(field) is None:
        raise ValueError(
            f"no prompt in row with columns {sorted(row)} (looked for {field or _PROMPT_FIELDS}); "
            "set data.prompt_field"
        )
    value = row[field]
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages = []
    for turn in value:
        role = _ROLES.get(turn.get("role", turn.get("from", "user")), "user")
        if role == "assistant":
            break
        messages.append({"role": role, "content": turn.get("content", turn.get("value", ""))})
    return messages


def tokenize_prompt(tokenizer, messages: list[dict[str, str]], max_tokens: int) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer("\n".join(m["content"] for m in messages)).input_ids
    return list(ids)[-max_tokens:]


@torch.no_grad()
def generate_responses(
    target, tokenizer, prompts: list[list[int]], spec: DataSpec, seed: int
) -> list[list[int]]:
    """Target-generated responses (up to and including EOS), batched with left padding."""
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    responses: list[list[int]] = []
    for start in tqdm(range(0, len(prompts), spec.generation_batch_size), desc="generating responses"):
        batch = prompts[start : start + spec.generation_batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        sampling = (
            dict(do_sample=True, temperature=spec.temperature, top_p=spec.top_p)
            if spec.temperature > 0
            else dict(do_sample=False)
        )
        out = target.generate(
            input_ids=ids.to(target.device),
            attention_mask=attention.to(target.device),
            max_new_tokens=spec.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        for row in out[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            responses.append(row)
    return responses


def prepare_data(
    spec: DataSpec, target, tokenizer, target_name: str, layer_ids: list[int], data_dir: str | Path, seed: int
) -> Path:
    """Generate responses with ``target`` and capture its hidden states at ``layer_ids`` into
    ``data_dir`` (skipped when ``data_dir`` already holds data made with the same settings)."""
    data_dir = Path(data_dir)
    manifest = {"target": target_name, "layer_ids": list(layer_ids), "seed": seed, "data": spec.model_dump()}
    if (data_dir / "capture.json").exists() and json.loads(
        (data_dir / "capture.json").read_text()
    ) == manifest:
        return data_dir

    rows = load_prompts(spec, seed)
    prompts = [
        tokenize_prompt(tokenizer, prompt_messages(row, spec.prompt_field), spec.max_prompt_tokens)
        for row in rows
    ]
    responses = generate_responses(target, tokenizer, prompts, spec, seed)
    # written beside data_dir and renamed over it when complete: stale data made with other settings
    # stays until then, and a failure leaves no half-made data_dir
    with atomic_dir(data_dir) as tmp:
        _write_captured(tmp, prompts, responses, target, layer_ids)
        (tmp / "capture.json").write_text(json.dumps(manifest, indent=2))
    return data_dir


def _write_captured(data_dir: Path, prompts, responses, target, layer_ids: list[int]) -> None:
    from datasets import Dataset
    from safetensors.torch import save_file
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    (data_dir / "hidden_states").mkdir(parents=True, exist_ok=True)
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, (prompt, response) in enumerate(
        tqdm(list(zip(prompts, responses)), desc="capturing hidden states")
    ):
        ids = torch.tensor(prompt + response)
        hidden = capture_hidden_states(target, ids, layer_ids)  # [T, len(layer_ids) + 1, hidden]
        save_file(
            {"hidden_states": hidden.contiguous(), "token_ids": ids},
            data_dir / "hidden_states" / f"hs_{i}.safetensors",
        )
        columns["input_ids"].append(ids.tolist())
        columns["loss_mask"].append([0] * len(prompt) + [1] * len(response))
        columns["seq_len"].append(len(ids))
    dataset = Dataset.from_dict(columns)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(data_dir))
    save_token_frequency_distribution(dataset, data_dir / "token_freq.pt")
