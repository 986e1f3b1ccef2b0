"""When the one-slot GDN layer is on (vllm_hybridspec.engine.gdn.enable.gdn_kernel_enabled): the decision
the layer and the page-size classmethods share, and its errors."""

import os
from types import SimpleNamespace

import pytest
import torch

from vllm_hybridspec.engine.gdn.enable import gdn_kernel_enabled, one_slot_state_shape

from ...kernels.gdn_inputs import rel_err


def vllm_config(k=3, options=None, ssm="float32", mode="none", dtype=torch.bfloat16, tp=1, eager=True,
                graphs=None, pp=1):
    from vllm.config.compilation import CUDAGraphMode

    return SimpleNamespace(
        speculative_config=None if k is None else SimpleNamespace(num_speculative_tokens=k),
        additional_config={} if options is None else {"hybridspec": options},
        cache_config=SimpleNamespace(mamba_cache_mode=mode, mamba_cache_dtype="auto", mamba_ssm_cache_dtype=ssm),
        model_config=SimpleNamespace(dtype=dtype, enforce_eager=eager),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE if graphs is None
                                           else CUDAGraphMode[graphs]),
    )


def test_on_by_default_with_spec_decoding_and_an_fp32_state():
    assert gdn_kernel_enabled(vllm_config())
    assert gdn_kernel_enabled(vllm_config(k=15, options={"gdn_kernel": True}))
    assert not gdn_kernel_enabled(vllm_config(k=None))
    assert not gdn_kernel_enabled(vllm_config(options={"gdn_kernel": False}))
    # "auto" follows the model dtype
    assert gdn_kernel_enabled(vllm_config(ssm="auto", dtype=torch.float32))


@pytest.mark.parametrize("setting, message", [
    ({"ssm": "auto"}, r"mamba_ssm_cache_dtype='auto'.*--mamba-ssm-cache-dtype float32"),
    ({"ssm": "bfloat16"}, r"mamba_ssm_cache_dtype='bfloat16'"),
    ({"mode": "align"}, r"mamba_cache_mode='align'"),
    ({"k": 16}, r"num_speculative_tokens=16"),
    ({"pp": 2}, r"pipeline_parallel_size=2: the one-slot commit runs after sampling"),
])
def test_unmet_requirement_falls_back_by_default_and_is_an_error_when_asked_for(setting, message):
    assert not gdn_kernel_enabled(vllm_config(**setting))
    with pytest.raises(ValueError, match=message):
        gdn_kernel_enabled(vllm_config(**setting, options={"gdn_kernel": True}))


@pytest.mark.parametrize("eager, graphs, allowed", [
    (True, None, True), (False, "PIECEWISE", True), (False, "NONE", True),
    (False, "FULL_AND_PIECEWISE", True), (False, "FULL_DECODE_ONLY", True), (False, "FULL", False),
])
def test_on_a_gpu_only_full_graphs_of_mixed_batches_are_refused(monkeypatch, eager, graphs, allowed):
    """The one-slot verify reads its batch layout on the host: it runs inside vLLM's GDN core op, a
    splitting op of piecewise graphs. Full graphs may hold plain decode steps only (the runner's
    uniform decode batches, one token per request: ``patch_plain_decode_full_graphs``), so only FULL,
    which also captures mixed batches, is refused."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    config = vllm_config(eager=eager, graphs=graphs, options={"gdn_kernel": True})
    if allowed:
        assert gdn_kernel_enabled(config)
    else:
        with pytest.raises(ValueError, match=rf"cudagraph_mode={graphs}.*FULL_AND_PIECEWISE"):
            gdn_kernel_enabled(config)
        # without the explicit option: vLLM's own path (a warning), not an error
        assert not gdn_kernel_enabled(vllm_config(eager=eager, graphs=graphs))


@pytest.mark.parametrize("method, architectures, on", [
    ("dflash", ["HSpecDraftModel"], True),  # an H-Spec draft (it runs as method "dflash" inside vLLM)
    ("dflash", ["DFlashDraftModel"], False),
    ("ngram", None, False),
])
def test_on_a_gpu_the_default_is_on_for_hspec_drafts_only(monkeypatch, method, architectures, on):
    """Without a "hybridspec" dict, a GPU engine gets the one-slot layer for H-Spec drafts (its float32
    identity run on the H200 passed) and vLLM's own GDN path for every other method, which the plugin
    must leave alone; with "gdn_kernel": true any method gets it."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    config = vllm_config(eager=False, graphs="FULL_AND_PIECEWISE")
    draft = None if architectures is None else SimpleNamespace(hf_config=SimpleNamespace(architectures=architectures))
    config.speculative_config = SimpleNamespace(num_speculative_tokens=3, method=method, draft_model_config=draft)
    assert gdn_kernel_enabled(config) is on
    config.additional_config = {"hybridspec": {"gdn_kernel": True}}
    assert gdn_kernel_enabled(config)


