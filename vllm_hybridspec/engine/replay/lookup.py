"""The replay's per-round lookup on the device (benchmarking only): which recorded tokens each
input-batch row drafts, found without reading anything back from the device.

Under async scheduling the runner's host token lists lag a step behind, so a row's draft comes from
device data: its cached prefix length (``prefix_lens``, exact on the device), its anchor (the token
the target just sampled, ``next_token_ids``) and a small per-row array of what the host knows from
the request alone (its continuation, found once by its prompt tokens; its prompt length; its output
limit; a slot for its flag), copied to the device every round. On the device:

* ``g = prefix_len + 1 - prompt_len`` output tokens exist, the anchor included; the draft is the
  continuation's tokens ``g .. g + k - 1`` with the one at the replayed rejection point ``A``
  corrupted (``(t + 1) % vocab``), ``A = min(A_D, k)`` of the record ``round_index[continuation, g]``,
  whose top-1 confidences and entropies become the round's signals;
* a row is replayed while its anchor is the continuation's token ``g - 1`` and the draft window lies
  inside the recording; once not, its request has left the recording (a flag per request, kept);
* rows of requests that are not in the recording or have left it draft ``(anchor + 1) % vocab``, which
  a greedy target rejects at position 0 unless that happens to be its next token.

``data.replayed_rounds`` and ``data.corrupt`` are the host reference; the tests pair the two.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hybridspec.engine.replay.data import Continuations, ReplayRounds, replayed_rounds

logger = logging.getLogger(__name__)

# the device counters, in order (read only by ReplayLookup.stats)
COUNTERS = ("rounds", "draft_tokens", "accepted_planned", "unrecorded_rounds", "left_rounds", "left_requests")


@dataclass
class ReplayRound:
    """One drafting round's replayed drafts; rows in input-batch order."""

    tokens: torch.Tensor      # [N, k] int64
    top1_prob: torch.Tensor   # [N, k] fp32, the replayed record's
    entropy: torch.Tensor     # [N, k] fp32, the replayed record's
    accepted: torch.Tensor    # [N] int64, drafts a greedy target accepts if all k are verified; 0 if not replayed
    live: torch.Tensor        # [N] bool, rows whose request goes on (the next step verifies their drafts)
    unrecorded: torch.Tensor  # [N] bool, live rows of requests not in the recording
    left: torch.Tensor        # [N] bool, live rows of requests that have left the recording
    newly_left: torch.Tensor  # [N] bool, rows whose request left the recording this round


