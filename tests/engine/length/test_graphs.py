"""Full CUDA graphs for every verification length (``engine/length/graphs.py``), on vLLM 0.26's own
``CudagraphDispatcher`` and runner methods with the CPU standing in for a GPU: the keys added per
length and batch size, the dispatch of a uniform batch to the graph of its length (padded by
requests), and the runner-side wrappers that set the uniform length for a capture and a step. The
graphs themselves cannot run here."""

from types import SimpleNamespace

import pytest

from vllm_hybridspec.engine.length import graphs


def dispatcher(k=15, max_num_seqs=8, sizes=(16, 32, 48, 64, 80, 96, 112, 128), lora=None):
    """vLLM's dispatcher after vLLM made its keys for a spec engine of K drafts (capture sizes
    multiples of K + 1, as ``adjust_cudagraph_sizes_for_spec_decode`` leaves them)."""
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.config.compilation import CompilationMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                           cudagraph_capture_sizes=list(sizes), max_cudagraph_capture_size=max(sizes),
                           splitting_ops=list(CompilationConfig._attention_ops))
    d = CudagraphDispatcher(SimpleNamespace(compilation_config=cc, num_speculative_tokens=k, lora_config=lora,
                                            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs)))
    d.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, k + 1)
    return d


def full_keys(d):
    from vllm.config import CUDAGraphMode

    return {(key.num_tokens, key.num_reqs, key.uniform) for key in d.cudagraph_keys[CUDAGraphMode.FULL]}


def test_keys_per_length_and_batch_size_next_to_vllms_own():
    d = dispatcher()
    vllm_own = full_keys(d)
    assert vllm_own == {(16 * b, b, True) for b in range(1, 9)}  # K + 1 = 16 tokens per request, B = 1..8
    added = graphs.add_length_keys(d, (1, 2, 4, 8), max_num_seqs=8)
    want = {(w * b, b, True) for w in (1, 2, 4, 8) for b in (1, 2, 4, 8)}
    assert full_keys(d) == vllm_own | want and added == len(want)
    assert d.hspec_lengths == {w: [1, 2, 4, 8] for w in (1, 2, 4, 8)}


def test_no_keys_past_vllms_largest_capture_size_or_max_num_seqs():
    d = dispatcher(max_num_seqs=64, sizes=(16, 32, 64))
    graphs.add_length_keys(d, (1, 8), max_num_seqs=64)
    assert d.hspec_lengths == {1: [1, 2, 4, 8, 16, 24, 32, 48, 64], 8: [1, 2, 4, 8]}  # 8 * 8 = 64 tokens at most


@pytest.mark.parametrize("w, real, b_pad", [(2, 1, 1), (2, 3, 4), (4, 5, 8), (1, 7, 8), (8, 2, 2)])
def test_a_uniform_batch_runs_the_graph_of_its_length_padded_by_requests(w, real, b_pad):
    from vllm.config import CUDAGraphMode

    d = dispatcher()
    graphs.add_length_keys(d, (1, 2, 4, 8), max_num_seqs=8)
    d.dispatch = graphs._dispatch_by_length(type(d).dispatch).__get__(d)
    d.uniform_decode_query_len = w  # what _UniformLength sets for the call
    mode, desc = d.dispatch(real * w, uniform_decode=True)
    assert mode == CUDAGraphMode.FULL and (desc.num_tokens, desc.num_reqs, desc.uniform) == (b_pad * w, b_pad, True)
    # drafting off or a batch with rows of other lengths is not a uniform batch of w: vLLM's own
    # dispatch (piecewise by tokens)
    mode, desc = d.dispatch(real * w, uniform_decode=False)
    assert mode == CUDAGraphMode.PIECEWISE and desc.num_reqs is None and not desc.uniform


def test_vllms_own_length_and_lengths_without_a_graph_keep_vllms_dispatch():
    from vllm.config import CUDAGraphMode

    d = dispatcher()
    graphs.add_length_keys(d, (1, 2), max_num_seqs=8)
    d.dispatch = graphs._dispatch_by_length(type(d).dispatch).__get__(d)
    d.uniform_decode_query_len = 16  # K + 1: vLLM's own keys and padding
    mode, desc = d.dispatch(3 * 16, uniform_decode=True)
    assert mode == CUDAGraphMode.FULL and (desc.num_tokens, desc.num_reqs) == (48, 3)
    d.uniform_decode_query_len = 2  # one of ours, but no graph for 100 requests: piecewise, no assertion
    mode, desc = d.dispatch(200, uniform_decode=True)
    assert mode == CUDAGraphMode.NONE or not desc.uniform
    # only piecewise allowed (e.g. cascade attention): our graph is not taken
    mode, _ = d.dispatch(4, uniform_decode=True, invalid_modes={CUDAGraphMode.FULL})
    assert mode != CUDAGraphMode.FULL


def test_nothing_added_with_lora_or_without_full_decode_graphs():
    from vllm.config import CUDAGraphMode

    d = dispatcher(lora=SimpleNamespace(max_loras=1, specialize_active_lora=False))
    assert graphs.add_length_keys(d, (1, 2), max_num_seqs=8) == 0 and d.hspec_lengths == {}
    d = dispatcher()
    d.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert graphs.add_length_keys(d, (1, 2), max_num_seqs=8) == 0