def test_full_graphs_hold_plain_decode_steps_only_when_the_model_has_one_slot_layers(monkeypatch):
    """``patch_plain_decode_full_graphs`` (installed by the plugin) sets the runner's and its dispatcher's
    uniform decode length to 1 before vLLM resolves the graph mode, for runners with one-slot layers
    only; vLLM then classes a batch of K drafts per request as non-uniform (piecewise graphs)."""
    import inspect

    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN, runner_has_one_slot_layers
    from vllm_hybridspec.engine.gdn.graphs import patch_plain_decode_full_graphs

    real = GPUModelRunner._check_and_update_cudagraph_mode
    runner_source = inspect.getsource(getattr(real, "__wrapped__", real))
    calls = []

    def original(self, attention_backends, kv_cache_groups, is_profiling=False):  # records what vLLM would read
        calls.append((self.uniform_decode_query_len, self.cudagraph_dispatcher.uniform_decode_query_len))

    monkeypatch.setattr(GPUModelRunner, "_check_and_update_cudagraph_mode", original)  # restored afterwards
    patch_plain_decode_full_graphs(runner_has_one_slot_layers)
    for one_slot in (True, False):
        layer = HSpecQwenGDN.__new__(HSpecQwenGDN)
        layer.one_slot = one_slot
        runner = SimpleNamespace(uniform_decode_query_len=8,
                                 cudagraph_dispatcher=SimpleNamespace(uniform_decode_query_len=8),
                                 compilation_config=SimpleNamespace(static_forward_context={"l": layer, "x": 3}))
        GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [], is_profiling=False)
    assert calls == [(1, 1), (8, 8)]
    # what vLLM does with the value: a batch of 8 tokens for each of 4 requests is uniform only at 8
    assert GPUModelRunner._is_uniform_decode(8, 8, 32, 4) and not GPUModelRunner._is_uniform_decode(8, 1, 32, 4)
    assert GPUModelRunner._is_uniform_decode(1, 1, 4, 4)
    # the two places vLLM 0.26 sets it, and the dispatcher reading its own copy
    assert "self.uniform_decode_query_len = 1 + self.num_spec_tokens" in inspect.getsource(GPUModelRunner.__init__)
    assert "self.uniform_decode_query_len = 1 + self.vllm_config.num_speculative_tokens" in inspect.getsource(
        CudagraphDispatcher.__init__)
    assert "uniform_decode_query_len = self.uniform_decode_query_len" in inspect.getsource(
        CudagraphDispatcher._create_padded_batch_descriptor)
    assert "self.uniform_decode_query_len," in runner_source and "initialize_cudagraph_keys(" in runner_source


@pytest.mark.parametrize("tp", [1, 2])
def test_one_slot_state_is_the_plain_decoding_state_on_the_local_shard(tp):
    hf = SimpleNamespace(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4)
    conv, ssm = one_slot_state_shape(vllm_config(k=15, tp=tp), hf)
    conv_dim = (2 * 16 * 128 + 32 * 128) // tp
    assert sorted(conv) == sorted((conv_dim, 3))  # K_conv - 1 columns whatever the layout, no spec columns
    assert ssm == (32 // tp, 128, 128)


def bare_layer(gen, HK, HV, K, V, width, num_slots):
    """An HSpecQwenGDN with only what the verify/commit code reads (no vLLM engine)."""
    from torch import nn
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN

    layer = HSpecQwenGDN.__new__(HSpecQwenGDN)
    nn.Module.__init__(layer)
    conv_dim = 2 * HK * K + HV * V
    layer.tp_size, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim = 1, HK, HV, K, V
    layer.key_dim, layer.value_dim, layer.activation = HK * K, HV * V, "silu"
    layer.conv1d = SimpleNamespace(weight=torch.randn(conv_dim, 1, width, generator=gen) * 0.5,
                                   bias=torch.randn(conv_dim, generator=gen) * 0.1)
    layer.A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen))
    layer.dt_bias = torch.randn(HV, generator=gen) * 0.5 - 2.0
    shape = (num_slots, conv_dim, width - 1) if is_conv_state_dim_first() else (num_slots, width - 1, conv_dim)
    conv = torch.randn(*shape, generator=gen)
    return layer, conv


def spec_metadata(lengths, rows, slots, batch, others=None):
    """The fields of vLLM's GDNAttentionMetadata the spec layout reads (a fresh object, as vLLM
    builds one per KV-cache group and step). ``others``: ``(lengths, slots, has_initial_state)`` of
    the rows without drafts, in batch order (vLLM's builder counts them all as prefills)."""
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    mask = torch.zeros(batch, dtype=torch.bool)
    mask[rows] = True
    md = SimpleNamespace(num_spec_decodes=len(lengths), spec_query_start_loc=torch.tensor(cu, dtype=torch.int32),
                         spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32)[:, None],
                         spec_sequence_masks=mask, num_prefills=0, num_decodes=0, num_prefill_tokens=0,
                         non_spec_query_start_loc=None, non_spec_state_indices_tensor=None, has_initial_state=None,
                         non_spec_token_indx=None)
    if others:
        ns_lengths, ns_slots, init = others
        md.num_prefills = sum(1 for n in ns_lengths if n)
        md.num_prefill_tokens = sum(ns_lengths)
        md.non_spec_query_start_loc = torch.tensor([0, *torch.tensor(ns_lengths).cumsum(0).tolist()], dtype=torch.int32)
        md.non_spec_state_indices_tensor = torch.tensor(ns_slots, dtype=torch.int32)
        md.has_initial_state = torch.tensor(init, dtype=torch.bool)
        md.non_spec_token_indx = torch.arange(cu[-1], cu[-1] + sum(ns_lengths))
    return md


