"""Round records: what a capture run logs, one speculative round per JSONL line.

A capture run verifies all ``D`` draft tokens in every round (HybridSpec paper, "Calibration data"),
so the number ``A_D`` of accepted draft tokens is never censored by a shorter verification, and any
length ``w`` would have accepted ``min(A_D, w - 1)`` of them.  One line::

    {"conf": [0.93, 0.88, ...], "ent": [0.31, 0.52, ...], "accepted": 6, "truncated": false,
     "n_new_l0": [5, 3, ...], "n_new_later": [41, 30, ...], "remaining": 812}

``conf``        D floats in [0, 1]: the drafter's top-1 probability of draft token ``d_i``.
``ent``         D floats >= 0: the entropy (nats) of the drafter's distribution at ``d_i``.
``accepted``    ``A_D``, an integer in 0..D: draft tokens the target accepted with all D verified.
``truncated``   true when EOS or the output limit cut the round; such rounds train nothing.
``n_new_l0``    optional, D integers >= 0: Layer-0 experts that ``d_i`` adds to those already
                chosen by the anchor and ``d_1..d_{i-1}`` (``U_0(i+1) - U_0(i)``).
``n_new_later`` optional, D integers >= 0: new (layer, expert) pairs ``d_i`` adds in layers 1..L-1.
``remaining``   optional integer >= 1: output tokens still allowed when the round starts; the
                executed length is capped at ``w_rem = clamp(remaining, 2, W)``.
``p_true``      optional, D floats in [0, 1], non-increasing: the true prefix-acceptance
                probabilities, known only for synthetic records (they give the simulator's oracle).
``request``     optional integer: the request the round belongs to (informational).

Every line must have the same D.  :func:`load_records` rejects a bad file with the line number and
the field; :class:`Rounds` is the same data as tensors.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from tqdm import tqdm

from .errors import InputError, describe
from .files import atomic_path, not_text
from .ranges import MAX_COUNT, MAX_EXPERTS_PER_TOKEN, MAX_LENGTH, MAX_NEW_EXPERTS, MAX_TOKENS

# an entropy in nats: at most log(V), and log(2**40) bounds every vocabulary
MAX_ENTROPY = 40 * math.log(2)
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Entropy = Annotated[float, Field(ge=0, le=MAX_ENTROPY, allow_inf_nan=False)]


class RoundRecord(BaseModel):
    """One capture-run round; the module docstring defines every field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    conf: list[Probability] = Field(min_length=1, max_length=MAX_LENGTH - 1)
    ent: list[Entropy] = Field(min_length=1)
    accepted: int = Field(ge=0)
    truncated: bool = False
    n_new_l0: list[Annotated[int, Field(ge=0, le=MAX_EXPERTS_PER_TOKEN)]] | None = None  # a token's top-k at most
    n_new_later: list[Annotated[int, Field(ge=0, le=MAX_NEW_EXPERTS)]] | None = None  # its top-k in every layer
    remaining: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    p_true: list[Probability] | None = None
    request: int | None = Field(default=None, ge=0, le=MAX_COUNT)

    @model_validator(mode="after")
    def _same_length(self) -> RoundRecord:
        d = len(self.conf)
        for name in ("ent", "n_new_l0", "n_new_later", "p_true"):
            v = getattr(self, name)
            if v is not None and len(v) != d:
                raise ValueError(f"field '{name}' has {len(v)} entries but 'conf' has {d}; "
                                 f"every per-draft-token field needs one entry per draft token")
        if self.accepted > d:
            raise ValueError(f"field 'accepted' is {self.accepted} but only D = {d} draft tokens "
                             f"were proposed; it must lie in 0..{d}")
        if self.p_true is not None and any(b > a for a, b in zip(self.p_true, self.p_true[1:])):
            raise ValueError("field 'p_true' must be non-increasing (p_i = P(A_D >= i))")
        return self

    @property
    def draft_len(self) -> int:
        return len(self.conf)


def open_text(path: Path, mode: str = "r"):
    """``*.gz`` files are gzip-compressed JSONL (the committed reference records are)."""
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else path.open(mode)


