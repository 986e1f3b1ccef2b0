"""CUDA graphs of the one-slot GDN layer's verification (issue 6).

Under vLLM's piecewise CUDA graphs the GDN core op is a splitting op: it runs eagerly between the
graph pieces. For a spec step, the one-slot layer's part of it is about 25 small operations: the
convolution of the spec rows from the pool's windows, the verify kernel, and copies. At the
Qwen3.6-35B-A3B shape a spec step took 40-48 ms at every verification length, against 6.8 ms for a
step without drafts, while the verify kernels of all 30 layers take under 0.3 ms
(``docs/benchmarks/h200-2026-12-01``). ``SpecCoreGraphs`` replays each layer's verification from a
CUDA graph instead.

A graph has fixed shapes, so a round runs padded:

* ``Ns`` spec sequences are padded to the next size of ``batch_sizes``. Padding sequences have
  length 0 and state slot 0 (vLLM's null block), and the verify kernel skips both.
* Tokens are padded to ``Ns_pad * U``, with ``U = num_speculative_tokens + 1`` the kernel's
  compile-time round length. Padding tokens lie past the last sequence's end, and no real token's
  convolution or verification reads them.

Outputs, factors and pre-conv inputs live in static buffers of the layer, sized once for the largest
bucket: what the commit after rejection sampling reads, valid until the layer's next forward.
Per layer that is ``Ns_max * U * (4 (HV V + HK K + HV) + 2 conv_dim + 2 HV V)`` bytes at bf16, about
12 MB at the 35B shape with ``Ns_max = 32`` (the largest bucket, at most ``max_num_seqs``), ``U = 8``:
about 380 MB for 30 layers, allocated at the first spec round, after vLLM has sized the KV cache, so
it comes out of the headroom ``gpu_memory_utilization`` leaves. Larger batches run eagerly.

Opt-in (``"hybridspec": {"gdn_cudagraphs": true}``) until ``examples/gpu_session.sh gdn-graphs`` has
checked on a GPU that the replayed rounds give the eager rounds' outputs. Its first attempt, on
2026-12-01, ran out of device time during the engine start.

Graphs are captured lazily, one per ``Ns_pad``. The first round of each size runs eagerly on the
static buffers, which compiles the kernels; the capture follows it. All layers' graphs share one
memory pool. A failed capture makes that size eager from then on, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from vllm_hybridspec.engine.compat import wrap_once

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
_POOL: list = []  # one graph memory pool for every layer's graphs (replayed one after another)


def gdn_graphs_enabled(vllm_config, device) -> bool:
    """Graphs for the one-slot verification: with ``"hybridspec": {"gdn_cudagraphs": true}``, on a CUDA
    device, unless the engine runs eagerly (``enforce_eager``, ``cudagraph_mode`` NONE). Opt-in: the
    padding is tested on the CPU, but no GPU run has checked the captured graphs yet
    (``examples/gpu_session.sh gdn-graphs`` is that check)."""
    from vllm_hybridspec.engine.options import hybridspec_options

    options = hybridspec_options(vllm_config)
    if options is None or not options.gdn_cudagraphs:
        return False
    if torch.device(device).type != "cuda" or vllm_config.model_config.enforce_eager:
        return False
    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is None or getattr(mode, "name", str(mode)) != "NONE"


@dataclass
class _Static:
    """One layer's static buffers, for the largest bucket; a round of ``Ns_pad`` uses prefixes."""

    x: torch.Tensor  # [T_max, conv_dim] pre-conv inputs (model dtype)
    b: torch.Tensor  # [T_max, HV]
    a: torch.Tensor  # [T_max, HV]
    slots: torch.Tensor  # [Ns_max] int32
    cu: torch.Tensor  # [Ns_max + 1] int32
    out: torch.Tensor  # [T_max, HV, V]
    factors: object  # VerifyFactors [T_max, ...]
    graphs: dict = field(default_factory=dict)  # Ns_pad -> torch.cuda.CUDAGraph


