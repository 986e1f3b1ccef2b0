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

import inspect
import logging

import numpy as np
import torch

from vllm_hybridspec.engine.compat import SUPPORTED_VLLM, vllm_speculative_methods, wrap_once
from vllm_hybridspec.engine.length.trimming import attach_selector
from vllm_hybridspec.engine.replay.config import REPLAY_CONFIG_KEY
from vllm_hybridspec.engine.replay.data import (
    Continuation,
    corrupt,
    load_continuations,
    load_replay_rounds,
    replayed_rounds,
)
from vllm_hybridspec.drafter.model import DraftBlock
from vllm_hybridspec.engine.options import hybridspec_options

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
            from vllm_hybridspec.engine.length.selector import LengthSelector

            self.length_selector = LengthSelector(options, self.k, self.device,
                                                  vllm_config.scheduler_config.max_num_seqs)
        # vLLM's dynamic speculative decoding: the step's K from the batch-size schedule, set by the runner
        # before each propose (patch_custom_class_dynamic_draft_count); None: always K
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
        runner-side trimming of ``engine/length/trimming.py`` passes them through)."""
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


# --- the reaches into vLLM this proposer needs -----------------------------------------------------


CUSTOM_CLASS_METHOD = "custom_class"


# What vLLM 0.26's GPUModelRunner.propose_draft_token_ids passes to a "custom_class" proposer.
CUSTOM_CLASS_PROPOSE_CALL = (
    "propose(",
    "sampled_token_ids,",
    "self.input_batch.num_tokens_no_spec,",
    "self.input_batch.token_ids_cpu,",
    "slot_mappings=slot_mappings,",
)


def check_custom_class_proposer_interface() -> None:
    """Raise ``RuntimeError`` unless vLLM still drives ``method="custom_class"`` proposers the way
    ``ReplayBenchProposer`` expects:

    * ``"custom_class"`` is one of ``vllm.config.speculative.SpeculativeMethod`` and
      ``SpeculativeConfig`` accepts it with ``model`` = the class's dotted path;
    * ``vllm.v1.spec_decode.custom_class_proposer.create_custom_proposer`` constructs the class with
      the ``VllmConfig`` alone;
    * ``GPUModelRunner.propose_draft_token_ids`` (``vllm/v1/worker/gpu_model_runner.py``) calls
      ``drafter.propose(sampled_token_ids, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu,
      slot_mappings=...)`` and takes back one list of draft ids per input-batch row, with
      ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` = row i's prompt + output so far (its
      ``_bookkeeping_sync`` has appended the step's sampled tokens).

    Why: this is vLLM's extension point for a proposer that is neither a model nor a built-in method
    (the runner's ``if method == ...`` chain calls it); it is marked experimental in vLLM 0.26, so a
    change must surface here and not as wrong drafts in a benchmark."""
    import re

    from vllm.v1.spec_decode import custom_class_proposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if CUSTOM_CLASS_METHOD not in vllm_speculative_methods():
        raise RuntimeError(f"vLLM changed: speculative method {CUSTOM_CLASS_METHOD!r} no longer exists "
                           f"(written for vLLM {SUPPORTED_VLLM})")
    if "user_class(vllm_config)" not in inspect.getsource(custom_class_proposer.create_custom_proposer):
        raise RuntimeError("vLLM changed: create_custom_proposer no longer constructs the proposer class with "
                           f"the VllmConfig alone (written for vLLM {SUPPORTED_VLLM})")
    source = re.sub(r"\s+", "", inspect.getsource(GPUModelRunner.propose_draft_token_ids))
    branch = source.split(f'elifspec_config.method=="{CUSTOM_CLASS_METHOD}":', 1)
    call = "".join(CUSTOM_CLASS_PROPOSE_CALL)
    if len(branch) != 2 or call not in branch[1].split("elif", 1)[0]:
        raise RuntimeError(f"vLLM changed: GPUModelRunner.propose_draft_token_ids no longer calls a "
                           f"{CUSTOM_CLASS_METHOD!r} proposer as {call} (written for vLLM {SUPPORTED_VLLM})")


def patch_custom_class_dynamic_draft_count() -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids`` so that a
    ``"custom_class"`` proposer with a ``draft_limit`` attribute gets the step's
    ``SchedulerOutput.num_spec_tokens_to_schedule`` in it before ``propose`` runs.

    Why: vLLM 0.26's dynamic speculative decoding (``num_speculative_tokens_per_batch_size``) lets the
    scheduler choose K per step from the batch size and passes it to the ngram, suffix, Medusa and
    EAGLE/DFlash proposers (``num_speculative_tokens=num_spec_tokens_to_schedule``), but not to a
    ``custom_class`` proposer, whose ``propose`` has no such argument. Without this, the replay proposer
    (:class:`ReplayBenchProposer`) would ignore the schedule. Only engines that use dynamic speculative
    decoding set the limit (elsewhere the field is the fixed K)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
            drafter = getattr(self, "drafter", None)
            spec = getattr(self, "speculative_config", None)
            if (drafter is not None and hasattr(drafter, "draft_limit") and spec is not None
                    and spec.uses_dynamic_speculative_decoding()):
                drafter.draft_limit = int(scheduler_output.num_spec_tokens_to_schedule)
            return original(self, scheduler_output, *args, **kwargs)

        return propose_draft_token_ids

    wrap_once(GPUModelRunner, "propose_draft_token_ids", make)

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            drafter = getattr(self, "drafter", None)
            if isinstance(drafter, ReplayBenchProposer) and drafter.length_selector is not None:
                # vLLM constructs a custom_class proposer with the VllmConfig alone, so it cannot attach
                # its selector to the runner itself
                attach_selector(self, drafter.length_selector)

        return __init__

    wrap_once(GPUModelRunner, "__init__", make_init)