def test_graph_lengths_follow_the_options(tmp_path):
    """Only the gated step (w = 1) gets a graph of its own: selected lengths, fixed or from a policy,
    run in vLLM's K + 1 graphs (every draft scheduled, the step cut on the device)."""
    import json

    policy = json.loads(open("examples/policy_synth.json").read())
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy))

    def config(options, k=7):
        return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                               additional_config={"hybridspec": options})

    assert graphs.graph_lengths(config({})) == (1,)  # drafting off; K + 1 is vLLM's own
    assert graphs.graph_lengths(config({"fixed_length": 3})) == (1,)
    assert graphs.graph_lengths(config({"policy": str(path)}, k=policy["draft_len"])) == (1,)
    assert graphs.graph_lengths(config({"full_graph_lengths": [2, 4, 8]})) == (2, 4)
    assert graphs.graph_lengths(config({"full_graph_lengths": False})) == ()
    assert graphs.graph_lengths(SimpleNamespace(speculative_config=None, additional_config={})) == ()
    assert graphs.graph_lengths(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=7),
                                                additional_config={})) == ()


class _Runner:
    def __init__(self, d, w=16):
        self.cudagraph_dispatcher, self.uniform_decode_query_len = d, w


def test_a_capture_of_one_of_our_keys_runs_its_dummy_batch_at_its_length():
    """``_warmup_and_capture(desc)``: vLLM's ``_dummy_run`` reads ``runner.uniform_decode_query_len`` for
    the tokens per request of a uniform capture; it is our key's length for the call, K + 1 after."""
    from vllm.forward_context import BatchDescriptor

    d = dispatcher()
    graphs.add_length_keys(d, (1, 4), max_num_seqs=8)
    seen = []
    wrapped = graphs._capture_per_length(
        lambda self, desc, *a, **k: seen.append((self.uniform_decode_query_len, d.uniform_decode_query_len)))
    runner = _Runner(d)
    wrapped(runner, BatchDescriptor(num_tokens=8, num_reqs=2, uniform=True))
    wrapped(runner, BatchDescriptor(num_tokens=32, num_reqs=2, uniform=True))  # vLLM's own K + 1 key
    wrapped(runner, BatchDescriptor(num_tokens=64))  # a piecewise key
    assert seen == [(4, 4), (16, 16), (16, 16)]
    assert runner.uniform_decode_query_len == d.uniform_decode_query_len == 16


def test_a_served_step_of_one_length_is_uniform_at_that_length_and_its_mode_is_counted():
    """``_determine_batch_execution_and_padding``: vLLM's ``_is_uniform_decode`` compares the step's
    longest row with ``uniform_decode_query_len``; set to the step's ``w`` when every row has ``w``
    tokens; the mode each served step ran in is counted per length and batch size."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    d = dispatcher()
    graphs.add_length_keys(d, (1, 2, 4), max_num_seqs=8)
    calls = []

    def original(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, *a, **k):
        uniform = GPUModelRunner._is_uniform_decode(max_num_scheduled_tokens, self.uniform_decode_query_len,
                                                    num_tokens, num_reqs, k.get("force_uniform_decode"))
        calls.append((self.uniform_decode_query_len, uniform))
        return (CUDAGraphMode.FULL if uniform else CUDAGraphMode.PIECEWISE), None, False, None, None

    wrapped = graphs._uniform_per_length(original)
    runner = _Runner(d)
    wrapped(runner, 8, 4, None, 2, use_cascade_attn=False)  # 4 rows of 2 tokens
    wrapped(runner, 7, 4, None, 2, use_cascade_attn=False)  # rows of 2 and 1 tokens: not uniform
    wrapped(runner, 3, 3, None, 1, use_cascade_attn=False)  # drafting off
    wrapped(runner, 8, 4, None, 2, use_cascade_attn=False, force_uniform_decode=True)  # a dummy run: not counted
    assert calls == [(2, True), (16, False), (1, True), (2, True)]
    assert runner.uniform_decode_query_len == 16
    assert graphs.graph_mode_counts(runner) == {"w=1 B=3 FULL": 1, "w=2 B=4 FULL": 1, "w=mixed B=4 PIECEWISE": 1}


def test_the_vllm_symbols_the_length_graphs_rely_on_keep_their_shape():
    import inspect

    from vllm.forward_context import BatchDescriptor
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    params = list(inspect.signature(CudagraphDispatcher.dispatch).parameters)
    assert params == ["self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras", "valid_modes",
                      "invalid_modes"]
    assert {"num_tokens", "num_reqs", "uniform", "has_lora", "num_active_loras"} <= set(
        BatchDescriptor.__dataclass_fields__ if hasattr(BatchDescriptor, "__dataclass_fields__")
        else BatchDescriptor._fields)
    assert callable(CudagraphDispatcher.add_cudagraph_key) and callable(CudagraphDispatcher.get_capture_descs)
    assert list(inspect.signature(GPUModelRunner._warmup_and_capture).parameters)[:3] == ["self", "desc",
                                                                                           "cudagraph_runtime_mode"]
    determine = list(inspect.signature(GPUModelRunner._determine_batch_execution_and_padding).parameters)
    assert determine[:5] == ["self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens"]
    assert "force_uniform_decode" in determine
    run = inspect.getsource(GPUModelRunner._dummy_run)
    assert "max_query_len = self.uniform_decode_query_len if uniform_decode else num_tokens" in run
    determine_src = inspect.getsource(GPUModelRunner._determine_batch_execution_and_padding)
    assert "uniform_decode_query_len=self.uniform_decode_query_len" in determine_src
    assert "batch_desc.num_reqs if batch_desc.num_reqs is not None else num_reqs" in inspect.getsource(
        GPUModelRunner.execute_model)
    assert "self.cudagraph_dispatcher.initialize_cudagraph_keys(" in inspect.getsource(
        GPUModelRunner._check_and_update_cudagraph_mode)
