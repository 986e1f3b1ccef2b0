"""A self-check of the one-slot GDN layer inside a running engine: with
``VLLM_HYBRIDSPEC_CHECK_ROUNDS=1`` every forward of the layer that verifies rounds outside a CUDA-graph
capture is recomputed with the torch references from a copy of the pool taken before it (the conv
window shifted by the pending inputs, vLLM's own torch decode convolution per round, then
``kernels.gdn.naive.commit_verify_``: Eq. 7 for the pending round, Eqs. 3 and 10 for the new one), and
the relative errors of the outputs, the committed states and the windows are logged with the step's
layout. It answers, on a GPU where a served comparison disagrees with plain decoding, whether the
layer computes what its layout says (kernels, conv, commit) or is handed the wrong layout.

It reads device tensors on the host (slow). With ``=1`` a forward replayed from a full CUDA graph is not
checked (nothing runs on the host then). With ``=graph`` every forward, captured ones included, copies
its inputs, outputs, layout and the touched states into per-shape device buffers (:class:`StepRecord`),
and after each step the host recomputes the last forward of each shape from them: this checks the
layer inside full graphs."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import torch

logger = logging.getLogger("vllm_hybridspec.gdn.check")

CHECK_ENV = "VLLM_HYBRIDSPEC_CHECK_ROUNDS"
LOGGED_STEPS = 40  # steps of the first layer logged in full; later only errors above TOLERANCE
TOLERANCE = 1e-4

_state = {"calls": 0, "worst": 0.0}


def check_enabled() -> bool:
    return os.environ.get(CHECK_ENV, "") not in ("", "0", "graph")


def any_check_enabled() -> bool:
    """Either check (``=1`` or ``=graph``): one environment read for the per-step hooks."""
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-12))


class RoundCheck:
    """Taken before the layer's commit and verification of one forward; :meth:`finish` after them."""

    def __init__(self, layer, layout):
        from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths

        self.active = not _capturing()
        if not self.active:
            return
        cpu = vllm_cpu_gdn_paths()
        self.conv = cpu.conv_view(layer).clone()  # [slots, conv_dim, W]
        self.state = layer.kv_cache[1].clone() if layer.kernels else layer.state_pool().clone()
        f = layer.factor_slabs
        self.slabs = type(f)(f.z.clone(), f.k.clone(), f.g_cum.clone())
        self.input_slab = layer.input_slab.clone()
        self.layout = {k: getattr(layout, k).clone() for k in
                       ("slots", "cu", "slab", "pending_entry", "pending_m", "target_entry")}

    def finish(self, layer, layout, x: torch.Tensor, b_s: torch.Tensor, a_s: torch.Tensor, out: torch.Tensor) -> None:
        if not self.active:
            return
        from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths
        from vllm_hybridspec.engine.gdn.commit import commit_conv_windows
        from vllm_hybridspec.kernels.gdn import commit_verify_, gdn_gating

        cpu = vllm_cpu_gdn_paths()
        lay = self.layout
        # the conv windows: the pending inputs shifted in, on copies (the layer's own function, whose
        # correctness the CPU tests establish, on a stand-in that owns the copies)
        shadow = SimpleNamespace(kv_cache=(self.conv.transpose(-1, -2) if not _dim_first() else self.conv,
                                           self.state),
                                 input_slab=self.input_slab, slab_len=layer.slab_len)
        commit_conv_windows(shadow, lay["slots"], lay["slab"], lay["pending_m"])
        conv_now = cpu.conv_view(layer)
        slots = lay["slots"].long()
        live = slots > 0
        err_window = _rel(conv_now[slots[live]], self.conv[slots[live]]) if bool(live.any()) else 0.0
        # vLLM's torch decode convolution, round by round, from the shifted windows
        weight = cpu.conv_weight(layer)
        conv_out = torch.zeros_like(x)
        cu, slot_list = lay["cu"].tolist(), lay["slots"].tolist()
        for i in range(len(slot_list)):
            s, e = cu[i], cu[i + 1]
            if e > s and slot_list[i] > 0:
                window = self.conv[slot_list[i]].clone()[None]
                conv_out[s:e] = cpu.conv_update(x[s:e].T[None], window, weight, layer.conv1d.bias,
                                                layer.activation)[0].T
        q, k, v = (t[0] for t in layer.rearrange_mixed_qkv(conv_out))
        g, beta = gdn_gating(layer.A_log, a_s, layer.dt_bias, b_s)
        ref = commit_verify_(q, k, v, g, beta, self.state, lay["slots"], lay["cu"], self.slabs, layer.slab_len,
                             lay["pending_entry"], lay["pending_m"], lay["target_entry"])
        rows = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
        for i in range(len(slot_list)):
            if slot_list[i] > 0:
                rows[cu[i]:cu[i + 1]] = True
        err_out = _rel(out[rows].float(), ref[rows].float()) if bool(rows.any()) else 0.0
        pool = layer.kv_cache[1] if layer.kernels else layer.state_pool()
        err_state = _rel(pool[slots[live]], self.state[slots[live]]) if bool(live.any()) else 0.0
        _report(f"hspec-check {layer.prefix}", layer.prefix, err_out, err_state, err_window,
                f"n={layout.n} spec={layout.num_spec} single={layout.num_single} U={layout.max_len} "
                f"T={layout.num_tokens} slots={slot_list} cu={cu} slab={lay['slab'].tolist()} "
                f"pending={lay['pending_entry'].tolist()} m={lay['pending_m'].tolist()} "
                f"target={lay['target_entry'].tolist()}")


