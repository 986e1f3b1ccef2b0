"""The one place that imports ``mamba-ssm``.

``mamba_ssm/__init__.py`` imports the Mamba-1 CUDA extension ``selective_scan_cuda``
unconditionally, so the package fails to import wherever that extension was not compiled (every
CPU machine, and GPU machines where mamba-ssm was installed with ``MAMBA_SKIP_CUDA_BUILD``). The
H-Spec drafter only needs Mamba-2's Triton kernels, which do not use that extension; a placeholder
module under its name lets them import. Nothing else in the project may import ``mamba_ssm``.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable


@functools.cache
def mamba_chunk_scan_combined() -> Callable | None:
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``, or ``None`` when mamba-ssm
    (or Triton) is not installed."""
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as fn
    except ImportError:
        return None
    return fn
