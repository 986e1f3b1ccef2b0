"""The H-Spec proposer inside vLLM 0.26's V1 model runner.

Inside vLLM an H-Spec draft runs as method "dflash" (see ``engine/config.py``), so the runner already
does what H-Spec needs: it asks the target for the inputs of the drafter's selected layers
(auxiliary hidden states), allots the block's parallel-drafting slots, handles rejected tokens with
the padded drafter batch, and calls ``propose`` with the target's hidden states and attention
metadata. ``HSpecProposer`` replaces what differs from DFlash:

* no context K/V is projected or stored: the Mamba initial state comes from the last accepted
  token's auxiliary hidden states, and attention reads the target's own paged cache;
* one forward drafts the whole block (``HSpecForVLLM.draft``), then the Markov head picks the
  tokens position by position;
* each round's per-token top-1 probability and entropy stay on device in ``last_draft`` (rows in
  the runner's input-batch order) for the length policy: with ``"hybridspec"`` options the
  ``length_selector`` (``engine/length/selector.py``) picks how many drafts of each row the target verifies, and
  the batch gate can skip drafting for a step.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_hybridspec.drafter.layers import DraftBlock
from vllm_hybridspec.engine.compat import is_hspec_speculative_config
from vllm_hybridspec.engine.drafting.graphs import DraftGraphs, batch_buckets, drafter_graphs_enabled
from vllm_hybridspec.engine.gdn.enable import on_vllm_gdn_path
from vllm_hybridspec.engine.length.capture import RoundCapture
from vllm_hybridspec.engine.length.cut import attach_cut
from vllm_hybridspec.engine.length.gate import sync_scheduler
from vllm_hybridspec.engine.length.selector import (
    BudgetCache,
    LengthSelector,
    RoundLayout,
    draft_signals,
    remaining_budget,
)
from vllm_hybridspec.engine.options import hybridspec_options
from vllm_hybridspec.engine.runner_state import state_of


# Proposers that stand in for H-Spec's on an engine they claim, registered by their feature
# (plugin.register: engine/replay/'s replayed acceptance): (claims(vllm_config) -> bool, class).
SUBSTITUTES: list[tuple] = []


def register_substitute(claims, proposer_class) -> None:
    """Build ``proposer_class`` (an ``HSpecProposer``) instead of ``HSpecProposer`` for an H-Spec engine whose
    ``VllmConfig`` ``claims`` (idempotent)."""
    if not issubclass(proposer_class, HSpecProposer):
        raise TypeError(f"{proposer_class} must subclass HSpecProposer")
    if (claims, proposer_class) not in SUBSTITUTES:
        SUBSTITUTES.append((claims, proposer_class))


class RunnerDFlashProposer(DFlashProposer):
    """What ``vllm.v1.worker.gpu_model_runner`` constructs as ``DFlashProposer`` once the plugin is
    loaded: vLLM's DFlash proposer, or ``HSpecProposer`` when the draft is an H-Spec checkpoint.

    For a DFlash draft with ``"hybridspec"`` options this is a small adapter: the draft
    logits it computes anyway give each token's top-1 probability and entropy (no second lm-head
    pass), and the length selector cuts the draft as for H-Spec. DFlash keeps context K/V of its
    own, so a round the batch gate turns off still runs the drafter (as vLLM's dynamic speculative
    decoding does) and only verifies nothing."""

    def __new__(cls, vllm_config: VllmConfig, device: torch.device, runner=None):
        if cls is not RunnerDFlashProposer or not is_hspec_speculative_config(vllm_config.speculative_config):
            return object.__new__(cls)
        for claims, substitute in SUBSTITUTES:  # benchmarking only (engine/replay/)
            if claims(vllm_config):
                return object.__new__(substitute)
        return object.__new__(HSpecProposer)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        options = hybridspec_options(vllm_config)
        # where each round's decisions go (RunnerState.round); none for an engine without "hybridspec" options
        self.runner_state = None if runner is None or options is None else state_of(runner)
        self.length_selector = None
        if options is not None:
            self.length_selector = LengthSelector(
                options, self.num_speculative_tokens, device, vllm_config.scheduler_config.max_num_seqs,
                verifies_every_draft=on_vllm_gdn_path(vllm_config))
            if runner is not None:
                self.runner_state.selector = self.length_selector
                cut = attach_cut(runner)
                if self.length_selector.routes:  # Stage 0 at the first MoE router (engine/length/cut.py)
                    cut.enable_routing(self.length_selector.policy.experts_per_token,
                                       runner.compilation_config.static_all_moe_layers)
                    self.length_selector.stage0_ready = True
                self.length_selector.on_configure = lambda sel: sync_scheduler(vllm_config, sel)
        self._signals: tuple[torch.Tensor, torch.Tensor] | None = None  # [N * K] top-1 prob, entropy
        self._budget = BudgetCache()  # the rows' budget ends on the device, kept while the batch holds
        self.round_capture = None  # calibration records, with "hybridspec": {"capture": path}
        if options is not None and options.capture is not None:
            self.round_capture = RoundCapture(options.capture, self.num_speculative_tokens)
            if runner is not None:
                self.runner_state.capture = self.round_capture
                self.round_capture.bind_routers(runner.compilation_config.static_all_moe_layers, runner.max_num_tokens)

    def _records_signals(self) -> bool:
        wanted = self.round_capture is not None or (self.length_selector is not None and self.length_selector.trims)
        return wanted and not self.use_local_argmax_reduction and not self.use_heterogeneous_vocab

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self._records_signals():
            return super()._greedy_sample(hidden_states)
        logits = self.model.compute_logits(hidden_states)  # [N * K, vocab], request-major
        self._signals = draft_signals(logits)
        return logits.argmax(dim=-1)

    def _sample_from_logits(self, logits: torch.Tensor, sampling_metadata):
        if self._records_signals():
            self._signals = draft_signals(logits)
        return super()._sample_from_logits(logits, sampling_metadata)

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None) -> torch.Tensor:
        selector = self.length_selector
        cad = common_attn_metadata
        N = cad.batch_size()
        prefix_lens = cad.seq_lens[:N]  # [N] cached tokens up to the last accepted one
        if num_rejected_tokens_gpu is not None:
            prefix_lens = prefix_lens - num_rejected_tokens_gpu[:N]
        self._signals = None
        drafts = super().propose(
            num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, cad, sampling_metadata, mm_embed_inputs=mm_embed_inputs,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings)
        k = drafts.shape[1]
        signals = None
        if k > 0 and self._signals is not None:
            signals = tuple(x.view(-1, k)[:N] for x in self._signals)  # [N, K] top-1 prob, entropy
        if selector is not None and k > 0 and not selector.speculate(N):  # the gate, decided after the round
            self._after_round(drafts, signals, prefix_lens, select=False)
            return self._hold(drafts, selector.gated(drafts))
        return self._hold(drafts, self._after_round(drafts, signals, prefix_lens))

    def _after_round(self, drafts: torch.Tensor, signals: tuple[torch.Tensor, torch.Tensor] | None,
                     prefix_lens: torch.Tensor, select: bool = True) -> RoundLayout | None:
        """What every drafting round ends with, for vLLM's DFlash drafter and H-Spec alike: the round's
        drafts ``[N, K]`` and their signals (top-1 probability and entropy ``[N, K]``, or ``None`` where
        the round has none) go to the calibration capture and, with ``select``, to the length selector;
        the requests' remaining budgets are computed once for both. Returns the selector's
        :class:`RoundLayout`, or ``None`` where it selected nothing (every draft is verified)."""
        capture, selector = self.round_capture, self.length_selector
        if capture is not None and signals is None:
            capture.skipped()
        selects = select and selector is not None and selector.trims and signals is not None
        if signals is None or (capture is None and not selects):
            return None
        w_rem = remaining_budget(self.runner, prefix_lens, drafts.shape[1], self._budget)  # [N]
        if capture is not None:
            capture.drafted(self.runner, *signals, w_rem)
        if not selects:
            return None
        return selector.select(drafts, *signals, w_rem, self.runner.input_batch.req_ids)

    def _hold(self, drafts: torch.Tensor, round: RoundLayout | None) -> torch.Tensor:
        """The round's decisions to the runner's state (``RunnerState.round``, read by the step that verifies
        ``drafts``; ``None``: it verifies every draft); returns ``drafts``, for vLLM."""
        if self.runner_state is not None:
            self.runner_state.round = round
        return drafts


def spread_drafts(block: DraftBlock, anchors: torch.Tensor, vocab_size: int) -> DraftBlock:
    """Benchmarks only (``hybridspec spec-steps --drafts spread``): the round's draft tokens replaced by
    ids that differ at every position of a row, and between rows of one anchor (a hash of the anchor,
    the position and the row), the signals kept. With dummy weights the drafter drafts one id at every position, so a verification
    step's tokens all take one token's experts; distinct ids route as distinct tokens do, and the
    step reads the experts that ``w`` tokens of text would reach (at most: random ids are less alike
    than text). A greedy target rejects them, as it rejects a dummy drafter's."""
    N, K = block.tokens.shape
    device = block.tokens.device
    offsets = (torch.arange(1, K + 1, device=device) * 104729)[None, :] + (
        torch.arange(N, device=device) * 15485863)[:, None]  # [N, K]
    tokens = (anchors.long()[:, None] * 7919 + offsets) % vocab_size
    return DraftBlock(tokens, block.top1_prob, block.entropy)