def _report(what: str, prefix: str, err_out: float, err_state: float, err_window: float, layout: str) -> None:
    """Count a checked forward and log it: the first layer's first ``LOGGED_STEPS``, and any above
    ``TOLERANCE``."""
    worst = max(err_out, err_state, err_window)
    _state["worst"] = max(_state["worst"], worst)
    first = _state.get("first_layer") in (None, prefix)
    _state.setdefault("first_layer", prefix)
    if first:
        _state["calls"] += 1
    if (first and _state["calls"] <= LOGGED_STEPS) or worst > TOLERANCE:
        logger.warning("%s call %d: out %.2e state %.2e window %.2e (worst so far %.2e) | %s", what,
                       _state["calls"], err_out, err_state, err_window, _state["worst"], layout)


def _dim_first() -> bool:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return is_conv_state_dim_first()


def log_sampled(rounds, output_token_ids: torch.Tensor) -> None:
    """With the check on: each row's accepted count and the slab it goes to, for the log."""
    if not (check_enabled() or graph_check_enabled()) or _capturing() or _state["calls"] > LOGGED_STEPS:
        return
    n = output_token_ids.shape[0]
    counts = (output_token_ids != -1).sum(dim=1).tolist()
    logger.warning("hspec-check sampled: counts=%s row_slab=%s single=%s", counts,
                   rounds.plan_dev[3, :n].tolist(), rounds.plan_dev[4, :n].tolist())


# --- the same check inside CUDA graphs (VLLM_HYBRIDSPEC_CHECK_ROUNDS=graph) ---------------------------


def graph_check_enabled() -> bool:
    return os.environ.get(CHECK_ENV, "") == "graph"


