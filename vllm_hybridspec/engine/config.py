"""``--speculative-config`` with ``"method": "hspec"``: validation at engine start, and the translation
to what vLLM 0.26 runs (its "dflash" parallel-drafting path with an ``HSpecDraftModel`` draft).

Everything here runs in the main process before any worker starts (see
:func:`resolved_speculative_config`), so a bad configuration is a ``ValueError`` that
names the bad value, never a hung or crashed worker.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vllm_hybridspec.drafter.config import HSpecSpeculatorConfig
from vllm_hybridspec.drafter.target import check_kv_reuse, text_config
from vllm_hybridspec.engine.compat import (
    HSPEC_ARCHITECTURE,
    HSPEC_METHOD,
    any_vllm,
    check_vllm_version,
    has_gdn_layers,
    is_hspec_speculative_config,
    vllm_speculative_methods,
)
from vllm_hybridspec.engine.drafting.checkpoint import check_weight_files, read_config_json
from vllm_hybridspec.engine.length.gate import scheduler_schedule
from vllm_hybridspec.engine.options import (
    ADDITIONAL_CONFIG_KEY,
    parse_options,
    validation_problems,
    vllm_gdn_path_problem,
)
from vllm_hybridspec.engine.replay.config import REPLAY_METHOD, resolve_replay_speculative_config


def read_speculators_config(model: str) -> dict[str, Any] | None:
    """``config.json`` of a local directory or hub id, or ``None`` when there is none; a local one that
    is not a JSON object is a ``ValueError`` naming it."""
    path = Path(model)
    if path.is_dir():
        file = path / "config.json"
        return read_config_json(file) if file.exists() else None
    if path.exists() or model.startswith((".", "/")):
        return None
    try:
        from transformers import PretrainedConfig

        config_dict, _ = PretrainedConfig.get_config_dict(model)
        return config_dict
    except (OSError, ValueError):
        return None


def is_hspec_checkpoint(config_dict: dict[str, Any] | None) -> bool:
    return bool(config_dict) and config_dict.get("speculators_model_type") == HSPEC_METHOD


def resolve_speculative_config(spec: dict[str, Any], target_model_config, load_format: str = "auto",
                               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Translate a user's speculative config into ``(spec for vLLM, additional_config entries)``.

    The ``"hybridspec"`` sub-dict (``options.HybridSpecOptions``) is popped and validated, and travels to
    the workers as ``additional_config["hybridspec"]``. ``load_format`` is the engine's (vLLM loads
    the drafter with it): it says which weight files of a local H-Spec checkpoint are checked."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    raw_options = spec.pop(ADDITIONAL_CONFIG_KEY, None)
    extra: dict[str, Any] = {}
    if spec.get("method") == REPLAY_METHOD:  # benchmarking only (engine/replay/)
        spec, extra = resolve_replay_speculative_config(spec, target_model_config, load_format,
                                                        resolve_hspec=resolve_speculative_config)
    else:
        spec = _resolve_method(spec, target_model_config, load_format)
    if raw_options is None:
        return spec, extra
    k = spec.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f'"hybridspec" options need "num_speculative_tokens" >= 1 in the speculative config, got {k!r}')
    options = parse_options(raw_options, k)
    problem = vllm_gdn_path_problem(options, k) if has_gdn_layers(getattr(target_model_config, "hf_config", None)) else None
    problem = problem or routing_problem(options, getattr(target_model_config, "hf_config", None))
    if problem is not None:
        raise ValueError(problem)
    schedule = scheduler_schedule(options, k)  # the batch gate in vLLM's scheduler (length/gate.py)
    if schedule is not None and spec.get("num_speculative_tokens_per_batch_size") is None:
        spec["num_speculative_tokens_per_batch_size"] = schedule
    return spec, {**extra, ADDITIONAL_CONFIG_KEY: options.model_dump()}


def routing_problem(options, target_hf_config) -> str | None:
    """The error when the options' policy has routing tables (HybridSpec's routing correction, on unless
    ``"routing": false``) that the target's router cannot use: Stage 0 counts new experts among the
    router's top-k choices, so the target must route each token to ``experts_per_token`` experts by a
    softmax top-k, as many as the tables were fitted for."""
    if options.routing is False or not options.select or options.batched:
        return None
    from vllm_hybridspec.policy.policy_file import load_policy

    routing = load_policy(options.policy).routing
    if routing is None or target_hf_config is None:
        return None
    k = routing.experts_per_token
    cfg = text_config(target_hf_config)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    where = f'policy file {options.policy!r} has routing tables for {k} experts per token'
    if top_k is None:
        return f'{where}, but the target has no mixture-of-experts router; give "routing": false or another policy'
    if top_k != k:
        return (f"{where}, but the target routes each token to num_experts_per_tok={top_k}; fit the policy for "
                'this target, or give "routing": false')
    if getattr(cfg, "scoring_func", "softmax") != "softmax" or (getattr(cfg, "n_group", None) or 1) > 1:
        return (f"{where}, but the target's router is not a softmax top-k (scoring_func="
                f"{getattr(cfg, 'scoring_func', None)!r}, n_group={getattr(cfg, 'n_group', None)!r}), whose choices "
                'Stage 0 counts; give "routing": false')
    return None


def _resolve_method(spec: dict[str, Any], target_model_config, load_format: str) -> dict[str, Any]:
    """Anything not H-Spec passes through unchanged (an unknown method is reported with the valid
    ones, "hspec" included); an H-Spec one is validated (its config against the target, the weight
    files of a local checkpoint, ``num_speculative_tokens`` against its block) and returned as vLLM's
    ``"dflash"`` method with the H-Spec checkpoint as its model."""
    method, model = spec.get("method"), spec.get("model")
    checkpoint = read_speculators_config(model) if isinstance(model, str) and method in (
        None, HSPEC_METHOD, "dflash", "draft_model") else None
    if method != HSPEC_METHOD and not is_hspec_checkpoint(checkpoint):
        valid = vllm_speculative_methods()
        if method is not None and method not in valid and method != "[ngram]":
            raise ValueError(
                f"unknown speculative method {method!r}; valid methods are {[*valid, HSPEC_METHOD, REPLAY_METHOD]} "
                f"({HSPEC_METHOD!r} and {REPLAY_METHOD!r}, for benchmarking only, come from vllm-hybridspec)"
            )
        return spec

    if not any_vllm():
        check_vllm_version()
    if not model:
        raise ValueError(
            f'speculative method "{HSPEC_METHOD}" needs "model": the path or hub id of an H-Spec '
            "checkpoint (a speculators-format directory written by `hybridspec train`)"
        )
    if checkpoint is None:
        raise ValueError(
            f"H-Spec checkpoint {model!r} not found: expected a directory (or hub id) with a "
            "speculators-format config.json"
        )
    if not is_hspec_checkpoint(checkpoint):
        raise ValueError(
            f"{model!r} is not an H-Spec checkpoint: its config.json has speculators_model_type="
            f"{checkpoint.get('speculators_model_type')!r}, expected {HSPEC_METHOD!r}"
        )
    try:
        hspec = HSpecSpeculatorConfig.model_validate(copy.deepcopy(checkpoint))
    except ValidationError as e:
        problems = validation_problems(e, checkpoint, HSpecSpeculatorConfig)
        raise ValueError(f"H-Spec drafter {model!r} has an invalid config.json: {problems}") from None
    check_against_target(hspec, target_model_config.hf_config, model)
    k = num_speculative_tokens(spec.get("num_speculative_tokens"), hspec, model)
    draft_load = spec.get("draft_load_config")  # a LoadConfig (or its dict) vLLM loads the drafter with
    if draft_load is not None:
        load_format = draft_load.get("load_format", "auto") if isinstance(draft_load, dict) else draft_load.load_format
    if Path(model).is_dir():  # a hub id's files are vLLM's to download
        check_weight_files(Path(model), load_format)
    return {**spec, "method": "dflash", "model": model, "num_speculative_tokens": k}


def num_speculative_tokens(k: Any, hspec: HSpecSpeculatorConfig, name: str) -> int:
    """The drafts per round: ``k`` when an integer in ``1..block_size - 1`` (vLLM's ``gt=0`` field, and
    no more than the drafter's block holds), the full block when absent (``None``). A bool, float or
    string is refused rather than coerced: ``0`` or ``"7"`` is a typo, and a silent 7 would hide it."""
    max_tokens = hspec.num_draft_tokens
    if k is None:
        return max_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= max_tokens:
        raise ValueError(
            f"num_speculative_tokens={k!r} is not valid for the H-Spec drafter {name!r} (block_size="
            f"{hspec.block_size}): use an integer in 1..{max_tokens}, or leave it out to draft all {max_tokens}"
        )
    return k


def check_against_target(hspec: HSpecSpeculatorConfig, target_hf_config, name: str) -> None:
    """The drafter reads the target's KV cache and hidden states as they are: shapes must agree."""
    target = text_config(target_hf_config)
    try:
        check_kv_reuse(target, hspec.kv_reuse_layer_ids, hspec.attention_geometry)
    except ValueError as e:
        raise ValueError(f"H-Spec drafter {name!r} does not fit the target: {e}") from None
    if hspec.transformer_layer_config.hidden_size != target.hidden_size:
        raise ValueError(
            f"H-Spec drafter {name!r} has hidden size {hspec.transformer_layer_config.hidden_size} but "
            f"the target's is {target.hidden_size}"
        )
    n = target.num_hidden_layers
    bad = [i for i in hspec.aux_hidden_state_layer_ids if not 0 <= i < n]
    if bad or not hspec.aux_hidden_state_layer_ids:
        raise ValueError(
            f"H-Spec drafter {name!r}: aux_hidden_state_layer_ids {hspec.aux_hidden_state_layer_ids} must be "
            f"a non-empty list of target layers in [0, {n - 1}] (vLLM captures layer inputs)"
        )
    if hspec.mask_token_id is None:
        raise ValueError(f"H-Spec drafter {name!r} has no mask_token_id in its config.json")
    if hspec.draft_vocab_size != target.vocab_size:
        raise ValueError(
            f"H-Spec drafter {name!r} has a pruned draft vocabulary ({hspec.draft_vocab_size} of "
            f"{target.vocab_size} tokens); the vLLM plugin supports only the full target vocabulary"
        )


def speculators_to_vllm(config_dict: dict, pre_trained_config: dict) -> None:
    """The ``hspec`` speculators-config updater (vLLM's ``register_speculator`` convention): the draft's
    transformers config becomes an ``HSpecDraftModel`` that vLLM's DFlash machinery can drive."""
    original = copy.deepcopy(config_dict)
    pre_trained_config["architectures"] = [HSPEC_ARCHITECTURE]
    pre_trained_config["draft_vocab_size"] = config_dict.get("draft_vocab_size")
    aux = list(config_dict.get("aux_hidden_state_layer_ids") or [])
    # the runner asks the target for these layers' inputs (gpu_model_runner._get_eagle3_aux_layers_from_config)
    pre_trained_config["eagle_aux_hidden_state_layer_ids"] = aux
    # read by DFlashProposer: the mask token of the parallel-drafting slots, and a causal draft
    pre_trained_config["dflash_config"] = {
        "mask_token_id": config_dict.get("mask_token_id"),
        "target_layer_ids": [i - 1 for i in aux],
        "causal": True,
    }
    pre_trained_config["hspec_config"] = original


def resolved_speculative_config(original):
    """The wrapper of ``vllm.engine.arg_utils.EngineArgs.create_speculative_config`` (``engine/patches/table.py``).

    Why: ``SpeculativeConfig.method`` is a pydantic ``Literal`` that has no "hspec", and
    ``SpeculativeConfig.__post_init__`` rejects unknown methods, so "hspec" has to be translated before
    the dict becomes a ``SpeculativeConfig``. This is the one place both ``vllm serve
    --speculative-config`` and ``LLM(speculative_config=...)`` (and the speculators-checkpoint-as-model
    path, ``maybe_override_with_speculators``) go through, in the main process, before any worker
    starts, so the validation errors of :func:`resolve_speculative_config` reach the user at engine start
    and never hang a worker. Its options are merged into ``EngineArgs.additional_config``, which reaches
    every worker as ``VllmConfig.additional_config``; vLLM loads the drafter with the engine's load
    format, which says which weight files it reads."""
    def create_speculative_config(self, target_model_config, target_parallel_config):
        if self.speculative_config is not None:
            self.speculative_config, extra = resolve_speculative_config(
                dict(self.speculative_config), target_model_config, self.load_format)
            if extra:
                # EngineArgs.additional_config becomes VllmConfig.additional_config in every worker
                self.additional_config = {**(self.additional_config or {}), **extra}
        return original(self, target_model_config, target_parallel_config)

    return create_speculative_config


def hspec_repr(speculative_config) -> str:
    """How an H-Spec configuration reads in vLLM's logs: by the method the user asked for, with the
    vLLM path it runs on, ``SpeculativeConfig(method='hspec' (vLLM path 'dflash'), model=..., num_spec_tokens=7)``."""
    return (f"SpeculativeConfig(method={HSPEC_METHOD!r} (vLLM path 'dflash'), "
            f"model={speculative_config.draft_model_config.model!r}, "
            f"num_spec_tokens={speculative_config.num_speculative_tokens})")


def speculative_config_repr(original):
    """The wrapper of ``vllm.config.speculative.SpeculativeConfig.__repr__`` (``engine/patches/table.py``), which the
    engine's start-up line ("Initializing a V1 LLM engine ... speculative_config=...") prints through
    ``VllmConfig.__str__``: an H-Spec configuration runs as vLLM's ``"dflash"`` method (see
    :func:`_resolve_method`) and would otherwise be logged under that name."""
    def __repr__(self) -> str:
        return hspec_repr(self) if is_hspec_speculative_config(self) else original(self)

    return __repr__
