"""The vLLM 0.26 symbols the CPU paths (``engine/cpu/``) rely on keep their shape: vLLM's CPU GDN helpers
the one-slot layer reuses (``vllm_cpu_gdn_paths``, ``is_conv_state_dim_first``), the custom op its CPU
core runs behind (``direct_register_custom_op``, the forward context's ``no_compile_layers``), the
rejection sampler's ``expand_batch_to_tokens`` we replace, and ``CPUFusedMOE.check_grouped_gemm``."""


import torch
from ...seeds import fresh_seed

from vllm_hybridspec.engine import patches


def test_cpu_gdn_helpers_the_one_slot_layer_reuses_keep_their_shape():
    import inspect
    import types as _types

    from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths

    cpu = vllm_cpu_gdn_paths()
    expected = {
        "nonspec": ["layer", "attn_metadata_i", "mixed_qkv", "b", "a", "core_attn_out"],
        "nonspec_subset": ["layer", "attn_metadata_i", "mixed_qkv", "b", "a", "conv_buf", "ssm_state", "width"],
        "conv_view": ["layer"], "ssm_view": ["layer"], "conv_weight": ["layer"],
        "conv_update": ["x", "conv_state", "weight", "bias", "activation"],
    }
    for key, params in expected.items():
        assert list(inspect.signature(getattr(cpu, key)).parameters) == params, key
    # the views and the decode convolution do what gdn_layer.py assumes, on fresh random data
    gen = torch.Generator().manual_seed(fresh_seed("vllm_contract_cpu_gdn_helpers_the_one_sl"))
    slots, dim, width, HV, K, V = 5, 24, 4, 2, 8, 16
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    dim_first = is_conv_state_dim_first()  # vLLM's conv layout: (dim, state_len) or (state_len, dim)
    conv_state = torch.randn(slots, *((dim, width - 1) if dim_first else (width - 1, dim)), generator=gen)
    ssm = torch.randn(slots, HV, V, K, generator=gen)
    layer = _types.SimpleNamespace(kv_cache=(conv_state, ssm), conv1d=_types.SimpleNamespace(
        weight=torch.randn(dim, 1, width, generator=gen)))
    view = cpu.conv_view(layer)
    assert view.shape == (slots, dim, width - 1) and view.data_ptr() == conv_state.data_ptr()
    assert torch.equal(view, conv_state if dim_first else conv_state.transpose(-1, -2))
    state_view = cpu.ssm_view(layer)
    assert state_view.shape == (slots, HV, K, V) and torch.equal(state_view.reshape(-1), ssm.reshape(-1))
    weight = cpu.conv_weight(layer)
    assert weight.shape == (dim, width)
    x = torch.randn(1, dim, 3, generator=gen)
    window = view[2].clone()[None]
    out = cpu.conv_update(x, window, weight, None, "silu")
    full = torch.cat([view[2][None], x], dim=-1)  # [1, dim, width - 1 + 3]
    ref = torch.nn.functional.silu(torch.stack(
        [(full[0, :, t:t + width] * weight).sum(-1) for t in range(3)], dim=-1))[None]
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.equal(window[0], full[0, :, -(width - 1):])  # the window it leaves: the last width-1 inputs


def test_cpu_gdn_core_op_calls_the_layer_registered_under_its_name():
    """The custom op the one-slot layer's CPU core runs behind: registered once (vLLM's
    direct_register_custom_op, layer names as _encode_layer_name makes them), it looks the layer up in
    the forward context's no_compile_layers and calls its _core_cpu, which writes core_attn_out
    in place; torch.compile sees it as one opaque op that mutates core_attn_out."""
    from vllm.forward_context import ForwardContext, override_forward_context

    from vllm_hybridspec.engine.cpu.core import HSPEC_CPU_GDN_CORE_OP, cpu_gdn_core_op

    op, encode = cpu_gdn_core_op()
    assert cpu_gdn_core_op() == (op, encode)  # registered once
    assert op is getattr(torch.ops.vllm, HSPEC_CPU_GDN_CORE_OP)
    schema = op.default._schema
    assert [a.name for a in schema.arguments] == ["mixed_qkv", "b", "a", "core_attn_out", "layer_name"]
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == ["core_attn_out"]
    gen = torch.Generator().manual_seed(fresh_seed("vllm_contract_cpu_gdn_core_op_calls_the"))
    x, b, a = (torch.randn(5, n, generator=gen) for n in (12, 3, 3))

    class Layer:
        prefix = "model.layers.0.linear_attn"

        def _core_cpu(self, mixed_qkv, b_, a_, out):
            out.copy_((mixed_qkv[:, :3] * b_ + a_)[:, :, None].expand_as(out))

    out = torch.full((5, 3, 4), float("nan"))
    context = ForwardContext(no_compile_layers={Layer.prefix: Layer()}, attn_metadata={}, slot_mapping={})
    with override_forward_context(context):
        op(x, b, a, out, encode(Layer.prefix))
    torch.testing.assert_close(out, (x[:, :3] * b + a)[:, :, None].expand(5, 3, 4), rtol=0, atol=0)


