"""Full CUDA graphs for uniform batches of fewer than ``K + 1`` tokens per request: the step the batch
gate turns off (``w = 1``), and any length ``"full_graph_lengths"`` lists.

vLLM 0.26 captures full graphs for uniform decode batches of exactly ``K + 1`` tokens per request
(``uniform_decode_query_len``) and runs every other batch piecewise. A selected length needs no graph
of its own (vLLM schedules every draft and the step cuts on the device, ``cut.py``), but a gated step
schedules one token per request. These patches capture, next to vLLM's own, full graphs for uniform
batches of ``w`` tokens per request for every ``w`` in :func:`graph_lengths` at the batch sizes of
:data:`BATCH_SIZES`, and dispatch each uniform step to the graph of its ``w``. Batches with
per-request lengths that differ stay piecewise.

vLLM 0.26 symbols wrapped (``vllm/v1/worker/gpu_model_runner.py``, ``vllm/v1/cudagraph_dispatcher.py``):

* ``GPUModelRunner._check_and_update_cudagraph_mode``: after vLLM has made its keys, the FULL keys
  ``BatchDescriptor(num_tokens = b w, num_reqs = b, uniform = True)`` of the extra lengths are added
  to the runner's ``CudagraphDispatcher`` (``add_cudagraph_key``), so ``capture_model`` captures them;
* ``GPUModelRunner._warmup_and_capture``: a capture of such a key runs its dummy batch with ``w``
  tokens per request (``uniform_decode_query_len = w`` for the call; ``_dummy_run`` reads it);
* ``GPUModelRunner._determine_batch_execution_and_padding``: a served batch whose rows all have ``w``
  tokens is a uniform batch of length ``w`` (``_is_uniform_decode`` compares with
  ``uniform_decode_query_len``, set to ``w`` for the call), and the mode it runs in is counted;
* ``CudagraphDispatcher.dispatch``: a uniform batch of an extra length is padded by requests
  (``b`` to the next batch size with a graph), not by tokens as vLLM pads its own, which only fits
  lengths that divide the token capture sizes.
"""

from __future__ import annotations

from vllm_hybridspec.engine.runner_state import existing_state, state_of

# batch sizes that get a graph at every extra length (as far as max_num_seqs and vLLM's largest
# capture size allow): dense where batches are small, coarser above
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def graph_lengths(vllm_config) -> tuple[int, ...]:
    """The verification lengths that get full graphs besides vLLM's ``K + 1``: ``w = 1``, a step the
    gate (or ``configure(drafting=False)``) turns off, which vLLM schedules without drafts; selected
    lengths need none, since vLLM schedules every draft and the step cuts on the device (``cut.py``).
    Or the lengths ``"full_graph_lengths"`` lists. Empty without ``"hybridspec"`` options, with
    ``"full_graph_lengths": false``, or without spec decoding."""
    from vllm_hybridspec.engine.options import hybridspec_options

    spec = vllm_config.speculative_config
    options = hybridspec_options(vllm_config)
    if spec is None or not spec.num_speculative_tokens or options is None or options.full_graph_lengths is False:
        return ()
    k = spec.num_speculative_tokens
    lengths = set(options.full_graph_lengths) if isinstance(options.full_graph_lengths, list) else {1}
    return tuple(sorted(w for w in lengths if 1 <= w < k + 1))


def length_keys(lengths, max_num_seqs: int, max_capture_size: int):
    """``(w, b)`` pairs that get a full graph: ``b`` in :data:`BATCH_SIZES` up to ``max_num_seqs`` with
    ``b * w <= max_capture_size`` (vLLM dispatches nothing larger to a graph)."""
    return [(w, b) for w in lengths for b in BATCH_SIZES if b <= max_num_seqs and b * w <= max_capture_size]


