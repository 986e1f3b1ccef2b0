"""``ReplayHSpecProposer``: replayed acceptance inside vLLM, for benchmarking only.

    --speculative-config '{"method": "replay_bench", "model": "<an H-Spec checkpoint>", "num_speculative_tokens": 7,
                           "replay_bench": {"records": "rounds.jsonl", "continuations": "cont.jsonl", "seed": 0},
                           "hybridspec": {"policy": "policy.json"}}'

It is served the way H-Spec is: ``config.py`` translates the config into vLLM's ``"dflash"`` method
with the H-Spec checkpoint as its draft, so the runner keeps async scheduling, asks the target for
the drafter's hidden states and calls ``propose`` after each step's sampling, and
``RunnerDFlashProposer.__new__`` (``engine/drafting/proposer.py``) builds this class when
``additional_config`` holds ``"replay_bench"`` (:func:`is_replay_engine`, registered by ``plugin.register``). Every round runs the (dummy-weight) H-Spec drafter
as ``HSpecProposer`` does, paying its cost (CUDA graphs included on a GPU), and then replaces the
drafted tokens and their top-1 confidences and entropies with replayed ones (``lookup.py``: the
recorded greedy continuation, corrupted at a rejection point drawn from recorded rounds), so a
greedy target accepts exactly the recorded count and the length selector reads the recorded signals.
It knows the answer: it measures what the target side of speculative decoding costs at a given
acceptance, plus the drafter's cost. Greedy requests only (with sampling, outputs leave the recording
and those requests draft tokens the target rejects).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig

from vllm_hybridspec.drafter.layers import DraftBlock
from vllm_hybridspec.engine.drafting.proposer import HSpecProposer
from vllm_hybridspec.engine.replay.config import replay_options
from vllm_hybridspec.engine.replay.data import load_continuations, load_replay_rounds
from vllm_hybridspec.engine.replay.lookup import ReplayLookup, ReplayRound


def is_replay_engine(vllm_config) -> bool:
    """Whether an H-Spec engine's ``additional_config`` holds ``"replay_bench"`` options: its runner builds a
    :class:`ReplayHSpecProposer` (``drafting.proposer.register_substitute``, called by ``plugin.register``)."""
    return replay_options(vllm_config) is not None


class ReplayHSpecProposer(HSpecProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        options = replay_options(vllm_config)
        rounds = load_replay_rounds(options["records"], self.num_speculative_tokens)
        self.lookup = ReplayLookup(load_continuations(options["continuations"]), rounds, options["seed"],
                                   vllm_config.model_config.get_vocab_size(), vllm_config.model_config.max_model_len,
                                   device, num_slots=2 * vllm_config.scheduler_config.max_num_seqs)
        self._round: ReplayRound | None = None  # this round's replay, between drafting and counting
        # the last round, per input-batch row: drafts the next step verifies, and how many a greedy target accepts
        self.last_verified: torch.Tensor | None = None
        self.last_accepted: torch.Tensor | None = None

    def _draft_block(self, block: DraftBlock, anchors: torch.Tensor, prefix_lens: torch.Tensor) -> DraftBlock:
        n, k = block.tokens.shape
        rows = self.lookup.rows(self.runner.input_batch.req_ids[:n], self.runner.requests)
        self._round = self.lookup.plan(rows, anchors, prefix_lens, k)
        return DraftBlock(tokens=self._round.tokens, top1_prob=self._round.top1_prob, entropy=self._round.entropy)

    @torch.inference_mode()
    def propose(self, num_speculative_tokens, *args, **kwargs) -> torch.Tensor:
        self._round = None
        drafts = super().propose(num_speculative_tokens, *args, **kwargs)
        replay, self._round = self._round, None
        if replay is None:  # no drafter round: K = 0, or the batch gate turned drafting off
            self.last_verified = self.last_accepted = None
            return drafts
        round = None if self.runner_state is None else self.runner_state.round  # this round's (HSpecProposer._hold)
        kept = None if round is None or not round.selected else round.w - 1  # [N] the drafts the selector left
        self.last_accepted, self.last_verified = self.lookup.count(replay, kept)
        return drafts

    def stats(self) -> dict[str, object]:
        """Since the engine started: rounds the target verifies, their draft tokens and the drafts a greedy
        target accepts by the replay's plan (comparable with vLLM's spec-decode counters), and the
        requests (and their rounds) not in the recording or that left it. Reads the device."""
        return self.lookup.stats()
