"""The one-slot layer's spec-step convolution of one GDN layer, vLLM-free: the one-launch kernel
(``kernels.gdn.conv.spec_conv``, then the slab store) against the same as torch ops
(``spec_conv_torch``: the window commit ``shift_conv_windows``, the gather-and-reduce convolution; then
the slab store), what the layer runs with ``"gdn_fused_conv": false``, each as one CUDA graph, after
checking the two agree. B requests of one round of ``length`` tokens (``K + 1 = 16`` in a full-graph
spec step, whatever the selected length), each with ``length - 1`` pending inputs to commit.
"""

from __future__ import annotations

import time

import torch

from vllm_hybridspec.kernels.gdn.conv import spec_conv, spec_conv_torch

from .timing import graph_ms, log


def make_step(B: int, length: int, conv_dim: int, width: int, dtype, device, seed: int = 0) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    W, S = width - 1, length
    slots = B + 1
    pool = torch.randn(slots, W, conv_dim, generator=gen).to(dtype).to(device)  # vLLM's layout: [slots, W, D]
    step = dict(
        pool=pool, conv=pool.transpose(1, 2),
        x=torch.randn(B * length, conv_dim, generator=gen).to(dtype).to(device),
        x_slab=torch.randn((B + 1) * S, conv_dim, generator=gen).to(dtype).to(device),
        taps=(torch.randn(width, conv_dim, generator=gen) * 0.5).to(dtype).float().to(device),
        bias=(torch.randn(conv_dim, generator=gen) * 0.1).to(dtype).float().to(device),
        slots=torch.arange(1, B + 1, dtype=torch.int32, device=device),
        slab=torch.arange(B, dtype=torch.int32, device=device),
        pending_m=torch.full((B,), max(length - 1, 1), dtype=torch.int32, device=device),
        cu=torch.arange(0, B * length + 1, length, dtype=torch.int32, device=device),
        S=S)
    T = B * length
    t = torch.arange(T, device=device)
    step["rows"] = step["slab"].long().repeat_interleave(length) * S + t % length
    return step


def fused(s: dict) -> torch.Tensor:
    """The kernel, then the caller's store of the round's inputs in the slabs."""
    out = spec_conv(s["conv"], s["x"], s["x_slab"], s["taps"], s["bias"], s["slots"], s["slab"], s["pending_m"],
                    s["cu"], s["S"], s["S"], silu=True)
    s["x_slab"].index_copy_(0, s["rows"], s["x"])
    return out


def torch_ops(s: dict) -> torch.Tensor:
    """``spec_conv_torch``, then the same slab store."""
    out = spec_conv_torch(s["conv"], s["x"], s["x_slab"], s["taps"], s["bias"], s["slots"], s["slab"], s["pending_m"],
                          s["cu"], s["S"], s["S"], silu=True)
    s["x_slab"].index_copy_(0, s["rows"], s["x"])
    return out


def check(B: int, length: int, conv_dim: int, width: int, dtype, device) -> float:
    """Largest |fused - torch| of the outputs; raises where the windows or slabs differ, naming the
    slots and rows."""
    a = make_step(B, length, conv_dim, width, dtype, device, seed=B * 100 + length)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    b["conv"] = b["pool"].transpose(1, 2)
    out_a = fused(a)
    out_b = torch_ops(b)
    slots = (a["pool"] != b["pool"]).flatten(1).any(1).nonzero().flatten().tolist()
    rows = (a["x_slab"] != b["x_slab"]).any(1).nonzero().flatten().tolist()
    if slots or rows:
        raise AssertionError(f"B={B} length={length}: the fused kernel's windows differ from torch's at slots "
                             f"{slots}, the slabs at rows {rows}")
    return float((out_a.float() - out_b.float()).abs().max())


def run(batches: list[int], lengths: list[int], conv_dim: int, width: int, samples: int, replays: int,
        layers: int) -> dict:
    device = torch.device("cuda")
    t0 = time.time()
    rows = []
    for B in batches:
        for length in lengths:
            err = check(B, length, conv_dim, width, torch.bfloat16, device)
            s = make_step(B, length, conv_dim, width, torch.bfloat16, device)
            row = {"B": B, "length": length, "max_abs_diff": err,
                   "fused_ms": graph_ms(lambda: fused(s), samples, replays).ms,
                   "torch_ms": graph_ms(lambda: torch_ops(s), samples, replays).ms}
            row["saved_ms_per_step"] = (row["torch_ms"] - row["fused_ms"]) * layers
            log(f"B={B} length={length}: fused {row['fused_ms'] * 1e3:.1f} us, torch ops {row['torch_ms'] * 1e3:.1f} us "
                f"per layer; x{layers} layers saves {row['saved_ms_per_step']:.3f} ms per step; max |diff| {err:.2e}")
            rows.append(row)
    meta = {"device": torch.cuda.get_device_name(), "conv_dim": conv_dim, "width": width, "layers": layers,
            "dtype": "bfloat16", "samples": samples, "replays": replays, "seconds": time.time() - t0}
    return {"meta": meta, "rows": rows}