class SpecCoreGraphs:
    """Padded, graph-replayed verification rounds for one ``HSpecQwenGDN`` layer.

    ``capture=False`` runs the padded rounds eagerly on the static buffers: the same padding and
    outputs without ``torch.cuda.CUDAGraph``. Tests use it on the CPU."""

    def __init__(self, layer, max_len: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
                 capture: bool = True):
        self.layer = layer
        self.max_len = max_len  # U
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.capture = capture
        self.static: _Static | None = None
        self.eager_sizes: set[int] = set()
        self.replays = 0
        self.captures = 0

    def bucket(self, ns: int) -> int | None:
        for s in self.batch_sizes:
            if s >= ns:
                return s
        return None

    def run(self, layout, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """``(o [T, HV, V], factors [T, ...], x [T, conv_dim])`` for the ``T`` spec tokens of
        ``layout`` (views of static buffers), or ``None`` when this round runs eagerly instead."""
        ns, T = len(layout.slots), x.shape[0]
        ns_pad = self.bucket(ns)
        if ns_pad is None or ns_pad in self.eager_sizes or layout.max_len > self.max_len:
            return None
        if self.capture and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None  # inside someone else's capture (vLLM's): run eagerly, inside it
        s = self.static
        if s is None:
            s = self.static = self._allocate(x, b, a)
        t_pad = ns_pad * self.max_len
        s.x[:T].copy_(x)
        s.b[:T].copy_(b)
        s.a[:T].copy_(a)
        s.slots[:ns].copy_(layout.slots_dev)
        s.slots[ns:ns_pad].zero_()
        s.cu[: ns + 1].copy_(layout.cu_dev)
        s.cu[ns + 1: ns_pad + 1].fill_(T)
        graph = s.graphs.get(ns_pad)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self._core(s, ns_pad, t_pad)  # eager: compiles the kernels, and is this round's answer
            if self.capture:
                self._capture(s, ns_pad, t_pad)
        from vllm_hybridspec.kernels.gdn import VerifyFactors

        f = s.factors
        return s.out[:T], VerifyFactors(f.z[:T], f.k[:T], f.g_cum[:T]), s.x[:T]

    def _allocate(self, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> _Static:
        from vllm_hybridspec.kernels.gdn import VerifyFactors

        layer = self.layer
        tp = layer.tp_size
        hk, hv = layer.num_k_heads // tp, layer.num_v_heads // tp
        k, v = layer.head_k_dim, layer.head_v_dim
        ns_max = self.batch_sizes[-1]
        t_max = ns_max * self.max_len
        device = x.device
        return _Static(
            x=torch.zeros(t_max, x.shape[1], dtype=x.dtype, device=device),
            b=torch.zeros(t_max, b.shape[1], dtype=b.dtype, device=device),
            a=torch.zeros(t_max, a.shape[1], dtype=a.dtype, device=device),
            slots=torch.zeros(ns_max, dtype=torch.int32, device=device),
            cu=torch.zeros(ns_max + 1, dtype=torch.int32, device=device),
            out=torch.zeros(t_max, hv, v, dtype=x.dtype, device=device),
            factors=VerifyFactors.empty(t_max, hk, hv, k, v, device))

    def _core(self, s: _Static, ns_pad: int, t_pad: int) -> None:
        from vllm_hybridspec.kernels.gdn import VerifyFactors, gdn_verify

        layer = self.layer
        slots, cu = s.slots[:ns_pad], s.cu[: ns_pad + 1]
        conv_out = layer._spec_conv_rows(slots, cu, s.x[:t_pad])
        q, k, v = (t[0] for t in layer.rearrange_mixed_qkv(conv_out))  # [T_pad, H, D]
        f = s.factors
        gdn_verify(q, k, v, g=s.a[:t_pad], beta=s.b[:t_pad], A_log=layer.A_log, dt_bias=layer.dt_bias,
                   state=layer.kv_cache[1], state_indices=slots, cu_seqlens=cu, max_len=self.max_len,
                   out=s.out[:t_pad], factors=VerifyFactors(f.z[:t_pad], f.k[:t_pad], f.g_cum[:t_pad]))

    def _capture(self, s: _Static, ns_pad: int, t_pad: int) -> None:
        try:
            if not _POOL:
                _POOL.append(torch.cuda.graph_pool_handle())
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=_POOL[0], capture_error_mode="thread_local"):
                self._core(s, ns_pad, t_pad)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run this size eagerly
            logger.warning("one-slot GDN layer %s: no CUDA graph for %d spec sequences (%s: %s); these rounds "
                           "run eagerly", self.layer.prefix, ns_pad, type(e).__name__, e)
            self.eager_sizes.add(ns_pad)
            return
        s.graphs[ns_pad] = graph
        self.captures += 1


def patch_plain_decode_full_graphs(wanted) -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._check_and_update_cudagraph_mode`` so that,
    for a runner where ``wanted(runner)`` holds, the runner and its ``CudagraphDispatcher`` treat only
    batches of one token per request as uniform decode batches (``uniform_decode_query_len = 1``).

    Why: with speculative decoding vLLM 0.26 sets ``uniform_decode_query_len = 1 + K`` in both
    (``GPUModelRunner.__init__``, ``CudagraphDispatcher.__init__``). Under FULL_AND_PIECEWISE it then
    captures full graphs for batches that verify K drafts per request, and runs everything else
    piecewise, including the steps where the batch gate turns drafting off. The one-slot GDN layer's
    verify cannot run inside a full graph, but its plain-decode steps can. With the length set to 1
    the full graphs hold plain decode steps only: the GDN builder sees no draft tokens in them and
    builds vLLM's own decode metadata (``build_for_cudagraph_capture``). Spec steps become non-uniform
    and run piecewise. This is called before vLLM resolves the graph mode and sizes and builds the
    dispatcher's keys, all from this value."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def _check_and_update_cudagraph_mode(self, *args, **kwargs):
            if wanted(self):
                self.uniform_decode_query_len = 1
                self.cudagraph_dispatcher.uniform_decode_query_len = 1
            return original(self, *args, **kwargs)

        return _check_and_update_cudagraph_mode

    wrap_once(GPUModelRunner, "_check_and_update_cudagraph_mode", make)