def _buffer(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A record's buffer (inside a capture the fill is only recorded: the memory holds garbage until a
    replay, which the tests emulate by replacing this)."""
    return torch.zeros(shape, dtype=dtype, device=device)


MAX_RECORDS = 256  # record shapes per layer; later shapes go unchecked


def warm_step_records(layer) -> None:
    """With ``=graph``: the layer's record stamp counters, made now (the runner's dummy-run patch, outside
    any capture). vLLM builds spec-decode metadata only for captures, so a full-graph shape's record is
    first made inside one, where ``torch.zeros`` only records its fill: a stamp made there would hold
    whatever its memory held until the first replay, and :func:`check_recorded_steps` would read a
    record that nothing had refreshed (the H200 crash of ``docs/benchmarks/h200-2026-12-03``)."""
    if graph_check_enabled() and not _capturing() and "_record_stamps" not in layer.__dict__:
        layer._record_stamps = torch.zeros(MAX_RECORDS, dtype=torch.int64, device=layer.A_log.device)


class StepRecord:
    """Device snapshots of one layer's forward for one round layout shape ``(n, T)``: the slots' states
    and windows before and after, the pending rounds' factors and inputs, the forward's inputs and
    outputs and its layout, refreshed by pure device copies at every forward of that shape, so a
    forward replayed from a full CUDA graph refreshes them too. :meth:`check` recomputes the forward
    on the host from them and compares. ``stamp``, an element of the layer's counters made outside
    any capture (:func:`warm_step_records`), counts the forwards that refreshed them: a record made
    inside a capture is checked only once a replay has filled it."""

    def __init__(self, layer, n: int, T: int, x: torch.Tensor, out: torch.Tensor, stamp: torch.Tensor):
        from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths

        pool, conv = _pool(layer), vllm_cpu_gdn_paths().conv_view(layer)
        f, S, dev = layer.factor_slabs, layer.slab_len, pool.device

        def zeros(shape, dtype):
            return _buffer(tuple(shape), dtype, dev)

        self.n, self.T, self.S = n, T, S
        self.pool_before, self.pool_after = (zeros((n, *pool.shape[1:]), pool.dtype) for _ in range(2))
        self.conv_before, self.conv_after = (zeros((n, *conv.shape[1:]), conv.dtype) for _ in range(2))
        self.pz = zeros((n * S, *f.z.shape[1:]), f.z.dtype)
        self.pk = zeros((n * S, *f.k.shape[1:]), f.k.dtype)
        self.pg = zeros((n * S, *f.g_cum.shape[1:]), f.g_cum.dtype)
        self.inputs = zeros((n * S, layer.input_slab.shape[1]), layer.input_slab.dtype)
        self.x = zeros((T, x.shape[1]), x.dtype)
        self.out = zeros((T, *out.shape[1:]), out.dtype)
        self.b = zeros((T, out.shape[1]), x.dtype)
        self.a = zeros((T, out.shape[1]), x.dtype)
        self.ints = zeros((6, n + 1), torch.int32)  # slots, cu, slab, pending entry, pending m, target entry
        self.stamp = stamp
        self.seen = 0  # a fresh counter: nothing has advanced it yet

    def before(self, layer, layout) -> None:
        from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths

        n, S = self.n, self.S
        slots = layout.slots.long()
        self.pool_before.copy_(_pool(layer).index_select(0, slots))
        self.conv_before.copy_(vllm_cpu_gdn_paths().conv_view(layer).index_select(0, slots))
        offsets = torch.arange(S, device=slots.device)
        rows = (layout.pending_entry.clamp(min=0).long()[:, None] * S + offsets).reshape(-1)
        f = layer.factor_slabs
        self.pz.copy_(f.z.index_select(0, rows))
        self.pk.copy_(f.k.index_select(0, rows))
        self.pg.copy_(f.g_cum.index_select(0, rows))
        self.inputs.copy_(layer.input_slab.index_select(0, (layout.slab.long()[:, None] * S + offsets).reshape(-1)))
        for row, t in enumerate((layout.slots, layout.cu, layout.slab, layout.pending_entry, layout.pending_m,
                                 layout.target_entry)):
            self.ints[row, : t.shape[0]].copy_(t)

    def after(self, layer, layout, x, b_s, a_s, out) -> None:
        from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths

        T = self.T
        slots = layout.slots.long()
        self.x.copy_(x[:T])
        self.b.copy_(b_s[:T])
        self.a.copy_(a_s[:T])
        self.out.copy_(out[:T])
        self.pool_after.copy_(_pool(layer).index_select(0, slots))
        self.conv_after.copy_(vllm_cpu_gdn_paths().conv_view(layer).index_select(0, slots))
        self.stamp.add_(1)

    def check(self, layer) -> tuple[float, float, float, list] | None:
        """``(out, state, window)`` relative errors of the last forward recorded here against the torch
        references from its snapshots, and its layout rows; ``None`` if nothing was recorded since the
        last call."""
        from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths
        from vllm_hybridspec.engine.gdn.commit import commit_conv_windows
        from vllm_hybridspec.kernels.gdn import VerifyFactors, commit_verify_, gdn_gating

        stamp = int(self.stamp)
        if stamp == self.seen:
            return None
        self.seen = stamp
        n, S, dev = self.n, self.S, self.x.device
        ints = self.ints.tolist()
        slots, cu, pending, m = ints[0][:n], ints[1][: n + 1], ints[3][:n], ints[4][:n]
        live = [i for i in range(n) if slots[i] > 0 and cu[i + 1] > cu[i]]
        # a shadow pool of n + 1 slots (position i in slot i + 1), slabs of 2n entries (pending i, target n + i)
        state = torch.zeros((n + 1, *self.pool_before.shape[1:]), dtype=self.pool_before.dtype, device=dev)
        state[1:] = self.pool_before
        conv = torch.zeros((n + 1, *self.conv_before.shape[1:]), dtype=self.conv_before.dtype, device=dev)
        conv[1:] = self.conv_before
        shadow_slots = torch.tensor([i + 1 if i in live else 0 for i in range(n)], dtype=torch.int32, device=dev)
        pend = torch.tensor([i if pending[i] >= 0 else -1 for i in range(n)], dtype=torch.int32, device=dev)
        m_dev = torch.tensor(m, dtype=torch.int32, device=dev)
        shadow = SimpleNamespace(kv_cache=(conv if _dim_first() else conv.transpose(-1, -2), state),
                                 input_slab=self.inputs.clone(), slab_len=S)
        commit_conv_windows(shadow, shadow_slots, torch.arange(n, dtype=torch.int32, device=dev),
                            torch.where(pend >= 0, m_dev, 0))
        cpu = vllm_cpu_gdn_paths()
        weight = cpu.conv_weight(layer)
        conv_out = torch.zeros_like(self.x)
        for i in live:
            s, e = cu[i], cu[i + 1]
            conv_out[s:e] = cpu.conv_update(self.x[s:e].T[None], conv[i + 1].clone()[None], weight,
                                            layer.conv1d.bias, layer.activation)[0].T
        q, k, v = (t[0] for t in layer.rearrange_mixed_qkv(conv_out))
        g, beta = gdn_gating(layer.A_log, self.a, layer.dt_bias, self.b)
        f = layer.factor_slabs
        slabs = VerifyFactors(torch.cat([self.pz, torch.zeros_like(self.pz)]),
                              torch.cat([self.pk, torch.zeros_like(self.pk)]),
                              torch.cat([self.pg, torch.zeros_like(self.pg)]))
        del f
        ref = commit_verify_(q, k, v, g, beta, state, shadow_slots, torch.tensor(cu, dtype=torch.int32, device=dev),
                             slabs, S, pend, m_dev, torch.arange(n, 2 * n, dtype=torch.int32, device=dev))
        if not live:
            return 0.0, 0.0, 0.0, ints
        rows = torch.cat([torch.arange(cu[i], cu[i + 1], device=dev) for i in live])
        idx = torch.tensor(live, device=dev)
        err_out = _rel(self.out.index_select(0, rows).float(), ref.index_select(0, rows).float())
        err_state = _rel(self.pool_after.index_select(0, idx), state[1:].index_select(0, idx))
        err_window = _rel(self.conv_after.index_select(0, idx), conv[1:].index_select(0, idx))
        return err_out, err_state, err_window, ints


def _pool(layer) -> torch.Tensor:
    return layer.kv_cache[1] if layer.kernels else layer.state_pool()


def graph_record(layer, layout, x: torch.Tensor, out_like: torch.Tensor) -> StepRecord | None:
    """The layer's :class:`StepRecord` for this layout's shape, made at the first forward of that shape
    (inside a capture: from the graph's pool, kept alive by the layer; its stamp from the counters of
    :func:`warm_step_records`); ``None`` when no stamp is left."""
    records = layer.__dict__.setdefault("_step_records", {})
    key = (layout.n, layout.num_tokens)
    if key not in records:
        warm_step_records(layer)
        stamps = layer.__dict__.get("_record_stamps")
        if stamps is None or len(records) >= stamps.numel():
            return None  # no counter made outside a capture, or all taken: this shape goes unchecked
        records[key] = StepRecord(layer, layout.n, layout.num_tokens, x, out_like, stamps[len(records)])
    return records[key]


def check_recorded_steps(layers) -> None:
    """After a step (``VLLM_HYBRIDSPEC_CHECK_ROUNDS=graph``): every layer's records refreshed by it,
    checked and logged as :class:`RoundCheck` logs."""
    if not graph_check_enabled() or _capturing():
        return
    for layer in layers:
        for (n, T), record in getattr(layer, "_step_records", {}).items():
            result = record.check(layer)
            if result is None:
                continue
            err_out, err_state, err_window, ints = result
            _report(f"hspec-check (recorded) {layer.prefix} n={n} T={T}", layer.prefix, err_out, err_state,
                    err_window, f"slots={ints[0][:n]} cu={ints[1][: n + 1]} slab={ints[2][:n]} pending={ints[3][:n]} "
                    f"m={ints[4][:n]} target={ints[5][:n]}")
