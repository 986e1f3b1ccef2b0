"""CUDA graphs of the H-Spec drafting round.

A round (``HSpecForVLLM.gather_prefix_kv`` + ``HSpecForVLLM.draft``: the prefix K/V read from the
target's paged cache, the drafter's layers, the heads) is a few hundred small kernels. Run eagerly,
its host time exceeds its GPU time at every size the drafter is meant for. On the H200 the eager
round added about 5 ms per step where vLLM's CUDA-graphed DFlash drafter added 0.4 ms
(``docs/benchmarks/h200-2026-11-29b``). ``DraftGraphs`` replays a captured round instead.

A graph has fixed shapes, so a round runs on a padded batch:

* ``N`` requests are padded to the next size of ``batch_sizes``. The padding rows are independent
  of the real ones, and their drafts are dropped.
* The prefix capacity (``max_seq_len`` of the batch) is padded to the next power of two, at least
  ``MIN_CAPACITY`` and at most the block table's reach. The padding keys lie at positions
  ``>= prefix_len`` of every request, which the drafter's mask already excludes. This is the
  mechanism the eager round uses for requests shorter than the longest one.

A round therefore drafts the same tokens as the eager round of the unpadded batch, up to
floating-point reduction order (matmuls of another row count may take other kernels). The drafts
only decide what the target verifies, so exactness does not depend on them.

Memory: all graphs share one private pool, which holds about one padded round's activations (the
prefix K/V gather dominates: ``N_pad x capacity_pad x KV heads x head_dim x 2`` per drafter attention
layer) for the engine's lifetime. vLLM's memory profiling does not see it (its drafter dummy run uses
a one-slot prefix), so it comes out of the headroom ``gpu_memory_utilization`` leaves. A padded round
that does not fit runs unpadded and eagerly instead. Captures happen while serving, each with a
device sync: a latency blip on the first round of each shape.

Graphs are captured lazily, on the first round of each ``(batch size, capacity, K)`` key. An eager
warm-up of the same shapes runs first (it compiles and autotunes the Triton kernels and creates the
drafter's cached constants). All graphs share one memory pool. Anything that fails during capture
makes that key run eagerly from then on, with a warning; the engine is never stopped for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vllm_hybridspec.drafter.layers import DraftBlock

logger = logging.getLogger(__name__)

MIN_CAPACITY = 64
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, *range(384, 4097, 128))
CAPACITY_STEP = 4096  # past this, capacities are padded to a multiple of it instead of a power of two
MAX_GRAPHS = 64


def drafter_graphs_enabled(vllm_config, device) -> bool:
    """Graphs for the drafting round: on a CUDA device, unless the engine runs eagerly
    (``enforce_eager``, ``cudagraph_mode`` NONE) or ``"hybridspec": {"drafter_cudagraphs": false}``."""
    from vllm_hybridspec.engine.options import hybridspec_options

    options = hybridspec_options(vllm_config)
    if options is not None and not options.drafter_cudagraphs:
        return False
    if torch.device(device).type != "cuda" or vllm_config.model_config.enforce_eager:
        return False
    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is None or getattr(mode, "name", str(mode)) != "NONE"


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """``DEFAULT_BATCH_SIZES`` up to the engine's ``max_num_seqs``, which is always a bucket."""
    return tuple(sorted({s for s in DEFAULT_BATCH_SIZES if s < max_num_seqs} | {max_num_seqs}))


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size ``>= n``, or ``None`` past the largest."""
    for s in sizes:
        if s >= n:
            return s
    return None


def capacity_bucket(capacity: int, max_capacity: int) -> int:
    """The next power of two ``>= capacity`` (at least ``MIN_CAPACITY``) up to ``CAPACITY_STEP``, the
    next multiple of ``CAPACITY_STEP`` past it (at most 1.5x ... 2x padding, fewer graphs and less padded
    memory for long contexts), capped at ``max_capacity`` (the block table's reach), which is returned
    for anything larger."""
    if capacity > CAPACITY_STEP:
        c = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
    else:
        c = MIN_CAPACITY
        while c < capacity:
            c *= 2
    return min(c, max_capacity) if capacity <= max_capacity else max_capacity


@dataclass
class _Round:
    """One key's static inputs, outputs and graph (``graph`` is ``None`` for a padded eager round)."""

    last_hidden: torch.Tensor  # [N_pad, n_sel * hidden]
    anchors: torch.Tensor  # [N_pad] long
    prefix_lens: torch.Tensor  # [N_pad] int32
    block_table: torch.Tensor  # [N_pad, width] int32
    capacity: int
    num_draft: int
    out: DraftBlock | None = None
    graph: torch.cuda.CUDAGraph | None = None


class DraftGraphs:
    """Padded, graph-replayed drafting rounds for one ``HSpecForVLLM``.

    ``capture=False`` runs the padded rounds eagerly: the same inputs, padding and outputs without
    ``torch.cuda.CUDAGraph``. Tests use it on the CPU to check that padding changes no draft."""

    def __init__(self, model, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, capture: bool = True,
                 max_graphs: int = MAX_GRAPHS):
        self.model = model
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.capture = capture
        self.max_graphs = max_graphs
        self.rounds: dict[tuple, _Round] = {}
        self.eager_keys: set[tuple] = set()  # keys whose capture failed
        self.pool = None
        self.replays = 0
        self.captures = 0

    def key(self, n: int, capacity: int, num_draft: int, block_table: torch.Tensor) -> tuple | None:
        """``(N_pad, capacity_pad, K, width)``, or ``None`` when the round must run unpadded (too many
        requests, no KV cache bound yet, or a capacity past the block table's reach)."""
        n_pad = bucket(n, self.batch_sizes)
        width = block_table.shape[1]
        if n_pad is None:
            return None
        if not self.model.kv_readers:  # no drafter attention: the prefix is never read
            return n_pad, 0, num_draft, width
        block_size = self.model.prefix_block_size()
        if block_size is None or capacity > width * block_size:
            return None
        return n_pad, capacity_bucket(capacity, width * block_size), num_draft, width

    def run(self, last_hidden: torch.Tensor, anchors: torch.Tensor, block_table: torch.Tensor,
            prefix_lens: torch.Tensor, capacity: int, num_draft: int) -> DraftBlock | None:
        """The drafts of ``N = anchors.shape[0]`` requests (fresh tensors ``[N, K]``), or ``None``
        when this round has no graph and the caller should run it eagerly."""
        n = anchors.shape[0]
        key = self.key(n, capacity, num_draft, block_table)
        if key is None or key in self.eager_keys:
            return None
        r = self.rounds.get(key)
        if r is None:
            if len(self.rounds) >= self.max_graphs:
                return None
            r = self.rounds[key] = self._new_round(key, last_hidden, block_table.dtype)
        r.last_hidden[:n].copy_(last_hidden)
        r.anchors[:n].copy_(anchors)
        r.prefix_lens[:n].copy_(prefix_lens)
        r.block_table[:n].copy_(block_table)
        if r.out is None or (self.capture and r.graph is None):
            if not self._prepare(key, r):
                return None
        elif r.graph is not None:
            r.graph.replay()
            self.replays += 1
        else:
            r.out = self._round(r)
        return DraftBlock(r.out.tokens[:n].clone(), r.out.top1_prob[:n].clone(), r.out.entropy[:n].clone())

    def _new_round(self, key: tuple, last_hidden: torch.Tensor, table_dtype: torch.dtype) -> _Round:
        n_pad, cap, num_draft, width = key
        device = last_hidden.device
        return _Round(
            last_hidden=torch.zeros(n_pad, last_hidden.shape[1], dtype=last_hidden.dtype, device=device),
            anchors=torch.zeros(n_pad, dtype=torch.long, device=device),
            prefix_lens=torch.zeros(n_pad, dtype=torch.int32, device=device),
            block_table=torch.zeros(n_pad, width, dtype=table_dtype, device=device),
            capacity=cap, num_draft=num_draft)

    def _round(self, r: _Round) -> DraftBlock:
        prefix_kv = self.model.gather_prefix_kv(r.block_table, r.capacity, r.prefix_lens)
        return self.model.draft(r.last_hidden, r.anchors, prefix_kv, r.prefix_lens, r.num_draft)

    def _prepare(self, key: tuple, r: _Round) -> bool:
        """First round of a key: an eager padded round (its outputs are this round's drafts), then,
        with ``capture``, the graph for the next rounds. False (and the key eager from then on) when
        the capture fails."""
        if self.capture:
            # graphs read the cached arange: size it to the block table's reach before any capture,
            # so no later round has to grow it (a grown one is kept alive anyway, see _arange)
            self.model._arange(max(key[1], key[3] * (self.model.prefix_block_size() or 1)), r.anchors.device)
        try:
            r.out = self._round(r)
        except torch.cuda.OutOfMemoryError as e:  # the padded round does not fit: run unpadded rounds
            logger.warning("H-Spec drafter: the padded round for batch %d, capacity %d does not fit in memory "
                           "(%s); these rounds run eagerly", key[0], key[1], e)
            self.eager_keys.add(key)
            del self.rounds[key]
            torch.cuda.empty_cache()
            return False
        if not self.capture:
            return True
        constants = dict(self.model._constants)
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._round(r)
            if {k: id(v) for k, v in self.model._constants.items()} != {k: id(v) for k, v in constants.items()}:
                # a constant made inside the capture would hold values only a replay writes
                self.model._constants = constants
                raise RuntimeError("the drafter created a cached constant during capture")
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this key eagerly
            logger.warning("H-Spec drafter: no CUDA graph for batch %d, capacity %d, K %d (%s: %s); "
                           "these rounds run eagerly", key[0], key[1], key[2], type(e).__name__, e)
            self.eager_keys.add(key)
            del self.rounds[key]
            return True
        # the eager round's drafts stay this round's answer; the graph's buffers hold the next ones
        eager_out = r.out
        r.out, r.graph = out, graph
        self.captures += 1
        r.out.tokens[: eager_out.tokens.shape[0]].copy_(eager_out.tokens)
        r.out.top1_prob[: eager_out.tokens.shape[0]].copy_(eager_out.top1_prob)
        r.out.entropy[: eager_out.tokens.shape[0]].copy_(eager_out.entropy)
        return True
