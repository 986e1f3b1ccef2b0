"""``ReplayBenchProposer``: replayed acceptance inside vLLM, for benchmarking only.

    --speculative-config '{"method": "replay_bench", "num_speculative_tokens": 7,
                           "replay_bench": {"records": "rounds.jsonl", "continuations": "cont.jsonl", "seed": 0},
                           "hybridspec": {"policy": "policy.json"}}'

It runs as vLLM 0.26's ``"custom_class"`` method (``config.py`` translates the config in the main
process): the V1 runner constructs it with the ``VllmConfig`` and, after each step's sampling, calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` with each input-batch row's tokens
(prompt + output so far) on the host. For each row it proposes the next ``K`` tokens of the recorded
greedy continuation with the token at position ``A`` replaced (``A`` from a recorded round), so a
greedy target accepts exactly ``A``. It is not a drafter: it knows the answer, and measures only what
the target side of speculative decoding costs at a given acceptance. Greedy requests only (with
sampling, outputs leave the recorded continuation and the row stops proposing).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_hybridspec.engine.replay.config import REPLAY_CONFIG_KEY
from vllm_hybridspec.engine.replay.data import (
    Continuation,
    corrupt,
    load_continuations,
    load_replay_rounds,
    replayed_rounds,
)
from vllm_hybridspec.drafter.model import DraftBlock
from vllm_hybridspec.options import hybridspec_options

logger = logging.getLogger(__name__)


class ReplayBenchProposer:
    def __init__(self, vllm_config):
        raw = (getattr(vllm_config, "additional_config", None) or {}).get(REPLAY_CONFIG_KEY)
        if raw is None:
            raise ValueError(f'ReplayBenchProposer needs additional_config["{REPLAY_CONFIG_KEY}"]; start it with '
                             f'--speculative-config \'{{"method": "replay_bench", ...}}\' (vllm-hybridspec plugin)')
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.device = torch.device(vllm_config.device_config.device)
        self.seed = raw["seed"]
        self.rounds = load_replay_rounds(raw["records"], self.k)
        self.continuations = load_continuations(raw["continuations"])
        self._tables: dict[int, np.ndarray] = {}  # prompt key -> [len(output) + 1] record index per position
        self._row_entry: list[Continuation | None] = []
        self._diverged: set[int] = set()
        self.length_selector = None
        options = hybridspec_options(vllm_config)
        if options is not None:
            from vllm_hybridspec.selection import LengthSelector

            self.length_selector = LengthSelector(options, self.k, self.device,
                                                  vllm_config.scheduler_config.max_num_seqs)
        # vLLM's dynamic speculative decoding: the step's K from the batch-size schedule, set by the runner
        # before each propose (vllm_internals.patch_custom_class_dynamic_draft_count); None: always K
        self.draft_limit: int | None = None
        self.last_draft: DraftBlock | None = None  # [N, K] tokens, recorded top1_prob and entropy
        self.last_accepted: np.ndarray | None = None  # [N] the drafts a greedy target accepts, per row
        # since the engine started: rounds proposed, draft tokens proposed, drafts a greedy target accepts
        self.num_rounds = self.num_draft_tokens = self.num_accepted_planned = 0

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (the runner calls this on every drafter)."""

    def _entry(self, row: int, tokens: np.ndarray) -> Continuation:
        while len(self._row_entry) <= row:
            self._row_entry.append(None)
        entry = self._row_entry[row]
        if entry is not None and len(tokens) >= len(entry.prompt) and np.array_equal(
                tokens[: len(entry.prompt)], entry.prompt):
            return entry
        entry = self.continuations.find(tokens)
        if entry is None:
            raise ValueError(
                f"replay_bench: a request (batch row {row}, {len(tokens)} tokens so far, starting "
                f"{tokens[:12].tolist()}) matches no prompt of the continuations file "
                f"'{self.continuations.path}' ({len(self.continuations.entries)} prompts); record its "
                f"continuation with `hybridspec replay-record` from the same prompts")
        self._row_entry[row] = entry
        return entry

    def _table(self, entry: Continuation) -> np.ndarray:
        table = self._tables.get(entry.key)
        if table is None:
            table = replayed_rounds(self.seed, entry.key, len(entry.output) + 1, len(self.rounds.accepted))
            self._tables[entry.key] = table
        return table

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None) -> list[list[int]]:
        k, n_rows = self.k, len(sampled_token_ids)
        tokens_out = np.zeros((n_rows, k), dtype=np.int64)
        conf = np.zeros((n_rows, k), dtype=np.float32)
        ent = np.zeros((n_rows, k), dtype=np.float32)
        accepted = np.zeros(n_rows, dtype=np.int64)
        w_rem = np.ones(n_rows, dtype=np.int64)
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len:
                drafts.append([])
                continue
            tokens = token_ids_cpu[i, :n].astype(np.int64)
            entry = self._entry(i, tokens)
            g = n - len(entry.prompt)  # output tokens so far, the last sampled one included
            if g > len(entry.output) or not np.array_equal(tokens[len(entry.prompt):], entry.output[:g]):
                if entry.key not in self._diverged:
                    self._diverged.add(entry.key)
                    logger.warning("replay_bench: the output of the prompt starting %s left its recorded greedy "
                                   "continuation at or before token %d; it is decoded without drafts from here "
                                   "(greedy requests on the recording's model and dtype only)",
                                   entry.prompt[:8].tolist(), g)
                drafts.append([])
                continue
            true_next = entry.output[g: g + k]  # what the target will produce next, [<= K]
            if g >= entry.max_tokens or len(true_next) == 0:  # the request is done: nothing to verify
                drafts.append([])
                continue
            r = self._table(entry)[g]
            a = int(self.rounds.accepted[r])
            draft = corrupt(true_next, a, self.vocab_size)
            m = len(draft)
            tokens_out[i, :m] = draft
            conf[i], ent[i] = self.rounds.conf[r], self.rounds.ent[r]
            accepted[i] = min(a, m)
            w_rem[i] = min(max(entry.max_tokens - g, 1), k + 1)
            drafts.append(draft.tolist())
        if self.draft_limit is not None and self.draft_limit < k:
            # vLLM's dynamic speculative decoding scheduled fewer tokens this step: cut the drafts, and
            # cap what the length selector may choose to match (a round of w verifies w - 1 drafts)
            drafts = [d[: self.draft_limit] for d in drafts]
            w_rem = np.minimum(w_rem, self.draft_limit + 1)
        if self.draft_limit != 0:  # 0: no drafts at all this step, nothing for the selector to choose
            drafts = self._select(drafts, tokens_out, conf, ent, w_rem)
        for i, d in enumerate(drafts):
            accepted[i] = min(accepted[i], len(d))
        self.last_accepted = accepted
        self.num_rounds += sum(1 for d in drafts if d)
        self.num_draft_tokens += sum(len(d) for d in drafts)
        self.num_accepted_planned += int(accepted.sum())
        return drafts

    def _select(self, drafts, tokens, conf, ent, w_rem) -> list[list[int]]:
        """The recorded signals on device (``last_draft``); with ``"hybridspec"`` options the length
        selector cuts each row to its selected length (the draft lists are ours to cut, so the
        runner-side trimming of ``vllm_internals`` passes them through)."""
        block = DraftBlock(tokens=torch.from_numpy(tokens).to(self.device),
                           top1_prob=torch.from_numpy(conf).to(self.device),
                           entropy=torch.from_numpy(ent).to(self.device))
        self.last_draft = block
        selector = self.length_selector
        if selector is None:
            return drafts
        if not selector.speculate(len(drafts)):
            selector.gated(block.tokens)
            return [[] for _ in drafts]
        if not selector.trims:
            return drafts
        num_valid = selector.select(block.tokens, block.top1_prob, block.entropy,
                                    torch.from_numpy(w_rem).to(self.device)).tolist()
        return [d[:v] for d, v in zip(drafts, num_valid)]

    def stats(self) -> dict[str, object]:
        """Counters for tests and logs, comparable with vLLM's spec-decode metrics."""
        return {"rounds": self.num_rounds, "draft_tokens": self.num_draft_tokens,
                "accepted_planned": self.num_accepted_planned, "diverged_requests": len(self._diverged),
                "records_mean_accepted": self.rounds.mean_accepted}