def check_gpu_round_against_cpu(gen, layer, conv, S, lengths, rows, slots, commit, batch, singles=None):
    """One round through the CPU path and the GPU path from the same pools; outputs, states and conv
    windows must agree. Sequences with slot 0 (padding) are skipped by both. ``singles``: slots of
    one-token rows without drafts, after the spec rows in the layout, committed whole (m = 1)."""
    from vllm_hybridspec.engine.gdn.commit import _commit_convs_gpu, _commit_states_gpu
    from vllm_hybridspec.engine.gdn.layout import SpecLayout
    from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths

    HV, V, K = S.shape[1:]
    num_slots = S.shape[0]
    others = None if not singles else ([1] * len(singles), singles, [True] * len(singles))
    md = spec_metadata(lengths, rows, slots, batch, others)
    layout = SpecLayout.read(md)
    assert layout.num_single == len(singles or [])
    slots = layout.slots
    commit = list(commit) + [1] * layout.num_single  # what the single-token rows must commit
    cu = layout.cu
    T = cu[-1]
    x = torch.randn(T, layer.conv1d.weight.shape[0], generator=gen)  # [T, conv_dim] pre-conv
    b, a = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    num_committed = [0] * batch  # the single-token rows' batch rows read 0 here: their m is fixed
    for row, m in zip(rows, commit):
        num_committed[row] = m

    cpu_pool = S.transpose(-1, -2).contiguous().view(num_slots, HV, V, K)  # CPU ops: view [HV, K, V] = S^T
    layer.kv_cache = (conv.clone(), cpu_pool)
    o_cpu = layer._verify_cpu(layout, x, b, a)
    # verify writes nothing to the pool
    assert torch.equal(layer.kv_cache[0], conv)
    assert torch.equal(cpu_pool, S.transpose(-1, -2).contiguous().view(num_slots, HV, V, K))
    layer.commit_state_cpu(num_committed)
    layer.commit_conv(num_committed)
    cpu_states = vllm_cpu_gdn_paths().ssm_view(layer).transpose(-1, -2)  # back to [HV, V, K]
    cpu_conv = layer.kv_cache[0]

    gpu_pool = S.clone()  # CUDA layout: pool[slot] = S
    layer.kv_cache = (conv.clone(), gpu_pool)
    o_gpu = layer._verify_gpu(SpecLayout.read(md), x, b, a)
    assert torch.equal(gpu_pool, S)
    _commit_states_gpu([layer], torch.tensor(num_committed))
    _commit_convs_gpu([layer], torch.tensor(num_committed))  # the GPU branch's conv commit (no host loop)

    real = [i for i, slot in enumerate(slots) if slot > 0]
    for i in real:
        s, e = cu[i], cu[i + 1]
        assert rel_err(o_gpu[s:e], o_cpu[s:e]) < 1e-4, i
    assert rel_err(gpu_pool, cpu_states) < 1e-4
    assert torch.equal(layer.kv_cache[0], cpu_conv)
    for i in real:  # the committed states moved, untouched slots did not
        assert rel_err(gpu_pool[slots[i]], S[slots[i]]) > 1e-3, slots[i]
    for slot in set(range(num_slots)) - {slots[i] for i in real}:
        assert torch.equal(gpu_pool[slot], S[slot]), slot


