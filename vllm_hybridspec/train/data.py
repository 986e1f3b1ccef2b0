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
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm
from vllm_hybridspec.train.target import capture_hidden_states


class DataSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: str = Field(
        description="A local .jsonl/.json/.parquet file, a directory saved by datasets' "
        "save_to_disk, or a Hugging Face hub dataset name"
    )
    split: str = "train"
    prompt_field: str | None = Field(
        default=None,
        description="Column holding the prompt (default: the first "
        "of messages, conversations, prompt, instruction, question, text)",
    )
    max_prompts: int = 64
    max_prompt_tokens: int = 128
    max_new_tokens: int = 128
    temperature: float = Field(default=0.0, description="0: greedy responses")
    top_p: float = 1.0
    generation_batch_size: int = 8
    val_fraction: float = 0.125


_PROMPT_FIELDS = ("messages", "conversations", "prompt", "instruction", "question", "text")
_ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system"}


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
    from datasets import Dataset
    from safetensors.torch import save_file
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    data_dir = Path(data_dir)
    manifest = {"target": target_name, "layer_ids": list(layer_ids), "seed": seed, "data": spec.model_dump()}
    if (data_dir / "capture.json").exists() and json.loads(
        (data_dir / "capture.json").read_text()
    ) == manifest:
        return data_dir

    if data_dir.exists():
        shutil.rmtree(data_dir)  # stale data made with other settings
    rows = load_prompts(spec, seed)
    prompts = [
        tokenize_prompt(tokenizer, prompt_messages(row, spec.prompt_field), spec.max_prompt_tokens)
        for row in rows
    ]
    responses = generate_responses(target, tokenizer, prompts, spec, seed)
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
    freq_path = data_dir / "token_freq.pt"
    freq_path.unlink(missing_ok=True)
    save_token_frequency_distribution(dataset, freq_path)
    (data_dir / "capture.json").write_text(json.dumps(manifest, indent=2))
    return data_dir
