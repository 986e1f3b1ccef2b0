"""Replayed acceptance, for benchmarking only: its two input files and the host reference of its draws.

Measuring a full-size target (e.g. the Qwen3.6-35B-A3B shape) needs no trained weights if the
draft's acceptance is replayed rather than produced: under greedy decoding, speculation does not
change the output, so each request's continuation can be recorded once by plain decoding and
proposed back to the target during the measured run, corrupted at a rejection point ``A`` drawn from
recorded rounds (``policy/records.py``). Exactly ``A`` drafts are then accepted (``A = K``: all of
them), and the round carries the recorded round's top-1 confidences and entropies, so a length
policy sees realistic signals. ``corrupt`` and ``replayed_rounds`` here are the host reference of
the device lookup (``lookup.py``); the proposer is ``proposer.ReplayHSpecProposer``.

Two files:

* continuations (JSONL, ``hybridspec replay-record``), one request per line::

      {"prompt_token_ids": [...], "output_token_ids": [...], "max_tokens": 256}

  ``output_token_ids``: the target's greedy continuation (EOS ignored), recorded ``K`` tokens past
  ``max_tokens`` (the benchmark's output length) so the last rounds' drafts are known too.
  Each prompt appears once (the proposer finds a request's continuation by its prompt tokens).
* round records: the ``policy/records.py`` format; rounds cut by EOS or the output limit
  (``truncated``) are not replayed, and ``D >= K`` is needed (position ``i`` of a draft of ``K``
  replays position ``i`` of the record; ``A = min(A_D, K)``).

Draws are deterministic: the round replayed at output position ``g`` of a prompt is a function of
``(seed, prompt tokens, g)`` only, so every configuration benchmarked (verify-all, a length policy,
another batch size) replays the same rounds at the same places.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_hybridspec.policy.errors import InputError
from vllm_hybridspec.policy.records import iter_jsonl_objects, load_records, open_text


@dataclass
class ReplayRounds:
    """The replayable rounds of a records file, cut to ``K`` draft positions."""

    accepted: np.ndarray  # [R] int64, min(A_D, K)
    conf: np.ndarray      # [R, K] float32, top-1 probability per draft position
    ent: np.ndarray       # [R, K] float32, entropy (nats) per draft position

    @property
    def mean_accepted(self) -> float:
        return float(self.accepted.mean())

    @property
    def std_accepted(self) -> float:
        return float(self.accepted.std())


def load_replay_rounds(path: str | Path, k: int) -> ReplayRounds:
    """Read a round-records file for a draft of ``k`` tokens; :class:`InputError` names the problem."""
    records = load_records(path)  # validates line by line
    d = records[0].draft_len
    if d < k:
        raise InputError(f"records file '{path}' holds rounds of D = {d} draft tokens, but the replay "
                         f"proposes K = num_speculative_tokens = {k}; record rounds with D >= {k} or lower "
                         f"num_speculative_tokens to at most {d}")
    kept = [r for r in records if not r.truncated]
    if not kept:
        raise InputError(f"records file '{path}' holds only truncated rounds (cut by EOS or the output "
                         f"limit); the replay needs at least one complete round")
    return ReplayRounds(
        accepted=np.minimum(np.array([r.accepted for r in kept], dtype=np.int64), k),
        conf=np.array([r.conf[:k] for r in kept], dtype=np.float32),
        ent=np.array([r.ent[:k] for r in kept], dtype=np.float32),
    )


@dataclass
class Continuation:
    prompt: np.ndarray  # [L] int64
    output: np.ndarray  # [M + K] int64, the greedy continuation
    max_tokens: int     # M, the benchmark's output length
    key: int            # stable 63-bit hash of the prompt tokens


def prompt_key(prompt: np.ndarray) -> int:
    digest = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Continuations:
    """The recorded greedy continuations, found by a request's prompt tokens."""

    def __init__(self, entries: list[Continuation], path: str = "<memory>"):
        if not entries:
            raise InputError(f"continuations file '{path}' holds no requests")
        self.entries = entries
        self.path = path
        self._by_prompt: dict[bytes, int] = {}  # prompt tokens (int64 bytes) -> index in entries
        for i, e in enumerate(entries):
            if self._by_prompt.setdefault(e.prompt.tobytes(), i) != i:
                raise InputError(f"continuations file '{path}': the prompt of {len(e.prompt)} tokens starting "
                                 f"{e.prompt[:8].tolist()} appears twice; record each prompt once")

    def index(self, prompt) -> int | None:
        """The index in ``entries`` of the continuation of ``prompt`` (token ids), or ``None``."""
        return self._by_prompt.get(np.asarray(prompt, dtype=np.int64).tobytes())

    def find(self, prompt) -> Continuation | None:
        """The continuation recorded for exactly ``prompt`` (token ids), or ``None``."""
        i = self.index(prompt)
        return None if i is None else self.entries[i]