def test_gpu_verify_and_commit_equal_the_cpu_path():
    """The GPU path's glue (``gdn_verify`` + ``gdn_commit`` through ``_verify_gpu`` /
    ``_commit_states_gpu``, run by Triton's interpreter on CPU tensors) against the CPU path
    (``chunk_verify`` + ``reconstruct_state``) on the same round: outputs, states and conv windows.
    The two paths read the pool in their platforms' layouts (CPU ops: ``[HV, K, V]`` view = ``S^T``)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)  # fresh every run
    HK, HV, K, V, width, num_slots = 2, 4, 16, 32, 4, 9
    layer, conv = bare_layer(gen, HK, HV, K, V, width, num_slots)
    S = torch.randn(num_slots, HV, V, K, generator=gen) * 0.2  # the states, [HV, V, K] per slot
    # a batch of 5 rows; rows 0, 2, 3 and 4 are spec rows with 1 + drafts tokens; slot 0: padding
    check_gpu_round_against_cpu(gen, layer, conv, S, lengths=[3, 1, 5, 4], rows=[0, 2, 3, 4], slots=[7, 2, 5, 0],
                                commit=[2, 1, 5, 3], batch=5)


def test_rows_without_drafts_are_one_token_rounds_committed_whole():
    """Rows without drafts next to spec rows (vLLM's builder calls them prefills): when each is one
    token with a state, they join the layout and commit m = 1 whatever rejection sampling says of
    their batch row; on both paths, against each other. Otherwise (a longer chunk, a row without
    initial state, a zero-length row) the layout holds the spec rows only."""
    from vllm_hybridspec.engine.gdn.layout import SpecLayout

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    HK, HV, K, V, width, num_slots = 2, 4, 16, 32, 4, 9
    layer, conv = bare_layer(gen, HK, HV, K, V, width, num_slots)
    S = torch.randn(num_slots, HV, V, K, generator=gen) * 0.2
    check_gpu_round_against_cpu(gen, layer, conv, S, lengths=[3, 5], rows=[0, 3], slots=[7, 2],
                                commit=[2, 4], batch=5, singles=[5, 1, 8])
    layout = SpecLayout.read(spec_metadata([3, 5], [0, 3], [7, 2], 5, ([1, 1, 1], [5, 1, 8], [True] * 3)))
    assert (layout.cu, layout.slots, layout.fixed_m) == ([0, 3, 8, 9, 10, 11], [7, 2, 5, 1, 8], [-1, -1, 1, 1, 1])
    assert layout.committed(torch.tensor([3, 9, 9, 5, 9])).tolist() == [3, 5, 1, 1, 1]
    assert layout.committed_host([3, 9, 9, 5, 9]) == [3, 5, 1, 1, 1]
    for others in (([1, 2], [5, 1], [True, True]), ([1, 1], [5, 1], [True, False]), ([1, 0], [5, 1], [True, True])):
        layout = SpecLayout.read(spec_metadata([3, 5], [0, 3], [7, 2], 5, others))
        assert layout.num_single == 0 and layout.fixed_m is None and layout.slots == [7, 2], others


def test_gpu_layout_is_read_once_per_metadata_object_and_never_reused_across_steps(monkeypatch):
    """``_step_layout`` (the GPU path's per-step layout cache): the layers of one KV-cache group
    share one metadata object in a step and read its layout once; every new metadata object (the
    next step, another group) is read anew, even when Python reuses a freed object's id; the device
    tensors are copies, unaffected when vLLM refills its metadata buffers for the next step."""
    from vllm_hybridspec.engine.gdn.commit import commit_rounds
    from vllm_hybridspec.engine.gdn import layout as layout_module
    from vllm_hybridspec.engine.gdn.layout import SpecLayout, _step_layout

    reads = []  # a count; holding the objects would keep their ids from being reused
    read = SpecLayout.read.__func__
    monkeypatch.setattr(SpecLayout, "read", classmethod(lambda cls, md: reads.append(1) or read(cls, md)))
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)

    def expect(layout, lengths, rows, slots):
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        assert (layout.rows, layout.slots, layout.cu, layout.max_len) == (rows, slots, cu, max(lengths))
        assert layout.rows_dev.tolist() == rows and layout.slots_dev.tolist() == slots
        assert layout.cu_dev.tolist() == cu
        assert layout.slots_dev.dtype == layout.cu_dev.dtype == torch.int32

    md = spec_metadata([3, 2], [1, 3], [4, 6], batch=5)
    first = _step_layout(md)
    assert _step_layout(md) is first and len(reads) == 1  # the group's other layers: no second read
    expect(first, [3, 2], [1, 3], [4, 6])
    md.spec_query_start_loc.fill_(0)  # vLLM refills its buffers for the next step
    md.spec_state_indices_tensor.fill_(0)
    expect(first, [3, 2], [1, 3], [4, 6])
    commit_rounds(SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={})),
                  torch.zeros(5, 4, dtype=torch.long))
    assert not layout_module._layouts  # the commit ends the step's cache

    # steps with fresh metadata objects, each dropped after its step (so ids get reused), without a
    # commit in between: the cache must tell them apart by the object, not by its id
    for step in range(8):
        batch = int(torch.randint(1, 7, (1,), generator=gen))
        n = int(torch.randint(1, batch + 1, (1,), generator=gen))
        rows = sorted(torch.randperm(batch, generator=gen)[:n].tolist())
        slots = (torch.randperm(20, generator=gen)[:n] + 1).tolist()
        lengths = torch.randint(1, 9, (n,), generator=gen).tolist()
        md = spec_metadata(lengths, rows, slots, batch)
        expect(_step_layout(md), lengths, rows, slots)
        assert len(reads) == 2 + step
        del md


def test_gpu_path_across_steps_with_different_layouts():
    """Two consecutive rounds through the GPU path with different batches (rows, slots, lengths),
    no commit_rounds in between to empty the layout cache: each round must use its own layout."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    HK, HV, K, V, width, num_slots = 2, 4, 16, 32, 4, 9
    layer, conv = bare_layer(gen, HK, HV, K, V, width, num_slots)
    S = torch.randn(num_slots, HV, V, K, generator=gen) * 0.2
    # the second round is the longer one: a stale layout would stay inside its tensors (no crash) and
    # give wrong slots and offsets
    check_gpu_round_against_cpu(gen, layer, conv, S, lengths=[4, 2], rows=[1, 2], slots=[3, 8], commit=[4, 1],
                                batch=3)
    check_gpu_round_against_cpu(gen, layer, conv, S, lengths=[3, 1, 5], rows=[0, 2, 3], slots=[7, 2, 5],
                                commit=[2, 1, 5], batch=4)


@pytest.mark.parametrize("dim_first", [True, False])
def test_gpu_conv_commit_equals_the_host_loop_bit_for_bit(monkeypatch, dim_first):
    """``_commit_convs_gpu`` (commit_rounds' GPU branch: device-built gather indices, one gather for
    a group of layers, one ``index_copy_`` per layer, no host read) against ``commit_conv`` (the host
    loop, CPU branch): the same windows, bit for bit, in both of vLLM's conv-state layouts. Grouped
    layers sharing one layout, another group with its own layout, ``m`` from 0 to the round's length
    (up to 16, longer and shorter than the window), slot-0 padding (twice), slots not starting at 0,
    slots in no particular order, and a model dtype differing from the conv state's."""
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    from vllm_hybridspec.engine.gdn.commit import VerifiedRound, _commit_convs_gpu
    from vllm_hybridspec.engine.gdn.layout import _step_layout

    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: dim_first)
    monkeypatch.setattr(gdn_attention, "is_conv_state_dim_first", lambda: dim_first)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    HK, HV, K, V, num_slots = 1, 2, 4, 4, 40
    for width in (4, 2):  # W = 3, and W = 1
        batch = 9
        # group A: 3 layers; lengths 1..16; m = 0 (discarded), 1, all, and between; slot 0 twice
        # (the spec sequences are in batch order, as SpecLayout reads them)
        a_lengths = [16, 1, 5, 9, 2, 16, 3, 7]
        a_rows = [0, 1, 2, 3, 5, 6, 7, 8]
        a_slots = [31, 5, 0, 12, 38, 0, 20, 9]
        a_commit = [16, 1, 0, 4, 2, 11, 3, 1]
        # group B: 2 layers, its own slots and rows (a row's m is one value for all groups)
        b_lengths = [16, 12, 4]
        b_rows = [0, 4, 7]
        b_slots = [17, 3, 26]
        b_commit = [16, 7, 3]
        num_committed = torch.zeros(batch, dtype=torch.long)
        for rows, commit in ((a_rows, a_commit), (b_rows, b_commit)):
            for row, m in zip(rows, commit):
                num_committed[row] = m
        layers = []
        for lengths, rows, slots, count in ((a_lengths, a_rows, a_slots, 3), (b_lengths, b_rows, b_slots, 2)):
            md = spec_metadata(lengths, rows, slots, batch)
            layout = _step_layout(md)  # shared by the group's layers, as on a GPU
            for _ in range(count):
                layer, conv = bare_layer(gen, HK, HV, K, V, width, num_slots)
                layer.kv_cache = (conv.to(torch.bfloat16), None)
                x = torch.randn(sum(lengths), conv.shape[1] if dim_first else conv.shape[2], generator=gen)
                layer.verified_round = VerifiedRound(layout, x, [])
                layers.append(layer)
        before = [layer.kv_cache[0].clone() for layer in layers]
        expected = []
        for layer, conv in zip(layers, before):
            layer.kv_cache = (conv.clone(), None)
            layer.commit_conv(num_committed.tolist())
            expected.append(layer.kv_cache[0])
            layer.kv_cache = (conv.clone(), None)
        _commit_convs_gpu(layers, num_committed)
        for i, (layer, want, old) in enumerate(zip(layers, expected, before)):
            assert torch.equal(layer.kv_cache[0], want), (width, i)
            moved = {slot for slot, m in zip(a_slots if i < 3 else b_slots, a_commit if i < 3 else b_commit)
                     if slot > 0 and m > 0}
            for slot in range(num_slots):  # the committed windows moved, no other slot changed
                assert torch.equal(layer.kv_cache[0][slot], old[slot]) == (slot not in moved), (width, i, slot)


@pytest.mark.parametrize("dim_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_spec_conv_equals_the_per_sequence_loop(monkeypatch, dim_first, dtype):
    """``_spec_conv_gpu`` (device-built gather indices, float32 taps, no host loop) against
    ``_spec_conv`` (vLLM's ``causal_conv1d_update_torch`` per sequence) and a float64 reference:
    lengths 1..16 (shorter and longer than the window), slot-0 padding, slots out of order,
    K_conv 4 and 2, both conv-state layouts; the pool is not written."""
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    from vllm_hybridspec.engine.gdn.layout import _step_layout
    from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths

    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: dim_first)
    monkeypatch.setattr(gdn_attention, "is_conv_state_dim_first", lambda: dim_first)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    lengths, slots = [16, 1, 5, 2, 9, 3], [31, 5, 0, 12, 38, 7]
    for width in (4, 2):
        layer, conv = bare_layer(gen, 1, 2, 16, 16, width, 40)
        layer.conv1d.weight, layer.conv1d.bias = layer.conv1d.weight.to(dtype), layer.conv1d.bias.to(dtype)
        layer.kv_cache = (conv.to(dtype), None)
        pool = layer.kv_cache[0].clone()
        layout = _step_layout(spec_metadata(lengths, list(range(len(lengths))), slots, len(lengths)))
        x = torch.randn(sum(lengths), layer.conv1d.weight.shape[0], generator=gen).to(dtype)
        got = layer._spec_conv_gpu(layout, x)
        loop = layer._spec_conv(layout, x)
        assert torch.equal(layer.kv_cache[0], pool)
        # float64 reference: silu(bias + sum_j w_j * [window ; x]_{r + j})
        windows = vllm_cpu_gdn_paths().conv_view(layer).double()  # [slots, conv_dim, W]
        w = layer.conv1d.weight[:, 0].double()
        ref = torch.empty(x.shape, dtype=torch.float64)
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        for i, slot in enumerate(slots):
            seq = torch.cat([windows[slot].T, x[cu[i]:cu[i + 1]].double()])  # [W + len, conv_dim]
            for r in range(lengths[i]):
                ref[cu[i] + r] = torch.nn.functional.silu(layer.conv1d.bias.double() + (w.T * seq[r:r + width]).sum(0))
        assert got.dtype == dtype and got.shape == x.shape
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
        assert rel_err(got, ref) < tol, (width, rel_err(got, ref))
        assert rel_err(got, loop) < (1e-6 if dtype == torch.float32 else 1.6e-2)


def test_a_round_left_by_a_step_that_verified_no_draft_is_dropped_not_committed():
    """A verified round still held when a step scheduled no draft (a dummy batch's forward, then a
    plain step replayed from a full graph, which runs no Python) must not be committed: the pools
    keep their values and the round is dropped."""
    from vllm_hybridspec.engine.gdn.commit import commit_rounds
    from vllm_hybridspec.engine.gdn.layout import SpecLayout

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    HK, HV, K, V, width, num_slots = 2, 4, 16, 32, 4, 9
    layer, conv = bare_layer(gen, HK, HV, K, V, width, num_slots)
    S = torch.randn(num_slots, HV, V, K, generator=gen) * 0.2
    pool = S.transpose(-1, -2).contiguous().view(num_slots, HV, V, K)
    layer.kv_cache = (conv.clone(), pool.clone())
    layer.one_slot = True
    md = spec_metadata([3, 2], [0, 1], [4, 6], 2)
    x = torch.randn(5, layer.conv1d.weight.shape[0], generator=gen)
    layer._verify_cpu(SpecLayout.read(md), x, torch.randn(5, HV, generator=gen), torch.randn(5, HV, generator=gen))
    assert layer.verified_round is not None
    runner = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={"gdn": layer}))
    sampled = torch.tensor([[5, 6, 7], [8, 9, -1]])
    commit_rounds(runner, sampled, SimpleNamespace(scheduled_spec_decode_tokens={}))
    assert layer.verified_round is None
    assert torch.equal(layer.kv_cache[0], conv) and torch.equal(layer.kv_cache[1], pool)
    # the same round in a step that did verify drafts is committed: the two slots move
    layer._verify_cpu(SpecLayout.read(md), x, torch.randn(5, HV, generator=gen), torch.randn(5, HV, generator=gen))
    commit_rounds(runner, sampled, SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2], "b": [3]}))
    assert layer.verified_round is None
    moved = (layer.kv_cache[1] != pool).flatten(1).any(1)
    assert moved.tolist() == [s in (4, 6) for s in range(num_slots)]