def add_length_keys(dispatcher, lengths, max_num_seqs: int) -> int:
    """Add the FULL keys of :func:`length_keys` to a ``CudagraphDispatcher`` whose keys vLLM has made;
    returns how many. Nothing without full decode graphs (``cudagraph_mode`` NONE or PIECEWISE) or
    with LoRA (whose keys carry adapter counts)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    mode = dispatcher.cudagraph_mode
    max_size = dispatcher.compilation_config.max_cudagraph_capture_size
    if (not lengths or mode == CUDAGraphMode.NONE or mode.decode_mode() != CUDAGraphMode.FULL
            or dispatcher.vllm_config.lora_config is not None or max_size is None):
        dispatcher.hspec_lengths = {}
        return 0
    table: dict[int, list[int]] = {}
    for w, b in length_keys(lengths, max_num_seqs, max_size):
        dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, BatchDescriptor(num_tokens=b * w, num_reqs=b, uniform=True))
        table.setdefault(w, []).append(b)
    dispatcher.hspec_lengths = table  # w -> batch sizes with a graph, ascending
    return sum(map(len, table.values()))


def _dispatch_by_length(original):
    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0, valid_modes=None,
                 invalid_modes=None):
        table = getattr(self, "hspec_lengths", None) or {}
        w = self.uniform_decode_query_len
        if uniform_decode and not has_lora and w in table:
            from vllm.config import CUDAGraphMode
            from vllm.forward_context import BatchDescriptor

            allowed = set(valid_modes or CUDAGraphMode.valid_runtime_modes()) - set(invalid_modes or ())
            b = -(-num_tokens // w)
            b_pad = next((s for s in table[w] if s >= b), None)
            if b_pad is not None and CUDAGraphMode.FULL in allowed:
                desc = BatchDescriptor(num_tokens=b_pad * w, num_reqs=b_pad, uniform=True)
                if desc in self.cudagraph_keys[CUDAGraphMode.FULL]:
                    return CUDAGraphMode.FULL, desc
        # a length of ours without a graph of its size runs piecewise; vLLM's own padding by tokens
        # would not divide into requests of w tokens
        return original(self, num_tokens, uniform_decode=uniform_decode and w not in table, has_lora=has_lora,
                        num_active_loras=num_active_loras, valid_modes=valid_modes, invalid_modes=invalid_modes)

    return dispatch


class _UniformLength:
    """``uniform_decode_query_len = w`` on the runner and its dispatcher for one call."""

    def __init__(self, runner, w: int):
        self.runner, self.w = runner, w

    def __enter__(self):
        self.saved = self.runner.uniform_decode_query_len
        self.runner.uniform_decode_query_len = self.runner.cudagraph_dispatcher.uniform_decode_query_len = self.w

    def __exit__(self, *exc):
        self.runner.uniform_decode_query_len = self.runner.cudagraph_dispatcher.uniform_decode_query_len = self.saved


def _lengths_of(runner) -> dict:
    return getattr(runner.cudagraph_dispatcher, "hspec_lengths", None) or {}


def _keys_per_length(original):
    # composed with engine/gdn/runner.py's wrapper of the same method in engine/patches/table.py: that one
    # acts before vLLM resolves the graph mode (a switch to PIECEWISE), this one after it (keys added to
    # the dispatcher vLLM made for the resolved mode)
    def _check_and_update_cudagraph_mode(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        add_length_keys(self.cudagraph_dispatcher, graph_lengths(self.vllm_config), self.scheduler_config.max_num_seqs)
        return result

    return _check_and_update_cudagraph_mode


def _capture_per_length(original):
    def _warmup_and_capture(self, desc, *args, **kwargs):
        w = desc.num_tokens // desc.num_reqs if desc.uniform and desc.num_reqs else None
        if w in _lengths_of(self):
            with _UniformLength(self, w):
                return original(self, desc, *args, **kwargs)
        return original(self, desc, *args, **kwargs)

    return _warmup_and_capture


def _uniform_per_length(original):
    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, *args, **kwargs):
        forced = kwargs.get("force_uniform_decode")
        w = max_num_scheduled_tokens
        uniform = forced if forced is not None else num_tokens == w * num_reqs
        if uniform and w in _lengths_of(self):
            with _UniformLength(self, w):
                result = original(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                                  *args, **kwargs)
        else:
            result = original(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                              *args, **kwargs)
        if forced is None:  # a served step, not a dummy run: count the mode it runs in
            state_of(self).graph_modes[(w if uniform else "mixed", num_reqs, result[0].name)] += 1
        return result

    return _determine_batch_execution_and_padding


def graph_mode_counts(runner) -> dict[str, int]:
    """Served steps per ``"w=<length or mixed> B=<requests> <FULL|PIECEWISE|NONE>"`` since the runner started."""
    state = existing_state(runner)
    counts = state.graph_modes if state is not None else {}
    return {f"w={w} B={b} {mode}": n for (w, b, mode), n in sorted(counts.items(), key=str)}