def iter_jsonl_objects(path: Path, expected: str, progress: str | None = None) -> Iterator[tuple[str, dict]]:
    """``(where, obj)`` for each non-blank line of a ``.jsonl`` / ``.jsonl.gz`` file, ``where`` being
    ``"<path> line <n>"`` for the caller's own field errors.  A line that is not JSON, or not a JSON
    object, raises :class:`InputError` naming file and line (``expected`` completes "expected ...,
    got <type>"); so does a file that is not text, or a ``.gz`` that is not gzip.  ``progress``: the
    unit of a tqdm progress bar, or ``None`` for none."""
    lineno = 0
    try:
        with open_text(path) as f:
            lines = f if progress is None else tqdm(f, desc=f"reading {path.name}",
                                                    unit=f" {progress}", disable=None, leave=False)
            for lineno, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                                     ) from None
                if not isinstance(obj, dict):
                    raise InputError(f"{where}: expected {expected}, got {type(obj).__name__}")
                yield where, obj
    except UnicodeDecodeError:
        raise not_text(path, "JSONL, or gzip-compressed JSONL named *.gz") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise InputError(f"{path}: not a readable gzip file ({e or 'it ends early'}, after "
                         f"{lineno} lines); a *.gz file must be gzip-compressed JSONL") from None


def load_records(path: str | Path) -> list[RoundRecord]:
    """Read and validate a JSONL records file (``.jsonl`` or ``.jsonl.gz``); raise :class:`InputError`
    naming line and field."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"records file '{path}' is a directory, not a file")
    if not path.is_file():
        raise InputError(f"records file '{path}' does not exist")
    records: list[RoundRecord] = []
    for where, obj in iter_jsonl_objects(path, "a JSON object with fields 'conf', 'ent', 'accepted'",
                                         progress="rounds"):
        try:
            rec = RoundRecord.model_validate(obj)
        except ValidationError as e:
            raise describe(e, where, RoundRecord) from None
        if records and rec.draft_len != records[0].draft_len:
            raise InputError(f"{where}: field 'conf' has {rec.draft_len} entries but earlier "
                             f"rounds have D = {records[0].draft_len}; one file holds one D")
        records.append(rec)
    if not records:
        raise InputError(f"records file '{path}' holds no rounds")
    return records


def save_records(records: list[RoundRecord], path: str | Path) -> None:
    """Write JSONL (gzip-compressed for ``*.gz``) atomically: all of it, or nothing on failure."""
    with atomic_path(path) as tmp, open_text(tmp, "w") as f:
        for r in records:
            f.write(r.model_dump_json(exclude_none=True) + "\n")


@dataclass
class Rounds:
    """Records as tensors (CPU, float64).  Optional per-token fields are filled with -1 (counts)
    or NaN (``p_true``) on rounds that do not carry them."""

    conf: torch.Tensor          # [N, D] f64
    ent: torch.Tensor           # [N, D] f64
    accepted: torch.Tensor      # [N] int64, A_D
    truncated: torch.Tensor     # [N] bool
    n_new_l0: torch.Tensor      # [N, D] int64, -1 where absent
    n_new_later: torch.Tensor   # [N, D] int64, -1 where absent
    remaining: torch.Tensor     # [N] int64, -1 where absent
    p_true: torch.Tensor        # [N, D] f64, NaN where absent

    @classmethod
    def from_records(cls, records: list[RoundRecord]) -> Rounds:
        d = records[0].draft_len

        def col(name: str, fill, dtype) -> torch.Tensor:
            rows = [getattr(r, name) if getattr(r, name) is not None else [fill] * d for r in records]
            return torch.tensor(rows, dtype=dtype)

        return cls(
            conf=torch.tensor([r.conf for r in records], dtype=torch.float64),
            ent=torch.tensor([r.ent for r in records], dtype=torch.float64),
            accepted=torch.tensor([r.accepted for r in records], dtype=torch.int64),
            truncated=torch.tensor([r.truncated for r in records], dtype=torch.bool),
            n_new_l0=col("n_new_l0", -1, torch.int64),
            n_new_later=col("n_new_later", -1, torch.int64),
            remaining=torch.tensor([r.remaining if r.remaining is not None else -1 for r in records]),
            p_true=col("p_true", float("nan"), torch.float64),
        )

    @property
    def draft_len(self) -> int:
        return self.conf.shape[1]

    def __len__(self) -> int:
        return self.conf.shape[0]

    def select(self, mask: torch.Tensor) -> Rounds:
        return Rounds(**{k: v[mask] for k, v in vars(self).items()})

    def length_limit(self) -> torch.Tensor:
        """``w_rem`` per round: ``clamp(remaining, 2, W)``, or ``W`` where no budget was logged."""
        w = self.draft_len + 1
        return torch.where(self.remaining > 0, self.remaining.clamp(2, w), w)