@pytest.mark.parametrize("lengths, rows, slots, commit, batch", [
    ([3, 1, 5, 4], [0, 2, 3, 4], [7, 2, 5, 0], [2, 1, 5, 3], 5),  # 4 sequences: the bucket of 4, no padding
    ([4, 2, 6], [1, 2, 4], [3, 8, 6], [4, 1, 2], 6),  # 3 sequences padded to 4
    ([2], [0], [4], [2], 1),
])
def test_padded_graph_round_equals_the_eager_round(lengths, rows, slots, commit, batch):
    """``gdn_graphs.SpecCoreGraphs`` with ``capture=False``: the padded round (sequences to the next
    bucket with length 0 and slot 0, tokens to ``Ns_pad * U``, the kernel specialised for ``U = K + 1``,
    static buffers) gives the eager round's outputs, and the commit from its static buffers the eager
    commit's states and conv windows. Fresh random inputs; the static buffers hold an earlier round's
    values beforehand (what a graph's buffers hold between rounds)."""
    from vllm_hybridspec.engine.gdn.graphs import SpecCoreGraphs
    from vllm_hybridspec.engine.gdn.commit import _commit_convs_gpu, _commit_states_gpu
    from vllm_hybridspec.engine.gdn.layout import _step_layout

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    HK, HV, K, V, width, num_slots, U = 2, 4, 16, 32, 4, 9, 8
    layer, conv = bare_layer(gen, HK, HV, K, V, width, num_slots)
    S = torch.randn(num_slots, HV, V, K, generator=gen) * 0.2
    md = spec_metadata(lengths, rows, slots, batch)
    T = sum(lengths)
    num_committed = torch.zeros(batch, dtype=torch.long)
    num_committed[rows] = torch.tensor(commit)

    def one_round(graphs):
        x = torch.randn(T, layer.conv1d.weight.shape[0], generator=torch.Generator().manual_seed(seed))
        b, a = (torch.randn(T, HV, generator=torch.Generator().manual_seed(seed + i)) for i in (1, 2))
        layer.spec_graphs = graphs
        layer.kv_cache = (conv.clone(), S.clone())
        o = layer._verify_gpu(_step_layout(md), x, b, a)
        _commit_states_gpu([layer], num_committed)
        _commit_convs_gpu([layer], num_committed)
        return o, layer.kv_cache, layer.verified_round

    graphs = SpecCoreGraphs(layer, U, batch_sizes=(1, 2, 4, 8), capture=False)
    seed = int(torch.randint(0, 2**30, (1,), generator=gen))
    print(f"seed {seed}")
    seed += 7  # an earlier round through the graphed path leaves its values in the static buffers
    one_round(graphs)
    seed -= 7
    for buf in (graphs.static.x, graphs.static.b, graphs.static.a, graphs.static.out, graphs.static.factors.z,
                graphs.static.factors.k, graphs.static.factors.g_cum):
        buf.fill_(float("nan"))  # padding rows must never be read into a real row
    o_eager, (conv_eager, ssm_eager), _ = one_round(None)
    o_graph, (conv_graph, ssm_graph), done = one_round(graphs)
    assert done.x.data_ptr() == graphs.static.x.data_ptr()  # the commit read the static buffers
    assert graphs.captures == 0 and graphs.replays == 0
    for i, slot in enumerate(slots):
        if slot > 0:
            cu = md.spec_query_start_loc.tolist()
            assert rel_err(o_graph[cu[i]:cu[i + 1]], o_eager[cu[i]:cu[i + 1]]) < 1e-6, i
    assert rel_err(ssm_graph, ssm_eager) < 1e-6
    assert torch.equal(conv_graph, conv_eager)
    assert rel_err(ssm_graph, S) > 1e-3  # the round committed something