class ReplayLookup:
    """The recording on the device, and per request (host) what the lookup needs of it."""

    def __init__(self, continuations: Continuations, rounds: ReplayRounds, seed: int, vocab_size: int,
                 max_model_len: int, device: torch.device, num_slots: int = 64):
        self.continuations = continuations
        self.rounds = rounds
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        c = len(continuations.entries)
        self.width = max(len(e.output) for e in continuations.entries) + 1  # one -1 past every recording
        self.unrecorded_id = c  # the table row of requests not in the recording: all -1
        outputs = np.full((c + 1, self.width), -1, dtype=np.int64)
        round_index = np.zeros((c + 1, self.width), dtype=np.int64)
        for i, e in enumerate(continuations.entries):
            outputs[i, :len(e.output)] = e.output
            round_index[i] = replayed_rounds(seed, e.key, self.width, len(rounds.accepted))
        self.outputs = torch.from_numpy(outputs).to(self.device)          # [C + 1, W] int64, -1 padded
        self.round_index = torch.from_numpy(round_index).to(self.device)  # [C + 1, W] record per position g
        self.accepted = torch.from_numpy(rounds.accepted).to(self.device)  # [R] int64, min(A_D, K)
        self.conf = torch.from_numpy(rounds.conf).to(self.device)          # [R, K] fp32
        self.ent = torch.from_numpy(rounds.ent).to(self.device)            # [R, K] fp32
        self.offsets = torch.arange(rounds.conf.shape[1] + 1, device=self.device)  # [K + 1]
        self.left = torch.zeros(num_slots, dtype=torch.bool, device=self.device)  # per request slot
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)
        # request id -> (continuation, prompt length, output limit, slot), found when it first appears
        self._known: dict[str, tuple[int, int, int, int]] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self.unrecorded_requests = 0

    # --- host: once per request, and the per-row array every round -----------------------------------

    def rows(self, req_ids: list[str], states) -> torch.Tensor:
        """``[N, 5]`` int64 on the device for input-batch rows ``req_ids``: continuation, prompt length,
        output limit, slot, and 1 where the request is new (its slot's flag is reset). ``states``:
        request id -> ``vllm.v1.worker.gpu_input_batch.CachedRequestState`` (``runner.requests``)."""
        rows = np.zeros((len(req_ids), 5), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            known = self._known.get(req_id)
            if known is None:
                known = self._register(req_id, states)
                rows[i, 4] = 1
            rows[i, :4] = known
        host = torch.from_numpy(rows)
        if self.device.type == "cuda":
            # pinned, so the copy is queued on the stream (the caching host allocator keeps the block
            # until it is done); from pageable memory the driver may wait for the stream
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _register(self, req_id: str, states) -> tuple[int, int, int, int]:
        state = states[req_id]
        prompt = state.prompt_token_ids
        found = self.continuations.index(prompt) if prompt is not None else None
        if found is None:
            found = self.unrecorded_id
            self.unrecorded_requests += 1
            if self.unrecorded_requests == 1:
                head = list(prompt[:8]) if prompt is not None else "(prompt embeddings)"
                logger.warning("replay_bench: a request's prompt (%d tokens, starting %s) is not in the continuations "
                               "file '%s'; it drafts tokens the target rejects (ReplayHSpecProposer.stats() counts "
                               "such requests)", state.num_prompt_tokens, head, self.continuations.path)
        max_tokens = state.sampling_params.max_tokens if state.sampling_params is not None else None
        prompt_len = state.num_prompt_tokens
        limit = min(max_tokens if max_tokens is not None else self.max_model_len, self.max_model_len - prompt_len)
        known = (found, prompt_len, limit, self._slot(states))
        self._known[req_id] = known
        return known

    def _slot(self, states) -> int:
        if not self._free:  # forget requests the runner no longer holds
            for req_id in [r for r in self._known if r not in states]:
                self._free.append(self._known.pop(req_id)[3])
        if not self._free:
            n = self.left.numel()
            self.left = torch.cat([self.left, torch.zeros_like(self.left)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    # --- device: every round ----------------------------------------------------------------------------

    def plan(self, rows: torch.Tensor, anchors: torch.Tensor, prefix_lens: torch.Tensor, k: int) -> ReplayRound:
        """rows: [N, 5] from :meth:`rows`; anchors: [N] the target's sampled tokens; prefix_lens: [N]
        cached tokens before the anchor; ``k`` drafts per row (vLLM's K for this step, <= K)."""
        cont, prompt_len, limit, slot, fresh = rows.unbind(1)  # [N] int64 each
        anchors = anchors.long()
        g = prefix_lens.long() + 1 - prompt_len  # [N] output tokens so far, the anchor included
        live = (g >= 1) & (g < limit)
        positions = ((g - 1).unsqueeze(1) + self.offsets[: k + 1]).clamp_(0, self.width - 1)  # [N, k + 1]
        window = self.outputs[cont.unsqueeze(1), positions]  # [N, k + 1] recorded tokens g - 1 .. g + k - 1
        truth = window[:, 1:]  # [N, k] what a greedy target produces next
        recorded = cont != self.unrecorded_id
        on_track = (window[:, 0] == anchors) & (truth >= 0).all(dim=1)
        before = self.left[slot] & (fresh == 0)
        left = before | (live & recorded & ~on_track)
        self.left[slot] = left
        replayed = live & recorded & ~left
        r = self.round_index[cont, g.clamp(0, self.width - 1)]  # [N] the replayed record
        a = self.accepted[r].clamp(max=k)
        tokens = torch.where(self.offsets[:k] == a.unsqueeze(1), (truth + 1) % self.vocab_size, truth)
        tokens = torch.where(replayed.unsqueeze(1), tokens, ((anchors + 1) % self.vocab_size).unsqueeze(1))
        return ReplayRound(tokens=tokens, top1_prob=self.conf[r, :k], entropy=self.ent[r, :k],
                           accepted=torch.where(replayed, a, 0), live=live, unrecorded=live & ~recorded,
                           left=live & recorded & left, newly_left=left & ~before)

    def count(self, replay: ReplayRound, verified: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the round to the counters. ``verified``: [N] drafts the length selector kept per row, or
        ``None`` (all ``k``). Returns ``(accepted, verified)`` [N] int64: the drafts the next step
        verifies per row and how many of them a greedy target accepts."""
        k = replay.tokens.shape[1]
        if verified is None:
            verified = replay.live.long() * k
        else:
            verified = torch.where(replay.live, verified.long(), 0)
        accepted = torch.minimum(replay.accepted, verified)
        drafted = verified > 0
        self.counters += torch.stack([drafted.sum(), verified.sum(), accepted.sum(), (replay.unrecorded & drafted).sum(),
                                      (replay.left & drafted).sum(), replay.newly_left.sum()])
        return accepted, verified

    def stats(self) -> dict[str, object]:
        """The counters since the engine started (one device read), for tests and tools."""
        return {**dict(zip(COUNTERS, self.counters.tolist())), "unrecorded_requests": self.unrecorded_requests,
                "records_mean_accepted": self.rounds.mean_accepted}
