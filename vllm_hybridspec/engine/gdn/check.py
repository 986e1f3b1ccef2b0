"""A self-check of the one-slot GDN layer inside a running engine: with
``VLLM_HYBRIDSPEC_CHECK_ROUNDS=1`` every forward of the layer that verifies rounds outside a CUDA-graph
capture is recomputed with the torch references from a copy of the pool taken before it (the conv
window shifted by the pending inputs, vLLM's own torch decode convolution per round, then
``kernels.gdn.naive.commit_verify_``: Eq. 7 for the pending round, Eqs. 3 and 10 for the new one), and
the relative errors of the outputs, the committed states and the windows are logged with the step's
layout. It answers, on a GPU where a served comparison disagrees with plain decoding, whether the
layer computes what its layout says (kernels, conv, commit) or is handed the wrong layout.

It reads device tensors on the host (slow), and a forward replayed from a full CUDA graph is not
checked (nothing runs on the host then): run it with ``enforce_eager`` or piecewise graphs."""

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
        worst = max(err_out, err_state, err_window)
        _state["worst"] = max(_state["worst"], worst)
        first = _state.get("first_layer") in (None, layer.prefix)
        _state.setdefault("first_layer", layer.prefix)
        if first:
            _state["calls"] += 1
        if (first and _state["calls"] <= LOGGED_STEPS) or worst > TOLERANCE:
            logger.warning(
                "hspec-check %s call %d: out %.2e state %.2e window %.2e (worst so far %.2e) | n=%d spec=%d "
                "single=%d U=%d T=%d slots=%s cu=%s slab=%s pending=%s m=%s target=%s", layer.prefix,
                _state["calls"], err_out, err_state, err_window, _state["worst"], layout.n, layout.num_spec,
                layout.num_single, layout.max_len, layout.num_tokens, slot_list, cu, lay["slab"].tolist(),
                lay["pending_entry"].tolist(), lay["pending_m"].tolist(), lay["target_entry"].tolist())


def _dim_first() -> bool:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return is_conv_state_dim_first()


def log_sampled(rounds, output_token_ids: torch.Tensor) -> None:
    """With the check on: each row's accepted count and the slab it goes to, for the log."""
    if not check_enabled() or _capturing() or _state["calls"] > LOGGED_STEPS:
        return
    n = output_token_ids.shape[0]
    counts = (output_token_ids != -1).sum(dim=1).tolist()
    logger.warning("hspec-check sampled: counts=%s row_slab=%s single=%s", counts,
                   rounds.plan_dev[3, :n].tolist(), rounds.plan_dev[4, :n].tolist())