def test_graph_rounds_fall_back_to_eager_past_the_largest_bucket_or_longer_rounds():
    """More spec sequences than the largest bucket, or a round longer than the graphs' ``U``: the layer
    runs its eager path (``run`` returns None)."""
    from vllm_hybridspec.engine.gdn.graphs import SpecCoreGraphs
    from vllm_hybridspec.engine.gdn.layout import SpecLayout

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    layer, conv = bare_layer(gen, 2, 4, 16, 32, 4, 12)
    graphs = SpecCoreGraphs(layer, 4, batch_sizes=(1, 2), capture=False)
    three = SpecLayout.read(spec_metadata([2, 2, 2], [0, 1, 2], [1, 2, 3], 3))
    x, b = torch.randn(6, layer.conv1d.weight.shape[0], generator=gen), torch.randn(6, 4, generator=gen)
    assert graphs.run(three, x, b, b) is None
    long_round = SpecLayout.read(spec_metadata([5], [0], [1], 1))
    assert graphs.run(long_round, x[:5], b[:5], b[:5]) is None
    assert graphs.static is None  # nothing allocated for rounds it does not take


def test_a_failed_capture_runs_that_size_eagerly_from_then_on():
    """With ``capture=True`` on a machine without CUDA the capture fails: the round still returns the
    eager answer (equal to a ``capture=False`` round), the size is marked eager and later rounds of it
    return None (the layer's own eager path)."""
    from vllm_hybridspec.engine.gdn.graphs import SpecCoreGraphs
    from vllm_hybridspec.engine.gdn.layout import SpecLayout

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    layer, conv = bare_layer(gen, 2, 4, 16, 32, 4, 6)
    layer.kv_cache = (conv, torch.randn(6, 4, 32, 16, generator=gen) * 0.2)
    layer.prefix = "model.layers.0.linear_attn"
    layout = SpecLayout.read(spec_metadata([3, 2], [0, 1], [2, 5], 2))
    x = torch.randn(5, layer.conv1d.weight.shape[0], generator=gen)
    b, a = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    failing = SpecCoreGraphs(layer, 4, batch_sizes=(2,), capture=True)
    first = failing.run(layout, x, b, a)
    assert first is not None and failing.eager_sizes == {2} and failing.captures == 0
    reference = SpecCoreGraphs(layer, 4, batch_sizes=(2,), capture=False).run(layout, x, b, a)
    assert torch.equal(first[0], reference[0])
    assert failing.run(layout, x, b, a) is None


