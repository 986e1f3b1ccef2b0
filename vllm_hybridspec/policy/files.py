"""Reading and writing the policy package's files.

Anything unreadable becomes one :class:`InputError` sentence that names the file and what the file
should be; outputs are checked before the slow work, and written to a temporary file beside the
target that is renamed into place only once complete, so a failed command leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ValidationError

from .errors import InputError, describe

GZIP_MAGIC = b"\x1f\x8b"


def not_text(path: Path, expected: str) -> InputError:
    """The sentence for a file that does not decode as UTF-8; ``expected`` says what it should be."""
    with path.open("rb") as f:
        gzipped = f.read(2) == GZIP_MAGIC
    hint = " (it is gzip-compressed: name it *.gz)" if gzipped and path.suffix != ".gz" else ""
    return InputError(f"{path}: not UTF-8 text{hint}; expected {expected}")


def read_json(path: str | Path, what: str):
    """The JSON value in ``path``, a ``what`` ("cost file", "policy file")."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} '{path}' is a directory, not a file")
    if not path.is_file():
        raise InputError(f"{what} '{path}' does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise not_text(path, f"a {what} in JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
                         ) from None


def read_model(path: str | Path, what: str, model: type[BaseModel]):
    """``path`` validated by ``model`` as JSON, strictly: no value is coerced to another type (``"2.2"``
    is not a number, ``8.0`` is not an integer, ``1`` is not ``true``), and no number is NaN or
    infinite.  Anything wrong is one :class:`InputError` naming the file, the field and the value."""
    obj = read_json(path, what)
    if found := first_non_finite(obj):
        field, x = found
        raise InputError(f"{path}: field '{field}' is {json_spelling(x)}; every number in a {what} "
                         f"must be finite")
    try:
        # JSON mode: object keys are text in JSON, so a dict[int, ...] key "4" is the length 4 there
        return model.model_validate_json(Path(path).read_bytes(), strict=True)
    except ValidationError as e:
        raise describe(e, str(path), model) from None


def json_spelling(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def first_non_finite(obj, where: str = "") -> tuple[str, float] | None:
    """``(field path, value)`` of the first NaN or infinite number in a parsed JSON value."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where, obj
    if isinstance(obj, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in obj.items())
    elif isinstance(obj, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    for sub, v in items:
        if found := first_non_finite(v, sub):
            return found
    return None


def refuse_non_finite(obj, what: str):
    """For a pydantic ``mode="before"`` validator: the parsed value unchanged, or a ``ValueError``
    naming the first non-finite number (Python's JSON reader accepts ``NaN`` and ``Infinity``)."""
    if found := first_non_finite(obj):
        field, x = found
        raise ValueError(f"field '{field}' is {json_spelling(x)}; every number in a {what} must "
                         f"be finite")
    return obj


def check_writable(path: str | Path, option: str, make_parents: bool = False) -> None:
    """Refuse an output path that cannot be written, so that a command fails before its slow work.
    ``make_parents``: the command creates missing directories, so the nearest existing one must be a
    writable directory (not a file)."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise InputError(f"{option} '{path}' is a directory; give the path of a file to write")
    if make_parents:
        parent = existing_ancestor(parent, option, path)
    elif parent.exists() and not parent.is_dir():
        raise InputError(f"{option} '{path}': '{parent}' is a file, not a directory")
    elif not parent.is_dir():
        raise InputError(f"{option} '{path}': directory '{parent}' does not exist; create it or "
                         f"write elsewhere")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{option} '{path}': directory '{parent}' is not writable")


def existing_ancestor(directory: Path, option: str, path: Path) -> Path:
    """The nearest existing directory at or above ``directory`` (where the missing ones would be
    made); an :class:`InputError` when that is a file."""
    for here in (directory, *directory.parents):
        if here.exists():
            if not here.is_dir():
                raise InputError(f"{option} '{path}': '{here}' is a file, so no directory can be made "
                                 f"below it")
            return here
    return Path.cwd()


def check_output_dir(path: str | Path, option: str) -> None:
    """Refuse an output directory that is a file or cannot be made or written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{option} '{path}' is a file; give a directory to write into")
    here = path if path.is_dir() else existing_ancestor(path.parent, option, path)
    if not os.access(here, os.W_OK | os.X_OK):
        raise InputError(f"{option} '{path}': directory '{here}' is not writable")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` that replaces it when the block completes and is removed
    when the block raises.  It keeps ``path``'s suffix, which gzip (records) and matplotlib read."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A temporary directory beside ``path`` that replaces ``path`` (a directory, removed first) when
    the block completes and is removed when the block raises: ``path`` is whole or as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