def test_expand_batch_to_tokens_replacement_matches_vllms_documented_semantics():
    """vllm-cpu 0.26's expand_kernel fills an int64 copy of a float output, leaving per-token
    temperatures uninitialised; our torch version does what vLLM's docstring says."""
    import inspect

    import vllm.v1.sample.rejection_sampler as rejection_sampler

    from vllm_hybridspec.engine.cpu.patches import expand_batch_to_tokens_torch

    assert list(inspect.signature(rejection_sampler.expand_batch_to_tokens).parameters) == [
        "x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"]
    source = inspect.getsource(rejection_sampler.apply_sampling_constraints)
    assert "temperature = expand_batch_to_tokens(" in source
    gen = torch.Generator().manual_seed(fresh_seed("vllm_contract_expand_batch_to_tokens_rep"))
    counts = torch.randint(0, 5, (9,), generator=gen)
    x = torch.rand(9, generator=gen) + 0.1
    x[3] = 0.0
    cu = counts.cumsum(0).to(torch.int32)
    got = expand_batch_to_tokens_torch(x, cu, int(counts.sum()), replace_from=0, replace_to=1)
    want = torch.cat([torch.full((int(c),), 1.0 if i == 3 else float(x[i])) for i, c in enumerate(counts)])
    assert got.dtype == x.dtype and torch.equal(got, want)
    # the example of vLLM's docstring
    assert expand_batch_to_tokens_torch(torch.tensor([5, 6, 7]), torch.tensor([2, 5, 6]), 6).tolist() == [5, 5, 6, 6, 6, 7]