def test_graphs_of_the_verification_are_opt_in_on_cuda_and_off_when_eager():
    """``gdn_graphs_enabled``: off without ``"gdn_cudagraphs": true`` (not yet checked on a GPU), off on
    the CPU, off with ``enforce_eager`` or ``cudagraph_mode`` NONE; on otherwise."""
    from vllm_hybridspec.engine.gdn.graphs import gdn_graphs_enabled

    on = {"gdn_cudagraphs": True}
    assert not gdn_graphs_enabled(vllm_config(eager=False, graphs="FULL_AND_PIECEWISE"), "cuda")
    assert not gdn_graphs_enabled(vllm_config(eager=False, graphs="FULL_AND_PIECEWISE", options={}), "cuda")
    assert gdn_graphs_enabled(vllm_config(eager=False, graphs="FULL_AND_PIECEWISE", options=on), "cuda")
    assert gdn_graphs_enabled(vllm_config(eager=False, graphs="PIECEWISE", options=on), "cuda")
    assert not gdn_graphs_enabled(vllm_config(eager=False, graphs="FULL_AND_PIECEWISE", options=on), "cpu")
    assert not gdn_graphs_enabled(vllm_config(eager=True, options=on), "cuda")
    assert not gdn_graphs_enabled(vllm_config(eager=False, graphs="NONE", options=on), "cuda")