def load_continuations(path: str | Path) -> Continuations:
    """Read a continuations JSONL file; :class:`InputError` names the line and field."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"continuations file '{path}' does not exist; record one with "
                         f"`hybridspec replay-record` (plain greedy decoding of the benchmark prompts)")
    entries: list[Continuation] = []
    expected = "a JSON object with 'prompt_token_ids', 'output_token_ids' and 'max_tokens'"
    for where, obj in iter_jsonl_objects(path, expected):
        fields = {}
        for name in ("prompt_token_ids", "output_token_ids"):
            v = obj.get(name)
            if not (isinstance(v, list) and v and all(isinstance(t, int) and t >= 0 for t in v)):
                raise InputError(f"{where}: field '{name}' must be a non-empty list of token ids "
                                 f"(integers >= 0), got {str(v)[:80]}")
            fields[name] = np.array(v, dtype=np.int64)
        m = obj.get("max_tokens")
        if not (isinstance(m, int) and 1 <= m <= len(fields["output_token_ids"])):
            raise InputError(f"{where}: field 'max_tokens' must be an integer in 1..len(output_token_ids) = "
                             f"{len(fields['output_token_ids'])}, got {m!r}")
        extra = set(obj) - {"prompt_token_ids", "output_token_ids", "max_tokens"}
        if extra:
            raise InputError(f"{where}: unknown fields {sorted(extra)}; valid are 'prompt_token_ids', "
                             f"'output_token_ids', 'max_tokens'")
        prompt = fields["prompt_token_ids"]
        entries.append(Continuation(prompt, fields["output_token_ids"], m, prompt_key(prompt)))
    return Continuations(entries, str(path))


def save_continuations(entries: list[tuple[list[int], list[int], int]], path: str | Path) -> None:
    """``entries``: (prompt token ids, output token ids, max_tokens) per request."""
    with open_text(Path(path), "w") as f:
        f.writelines(json.dumps({"prompt_token_ids": list(prompt), "output_token_ids": list(output),
                                 "max_tokens": m}) + "\n" for prompt, output, m in entries)


def replayed_rounds(seed: int, key: int, num_positions: int, num_rounds: int) -> np.ndarray:
    """[num_positions] int64: the record index replayed at each output position of the request whose
    prompt hashes to ``key``, uniform over ``0..num_rounds-1`` and a function of ``(seed, key)`` only."""
    return np.random.default_rng([seed, key]).integers(num_rounds, size=num_positions)


def corrupt(draft: np.ndarray, accepted: int, vocab_size: int) -> np.ndarray:
    """``draft`` (the target's own next tokens) with position ``accepted`` replaced by another token,
    so a greedy target accepts exactly ``min(accepted, len(draft))`` of them."""
    draft = draft.copy()
    if accepted < len(draft):
        draft[accepted] = (draft[accepted] + 1) % vocab_size
    return draft