def test_cpu_moe_kernel_choice_keeps_the_vec_kernel_only_where_it_computes_the_moe():
    """``cpu.patches.torch_moe_where_vec_cannot`` (its row of ``engine/patches/table.py``): vLLM's ``CPUFusedMOE.check_grouped_gemm`` still exists and
    decides per layer; after the patch a layer whose intermediate size is not a multiple of 32 runs
    the torch path, and one whose size is keeps the ``vec`` grouped GEMM, which (run here, against a
    float64 reference on fresh random weights) computes the MoE correctly at those sizes. A vllm-cpu
    build without the grouped GEMM (its AVX2 library registers no ``prepack_moe_weight``) runs the
    torch path for every layer, before and after the patch, and has no kernel to run."""
    import types

    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe as module

    from vllm_hybridspec.engine import patches
    from vllm_hybridspec.engine.cpu.patches import vec_moe_kernel_fits

    patches.apply_row(next(r for r in patches.rows(feature="cpu") if r.attr == "check_grouped_gemm"))
    check = module.CPUFusedMOE.check_grouped_gemm
    assert getattr(check, "__hspec_wrapped__", False)
    original = check.__wrapped__
    seed = fresh_seed("vllm_contract_cpu_moe_kernel_choice_keep")
    torch.manual_seed(seed)
    hidden, experts, tokens, top_k = 128, 8, 5, 2
    has_grouped_gemm = hasattr(torch.ops._C, "prepack_moe_weight")  # vLLM's own test in check_grouped_gemm
    print(f"grouped GEMM MoE kernel in this vllm-cpu build: {has_grouped_gemm}")
    for inter in (16, 32, 48, 64):
        layer = types.SimpleNamespace(w13_weight=torch.randn(experts, 2 * inter, hidden),
                                      w2_weight=torch.randn(experts, hidden, inter))
        before, after = original(None, layer), check(None, layer)
        if not has_grouped_gemm:
            assert before == after == (False, "none"), (inter, before, after)
            continue
        if before == (True, "vec"):
            assert after == ((True, "vec") if inter % 32 == 0 else (False, "none")), (inter, after)
        else:  # AMX machines pick another path for float32 layers: left as vLLM chose
            assert after == before
        if not vec_moe_kernel_fits(2 * inter):
            continue  # (these sizes abort the process inside the kernel: not run here)
        x = torch.randn(tokens, hidden)
        weights = torch.rand(tokens, top_k)
        ids = torch.randint(0, experts, (tokens, top_k), dtype=torch.int32)
        out = cpu_fused_moe(x, cpu_prepack_moe_weight(layer.w13_weight, "vec"),
                            cpu_prepack_moe_weight(layer.w2_weight, "vec"), None, None, weights, ids, "silu",
                            "vec", False)
        ref = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j in range(top_k):
                e = int(ids[t, j])
                gate, up = (layer.w13_weight[e].double() @ x[t].double()).split(inter)
                ref[t] += float(weights[t, j]) * (layer.w2_weight[e].double() @ (torch.nn.functional.silu(gate) * up))
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def _amx_conv_problems(dispatch_source: str, nonspec_source: str) -> list[str]:
    """What breaks the rows ``cpu: utils.dispatch_cpu_unquantized_gemm`` and
    ``cpu: gdn_attention._cpu_gdn_attention_nonspec`` of ``engine/patches/table.py`` in vLLM's source of the
    two functions, each problem naming its row."""
    import re

    rows = {r.attr: r.name for r in patches.rows(feature="cpu")}
    problems = []
    dispatch = re.sub(r"\s+", "", dispatch_source)
    conv_branch = dispatch.split("iflayer.weight.ndim!=2:", 1)[-1].split("N,K=layer.weight.size()", 1)[0]
    if not ("iftorch.cpu._is_amx_tile_supported():" in conv_branch and "ops.causal_conv1d_weight_pack(" in conv_branch
            and conv_branch.endswith("return")):
        problems.append(f"vLLM changed the conv branch of dispatch_cpu_unquantized_gemm: row "
                        f"{rows['dispatch_cpu_unquantized_gemm']!r}")
    nonspec = re.sub(r"\s+", "", nonspec_source)
    decided_once = re.search(r"^\s*is_amx = torch\.cpu\._is_amx_tile_supported\(\)\s*$", nonspec_source, re.M)
    if not (nonspec.count("_is_amx_tile_supported") == 1 and decided_once
            and nonspec.count("causal_conv1d_torch(") == 1 and nonspec.count("causal_conv1d_update_torch(") == 1
            and "conv_weights=layer.conv1d.weight.view(" in nonspec):
        problems.append(f"vLLM changed how _cpu_gdn_attention_nonspec picks its conv: row "
                        f"{rows['_cpu_gdn_attention_nonspec']!r}")
    return problems


def test_the_amx_conv_decisions_the_cpu_rows_wrap_are_where_they_were():
    """The two AMX conv rows assume: vLLM prepacks a conv weight (any weight that is not 2-D) only
    behind ``torch.cpu._is_amx_tile_supported()`` and otherwise leaves it alone; the GDN core picks the
    AMX conv kernels by that one call, and its other branch is the torch convolution on the weight as
    loaded. Negative control: a changed source of either fails naming its row."""
    import inspect

    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    dispatch = inspect.getsource(patches.original_of(utils.dispatch_cpu_unquantized_gemm))
    nonspec = inspect.getsource(patches.original_of(gdn_attention._cpu_gdn_attention_nonspec))
    assert _amx_conv_problems(dispatch, nonspec) == []
    planted = {
        "dispatch_cpu_unquantized_gemm": (dispatch.replace("torch.cpu._is_amx_tile_supported()", "True"), nonspec),
        "_cpu_gdn_attention_nonspec": (dispatch, nonspec.replace(
            "is_amx = torch.cpu._is_amx_tile_supported()",
            "is_amx = torch.cpu._is_amx_tile_supported() or layer.conv1d.weight.dtype == torch.float32")),
    }
    for attr, sources in planted.items():
        assert sources != (dispatch, nonspec), attr  # the planted change is in the source
        problems = _amx_conv_problems(*sources)
        row = next(r.name for r in patches.rows(feature="cpu") if r.attr == attr)
        assert len(problems) == 1 and f"row {row!r}" in problems[0], problems
