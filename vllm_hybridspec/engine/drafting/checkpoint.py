"""A local drafter checkpoint's files, checked in the main process before vLLM reads them.

vLLM reads a drafter's ``config.json`` and weight files late and in several places: the config while
it builds the draft's ``ModelConfig``, the safetensors header while validating it, the tensors in every
worker. A damaged file then fails as a bare ``JSONDecodeError`` naming no file, a ``UnicodeDecodeError``
inside vLLM's config validation, or a dead worker and a cascade of tracebacks. Here each file is read
cheaply (the JSON text; a safetensors header on a memory map, no tensor) and a problem is one
``ValueError`` sentence naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

# vLLM 0.26 ``DefaultModelLoader._prepare_weights``: per load format, the weight-file patterns it globs
# in a local checkpoint, the first that matches winning. Other formats (``dummy``, ``tensorizer``,
# ``gguf``, ...) read no such files or have their own loaders, so nothing is checked for them.
WEIGHT_PATTERNS = {
    "auto": ("*.safetensors", "*.bin", "*.pt"),
    "hf": ("*.safetensors", "*.bin", "*.pt"),
    "safetensors": ("*.safetensors",),
    "fastsafetensors": ("*.safetensors",),
}


def read_config_json(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; ``ValueError`` naming the file and the position of a JSON error."""
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"drafter config {file} is not UTF-8 text ({e}); expected a JSON object") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        # json reports an unterminated string at its start, and only finds one at the end of the text
        ends_early = e.pos >= len(text.rstrip()) or e.msg == "Unterminated string starting at"
        truncated = " (the text ends before the JSON does: is the file truncated?)" if ends_early else ""
        raise ValueError(f"drafter config {file} is not valid JSON: {e}{truncated}; expected a JSON object") from None
    if not isinstance(config, dict):
        raise ValueError(f"drafter config {file} holds a JSON {type(config).__name__}, expected a JSON object")
    return config


def check_weight_files(directory: Path, load_format: str = "auto") -> None:
    """Refuse a local checkpoint ``directory`` whose weights vLLM's loader would not find or could not
    open with ``load_format``; every safetensors file it would read is checked by
    :func:`check_safetensors`."""
    patterns = WEIGHT_PATTERNS.get(str(load_format).lower())
    if patterns is None:
        return
    files: list[Path] = []
    for pattern in patterns:
        files = sorted(directory.glob(pattern))
        if files:
            break
    if not files:
        raise ValueError(
            f"drafter checkpoint {directory} has no weights: no model.safetensors (nor any "
            f"{' / '.join(patterns)} file) with load_format={load_format!r}; copy the checkpoint's "
            "model.safetensors there, or use load_format='dummy' for random weights"
        )
    for file in files:
        if file.suffix == ".safetensors":
            check_safetensors(file)


def check_safetensors(file: Path) -> None:
    """Open ``file`` as vLLM's weight iterator will (``safetensors.safe_open``), which parses and
    validates the header (dtypes, shapes, every tensor's byte range against the file's size) on a
    memory map and reads no tensor; a failure is a ``ValueError`` naming the file and, where the header
    can be read, the sizes that disagree."""
    try:
        with safe_open(str(file), framework="pt"):
            return
    except OSError as e:
        raise ValueError(f"drafter weights {file} cannot be read: {e}") from None
    except SafetensorError as e:
        problem = _size_problem(file) or str(e).removeprefix("Error while deserializing header: ")
    raise ValueError(f"drafter weights {file} are damaged: {problem}; re-save or re-download the checkpoint")


def _size_problem(file: Path) -> str | None:
    """How ``file``'s size disagrees with its safetensors header (8-byte little-endian header length,
    JSON header, then the tensors' bytes at the header's ``data_offsets``), or ``None`` when the sizes
    agree or the header cannot be parsed (safetensors' own message says why then)."""
    size = file.stat().st_size
    if size < 8:
        return f"it has {size} bytes, fewer than the 8 of a safetensors header length (the file is truncated)"
    with file.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if 8 + length > size:
            return (f"its header length field says {length} bytes but only {size - 8} follow it (the file is "
                    "truncated, or its first 8 bytes are damaged)")
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None
    if not isinstance(end, int) or 8 + length + end == size:
        return None
    described = 8 + length + end
    how = "the file is truncated" if size < described else "the file has extra bytes at its end"
    return f"its header describes {described} bytes but the file has {size} ({how})"
