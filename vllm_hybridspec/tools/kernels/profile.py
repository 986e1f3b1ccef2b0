"""Profile our GDN kernels at the 35B shape: a few rounds of ``gdn_verify`` for one layer then
``gdn_commit``, for Nsight Compute to catch one launch of each (CUDA), then the verify kernel's
registers and spills as Triton reports them. Run it under ncu, e.g.

    ncu --kernel-name regex:gdn_ --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        python3 -m vllm_hybridspec.cli kernels profile --batch 1 --length 16

(``hybridspec kernels profile`` where the package is installed.) ``--shape tiny`` on the CPU runs the
same rounds through Triton's interpreter, which reports no kernel metadata.
"""

from __future__ import annotations

import torch

from .shapes import Round, Shape, Unfused
from .timing import log


def profile(shape: Shape, B: int = 1, w: int = 16, launch: dict | None = None, rounds: int = 4,
            device=None) -> list[tuple[int, int]]:
    """``rounds`` rounds (each ``gdn_verify`` of one layer with the ``launch`` settings, then
    ``gdn_commit`` of w tokens); returns the (registers, spills) of every compiled chunkwise verify
    kernel, as Triton reports them (none from the interpreter)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    one = shape.with_layers(1)
    r = Round(one, B, w, gen=0, device=device)
    ours = Unfused(one, B, device, seed=1, verify=launch)
    out, m = r.outputs(), torch.full((B,), w, dtype=torch.int32, device=device)
    for _ in range(rounds):
        ours.round(r, out, m)
    if device != "cuda":
        return []
    torch.cuda.synchronize()
    from vllm_hybridspec.kernels.gdn.verify import gdn_verify_kernel

    try:
        return [(kern.n_regs, kern.n_spills) for cache in gdn_verify_kernel.device_caches.values()
                for kern in cache[0].values()]
    except Exception as e:  # noqa: BLE001 - Triton's cache layout is not an API
        log(f"no Triton kernel metadata: {type(e).__name__}: {e}")
        return []