def _builder_metadata(query_lens, num_drafts, context_lens, slots, K=4):
    """vLLM 0.26's own ``GDNAttentionMetadataBuilder.build`` on a batch (``num_drafts`` -1: a row
    without drafts), with the builder's instance state stubbed: the row order, token indices and
    non-spec fields the one-slot layer reads are vLLM's, not a copy of them."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32)
    common = SimpleNamespace(query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
                             block_table_tensor=torch.tensor([[s] + [0] * K for s in slots], dtype=torch.int32),
                             num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]),
                             compute_num_computed_tokens=lambda: seq_lens - (qsl[1:] - qsl[:-1]))
    builder = SimpleNamespace(use_spec_decode=True, num_spec=K, kv_cache_spec=None,
                              vllm_config=SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none")),
                              gdn_prefill_backend="triton", use_full_cuda_graph=False, decode_cudagraph_max_bs=1024)
    md = GDNAttentionMetadataBuilder.build(builder, 0, common, torch.ones(len(query_lens), dtype=torch.int32),
                                           torch.tensor(num_drafts, dtype=torch.int32))
    return md, qsl.tolist()


@pytest.mark.parametrize("query_lens, num_drafts, context_lens, slots, commit", [
    ([3, 1, 2, 1, 1], [2, -1, 1, -1, -1], [5, 7, 3, 9, 2], [3, 5, 9, 1, 11], [2, 1]),  # interleaved
    ([1, 4, 1, 3], [-1, 3, -1, 2], [5, 7, 3, 9], [6, 2, 4, 8], [4, 3]),  # a row without drafts first
])
def test_one_token_rows_from_vllms_builder_equal_each_row_verified_alone(query_lens, num_drafts, context_lens,
                                                                         slots, commit):
    """A mixed batch as vLLM's GDN builder lays it out, through ``_spec_batch`` (gather, one verify,
    scatter) and the GPU commit, eagerly and from ``SpecCoreGraphs``'s padded round: every row's
    output, state and conv window equal that row verified alone and committed its own m (spec rows:
    the sampled count, the others: their one token, although sampling reports 0 for them here)."""
    from vllm_hybridspec.engine.gdn.graphs import SpecCoreGraphs
    from vllm_hybridspec.engine.gdn.commit import _commit_convs_gpu, _commit_states_gpu
    from vllm_hybridspec.engine.gdn.layout import SpecLayout

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") >> 1)
    HK, HV, K, V, width, num_slots = 2, 4, 16, 32, 4, 12
    layer, conv = bare_layer(gen, HK, HV, K, V, width, num_slots)
    S = torch.randn(num_slots, HV, V, K, generator=gen) * 0.2
    md, cu = _builder_metadata(query_lens, num_drafts, context_lens, slots)
    layout = SpecLayout.read(md)
    spec_rows = [i for i, d in enumerate(num_drafts) if d >= 0]
    others = [i for i, d in enumerate(num_drafts) if d < 0]
    assert layout.rows == spec_rows + others and layout.fixed_m == [-1] * len(spec_rows) + [1] * len(others)
    T = cu[-1]
    x = torch.randn(T, layer.conv1d.weight.shape[0], generator=gen)
    b, a = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    sampled = torch.zeros(len(query_lens), dtype=torch.long)
    sampled[spec_rows] = torch.tensor(commit)

    def refuse(*args):
        raise AssertionError("vLLM's path was taken for one-token rows")

    results = []
    for graphs in (None, SpecCoreGraphs(layer, 5, batch_sizes=(1, 2, 4, 8), capture=False)):
        layer.spec_graphs = graphs
        layer.kv_cache = (conv.clone(), S.clone())
        out = torch.full((T, HV, V), float("nan"))
        layer._spec_batch(md, x, b, a, out, layer._verify_gpu, refuse, SpecLayout.read(md))
        _commit_states_gpu([layer], sampled)
        _commit_convs_gpu([layer], sampled)
        results.append((out, layer.kv_cache[1].clone(), layer.kv_cache[0].clone()))
    layer.spec_graphs = None
    # each row alone, as a one-sequence spec layout committed its own m
    layer.kv_cache = (conv.clone(), S.clone())
    ref = torch.zeros(T, HV, V)
    for i in range(len(query_lens)):
        s, e = cu[i], cu[i + 1]
        alone = SpecLayout.read(spec_metadata([e - s], [0], [slots[i]], 1))
        ref[s:e] = layer._verify_gpu(alone, x[s:e], b[s:e], a[s:e])
        m = int(sampled[i]) if num_drafts[i] >= 0 else e - s
        _commit_states_gpu([layer], torch.tensor([m]))
        _commit_convs_gpu([layer], torch.tensor([m]))
    for out, states, convs in results:
        assert rel_err(out, ref) < 1e-5
        assert rel_err(states, layer.kv_cache[1]) < 1e-5
        assert torch.equal(convs, layer.kv_cache[0])
    for i in others:  # the one-token rows' states moved although sampling reported 0 for them
        assert rel_err(results[0][1][slots[i]], S[slots[i]]) > 1e-3


@pytest.mark.parametrize("query_lens, num_drafts, context_lens", [
    ([3, 1, 0], [2, -1, -1], [5, 7, 0]),  # a zero-length row
    ([3, 1], [2, -1], [5, 0]),  # a new request's first token: no state yet
    ([3, 2], [2, -1], [5, 4]),  # a two-token prefill chunk
])
def test_other_rows_without_drafts_keep_vllms_path(query_lens, num_drafts, context_lens):
    from vllm_hybridspec.engine.gdn.layout import SpecLayout

    md, _ = _builder_metadata(query_lens, num_drafts, context_lens, [3, 5, 7][:len(query_lens)])
    layout = SpecLayout.read(md)
    assert layout.num_single == 0 and layout.fixed_m is None and layout.rows == [0]