class HSpecProposer(RunnerDFlashProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.last_draft: DraftBlock | None = None  # [num_reqs, K] tokens, top1_prob, entropy
        self.draft_graphs: DraftGraphs | None = None  # set by load_model on a GPU
        self.eager_rounds = 0  # rounds drafted without a replayed graph (all of them without graphs)
        self.spread_drafts = False  # benchmarks only (spec-steps --drafts spread): see spread_drafts()

    # --- loading ---------------------------------------------------------------------------------------

    def load_model(self, target_model: torch.nn.Module) -> None:
        cache_dtype = str(self.vllm_config.cache_config.cache_dtype)
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"the H-Spec drafter reads the target's KV cache as model-dtype K/V; kv_cache_dtype="
                f"{cache_dtype!r} is not supported yet (use 'auto')"
            )
        super().load_model(target_model)
        self.model.upcast_ssm_parameters()  # after loading: the per-round float32 reads become no-ops
        options = hybridspec_options(self.vllm_config)
        if options is not None and options.drafter_compile:
            self.model.compile_layers()
        if options is not None and options.drafter_fused_norms and self.device.type == "cuda":
            from vllm_hybridspec.drafter.fused import fuse_norms

            fuse_norms(self.model)
        if options is not None and options.drafter_grouped_attention and self.device.type == "cuda":
            from vllm_hybridspec.drafter.attention import use_grouped_attention

            use_grouped_attention(self.model)
        if options is not None:
            self.model.candidate_heads = options.drafter_candidate_heads
        self.draft_graphs = None
        if drafter_graphs_enabled(self.vllm_config, self.device):
            self.draft_graphs = DraftGraphs(self.model, batch_buckets(self.vllm_config.scheduler_config.max_num_seqs))

    def _maybe_share_embeddings(self, target_language_model: torch.nn.Module) -> None:
        self.model.embed_tokens = target_language_model.model.embed_tokens

    def _maybe_share_lm_head(self, target_language_model: torch.nn.Module) -> None:
        self.model.target_compute_logits = target_language_model.compute_logits

    # --- drafting --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self,
        num_speculative_tokens,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,  # [num_tokens, n_selected * hidden], the selected layers' inputs
        next_token_ids: torch.Tensor,  # [num_reqs], the anchors (the target's bonus tokens)
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        cad = common_attn_metadata
        N = cad.batch_size()
        self.num_speculative_tokens = num_speculative_tokens
        if num_speculative_tokens == 0:
            self.last_draft = None
            if self.round_capture is not None:
                self.round_capture.skipped()
            return self._hold(torch.empty(N, 0, dtype=torch.int64, device=self.device), None)
        selector = self.length_selector
        if selector is not None and not selector.speculate(N):
            # the drafter keeps no state of its own, so a skipped round costs nothing later
            self.last_draft = None
            drafts = torch.zeros(N, num_speculative_tokens, dtype=torch.int64, device=self.device)
            return self._hold(drafts, selector.gated(drafts))
        # the last accepted token of each request and the length of its cached prefix; in the padded
        # drafter batch the rejected drafts are still counted in query_start_loc and seq_lens
        last = cad.query_start_loc[1 : N + 1] - 1  # [N]
        prefix_lens = cad.seq_lens[:N]  # [N]
        if num_rejected_tokens_gpu is not None:
            last = last - num_rejected_tokens_gpu[:N]
            prefix_lens = prefix_lens - num_rejected_tokens_gpu[:N]
        # index_select takes int32 or int64 indices as they are (no conversion kernel)
        last_hidden = target_hidden_states.index_select(0, last)  # [N, n_selected * hidden]
        block = None
        if self.draft_graphs is not None:  # a replayed padded round (graphs.py), None if it has none
            block = self.draft_graphs.run(last_hidden, next_token_ids[:N], cad.block_table_tensor[:N], prefix_lens,
                                          cad.max_seq_len, num_speculative_tokens)
        if block is None:
            self.eager_rounds += 1
            prefix_kv = self.model.gather_prefix_kv(cad.block_table_tensor[:N], cad.max_seq_len, prefix_lens)
            block = self.model.draft(last_hidden, next_token_ids[:N], prefix_kv, prefix_lens, num_speculative_tokens)
        block = self._draft_block(block, next_token_ids[:N], prefix_lens)
        if self.spread_drafts:
            block = spread_drafts(block, next_token_ids[:N], self.vllm_config.model_config.get_vocab_size())
        self.last_draft = block
        return self._hold(block.tokens, self._after_round(block.tokens, (block.top1_prob, block.entropy), prefix_lens))

    def _draft_block(self, block: DraftBlock, anchors: torch.Tensor, prefix_lens: torch.Tensor) -> DraftBlock:
        """The round's drafts as the length selector, the capture and the runner see them: the drafter's
        own; the replay benchmark's subclass (``engine/replay/proposer.py``) puts replayed ones in."""
        return block

    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """A drafting round of ``num_tokens // (K + 1)`` one-token requests, for memory profiling and
        warm-up. Nothing is captured here: the drafter's graphs (``graphs.py``) are captured at
        the first round of each batch size and prefix capacity, which only serving knows."""
        if is_graph_capturing:
            return
        K = self.num_speculative_tokens
        N = max(1, min(self.max_batch_size, num_tokens // (K + 1)))
        n_selected = len(self.model.config.aux_hidden_state_layer_ids)
        last_hidden = torch.zeros(N, n_selected * self.hidden_size, dtype=self.dtype, device=self.device)
        anchors = torch.zeros(N, dtype=torch.long, device=self.device)
        prefix_lens = torch.ones(N, dtype=torch.int32, device=self.device)
        block_table = torch.zeros(N, 1, dtype=torch.int32, device=self.device)
        prefix_kv = self.model.gather_prefix_kv(block_table, 1)
        self.model.draft(last_hidden, anchors, prefix_kv, prefix_lens, K)


# --- the wrapper (a row of engine/patches/table.py) ------------------------------------------------------


def h_spec_on_the_v1_runner(original):
    """The wrapper of ``vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features``
    (``engine/patches/table.py``; the row that replaces the runner's name ``DFlashProposer`` by
    :class:`RunnerDFlashProposer` sits beside it).

    Why: dense targets default to the V2 model runner on GPUs, whose speculators are chosen by
    ``vllm.v1.worker.gpu.spec_decode.init_speculator`` (method "dflash" would get V2's DFlash
    speculator). H-Spec is implemented for the V1 runner, the one hybrid targets use; listing it as
    unsupported makes vLLM fall back to V1 with its usual warning (or raise its usual error when
    ``VLLM_USE_V2_MODEL_RUNNER=1`` forces V2)."""
    def _get_v2_model_runner_unsupported_features(self):
        unsupported = original(self)
        if is_hspec_speculative_config(self.speculative_config):
            unsupported.append("H-Spec speculative decoding (vllm-hybridspec runs it in the V1 runner)")
        return unsupported

    return _get_v2_model_runner_unsupported_features
