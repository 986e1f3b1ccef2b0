"""Whether the GDN layers run with one state slot per request, and the page size that follows.

On when: spec decoding is configured, the target's SSM cache is float32, ``mamba_cache_mode ==
"none"``, ``num_speculative_tokens + 1 <= 16``, and ``"hybridspec": {"gdn_kernel": false}`` is not
given. With ``"gdn_kernel": true`` or a trimmed length an unmet requirement is an error naming the
value, and so is ``"gdn_kernel": false`` with a trimmed length: vLLM's own GDN spec path is not exact
when fewer tokens are verified than drafted (the measurements: ``docs/benchmarks/choices.md``). Left
unset otherwise, it falls back to vLLM's own GDN path with a warning.

On GPUs the layer's spec steps run in vLLM's full CUDA graphs, where it gives plain decoding's greedy
output, verifying every draft and with selected lengths (``docs/benchmarks/choices.md``).
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)

from vllm_hybridspec.engine.compat import has_gdn_layers
from vllm_hybridspec.engine.options import hybridspec_options, vllm_gdn_path_problem
from vllm_hybridspec.kernels.gdn import MAX_VERIFY_LEN

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def gdn_kernel_enabled(vllm_config) -> bool:
    """Whether the GDN layers run with one state slot per request (see the module docstring).

    Called by the layer and by the model classes' page-size computation (the two must agree), in
    every process; raises ``ValueError`` naming the bad setting when the user asked for it
    (``"hybridspec": {"gdn_kernel": true}``) and a requirement does not hold."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.num_speculative_tokens:
        return False
    options = hybridspec_options(vllm_config)
    asked = None if options is None else options.gdn_kernel
    trims = None if options is None else options.trimming(spec.num_speculative_tokens)
    if asked is False:
        problem = vllm_gdn_path_problem(options, spec.num_speculative_tokens)
        if problem is not None:
            raise ValueError(problem)
        return False
    explicit = asked is True or trims is not None
    problem = _unmet_requirement(vllm_config)
    if problem is None:
        return True
    if asked is True:
        raise ValueError(f'"hybridspec": {{"gdn_kernel": true}} cannot run: {problem}; or set "gdn_kernel": false '
                         "to keep vLLM's own GDN spec-decode path")
    if explicit:
        key, what = trims
        raise ValueError(f'"hybridspec" {what} needs the one-slot GDN layer on this GDN target, which cannot run: '
                         f'{problem}; or drop "{key}" (vLLM\'s own GDN spec path then verifies every draft)')
    if problem not in _warned:
        _warned.add(problem)
        logger.warning("vllm-hybridspec: GDN layers use vLLM's own spec-decode path (a state slot per "
                       "draft token) because %s", problem)
    return False


def on_vllm_gdn_path(vllm_config) -> bool:
    """Whether the target has GDN layers and they run vLLM's own spec-decode path: then the target
    must verify every draft (``LengthSelector.configure`` refuses trimmed lengths at run time as
    :func:`gdn_kernel_enabled` does at start)."""
    return has_gdn_layers(vllm_config.model_config.hf_config) and not gdn_kernel_enabled(vllm_config)


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def needs_torch_prefill(model_dtype: torch.dtype, on_cuda: bool) -> bool:
    """Whether a GDN layer prefills through ``engine.cpu.ops.TorchChunkGatedDeltaRule``: float32 targets
    on a CUDA device, where vLLM 0.26's FLA chunk kernel asserts on float32 inputs (on the CPU the
    plugin's patched CPU ops already run float32)."""
    return on_cuda and model_dtype == torch.float32


def _unmet_requirement(vllm_config) -> str | None:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        mode = vllm_config.compilation_config.cudagraph_mode
        if not vllm_config.model_config.enforce_eager and mode is not None and mode.mixed_mode().name == "FULL":
            # uniform batches (every row w tokens) are capture-safe; a mixed batch's layout (which rows
            # are rounds, one-token rounds or prefills) is the step's host plan, fixed into a graph
            return (f"cudagraph_mode={mode.name} runs mixed prefill/decode batches in full CUDA graphs, and the "
                    "one-slot layer lays out a mixed batch from the step's host plan; use FULL_AND_PIECEWISE "
                    "(vLLM's default), FULL_DECODE_ONLY, PIECEWISE or --enforce-eager")
    elif not current_platform.is_cpu():
        return f"platform {current_platform.device_name!r} is not supported (CPU and CUDA are)"
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    if pp > 1:
        # a round's committed count comes from sampling, which only the last pipeline stage does
        return (f"pipeline_parallel_size={pp}: the one-slot commit takes its counts from sampling, on the last "
                "stage only")
    k = vllm_config.speculative_config.num_speculative_tokens
    if k + 1 > MAX_VERIFY_LEN:
        return f"num_speculative_tokens={k} but the GDN verify kernel takes at most {MAX_VERIFY_LEN - 1} drafts"
    cache = vllm_config.cache_config
    if cache.mamba_cache_mode != "none":
        return (f"mamba_cache_mode={cache.mamba_cache_mode!r} (prefix caching of hybrid models); only "
                "'none' is supported (turn prefix caching off)")
    _, ssm_dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
    if ssm_dtype != torch.float32:
        return (f"the SSM state cache is {ssm_dtype} (mamba_ssm_cache_dtype={cache.mamba_ssm_cache_dtype!r}); "
                "the parallel verification needs float32: pass --mamba-ssm-cache-dtype float32")
    return None


def one_slot_state_shape(vllm_config, hf_text_config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (conv, ssm) state shapes of one GDN layer with the conv window plain decoding keeps
    (``K_conv - 1`` columns, no spec columns); local head shard."""
    return MambaStateShapeCalculator.gated_delta_net_state_shape(
        vllm_config.parallel_config.tensor_parallel_size,
        hf_text_config.linear_num_key_heads,
        hf_text_config.linear_num_value_heads,
        hf_text_config.linear_key_head_dim,
        hf_text_config.linear_value_head_dim,
        hf_text_config.linear_conv_kernel_dim,
        0,
    )


def one_slot_page_shape(vllm_config, hf_text_config):
    """For :func:`one_slot_page_size`: the one-slot shapes when the layer will be on,
    ``None`` (vLLM's own shapes) otherwise."""
    return one_slot_state_shape(vllm_config, hf_text_config) if gdn_kernel_enabled(vllm_config) else None


def one_slot_page_size(original):
    """The wrapper of the classmethod ``get_mamba_state_shape_from_config(vllm_config)`` of vLLM 0.26's
    ``Qwen3NextForCausalLM``, ``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``
    (the Qwen3.5 MoE class inherits it from the dense one; rows of ``engine/patches/table.py``): the one-slot
    shapes when the layer will be on, vLLM's otherwise.

    Why: ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``) sizes the attention
    block and ``cache_config.mamba_page_size_padded`` from this classmethod *before* any layer exists,
    with ``num_spec = num_speculative_tokens`` conv columns; the one-slot layer's page is the plain
    decoding page, and ``MambaSpec`` asserts the layer's page fits the padded one. A model-class
    registration over the same architecture names would do the same with more surface."""
    def get_mamba_state_shape_from_config(model_cls, vllm_config):
        shape = one_slot_page_shape(vllm_config, vllm_config.model_config.hf_text_config)
        return shape if shape is not None else original(model_cls, vllm_config)

    return get_mamba_state_shape_from_config
