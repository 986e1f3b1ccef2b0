"""The ``"hybridspec"`` sub-dict of ``--speculative-config``: throughput-aware verification options.

    --speculative-config '{"method": "hspec", "model": "...", "num_speculative_tokens": 15,
                           "hybridspec": {"policy": "policy.json", "select": true, "gdn_kernel": true}}'

It is popped from the speculative config in the main process (``spec_config.resolve_speculative_config``),
validated there (a bad value is a ``ValueError`` naming it, before any worker starts) and carried to
every worker in ``VllmConfig.additional_config["hybridspec"]``; workers read it back with
:func:`hybridspec_options`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm_hybridspec.policy.errors import did_you_mean

ADDITIONAL_CONFIG_KEY = "hybridspec"


class HybridSpecOptions(BaseModel):
    """Every key is optional; an empty dict means vLLM's own verification with the H-Spec drafter."""

    model_config = ConfigDict(extra="forbid")

    policy: str | None = Field(
        default=None, description="policy file (`hybridspec calibrate fit`) that picks verification lengths")
    select: bool | None = Field(
        default=None, description="verify only the policy's selected prefix of each draft (default: on "
        "when a policy is given)")
    batched: bool = Field(default=False, description="one shared length per batch (the policy's batched variant)")
    routing: bool | None = Field(
        default=None, description="HybridSpec's routing correction: the first MoE layer's router decides whether "
        "each request's draft after its selected length is verified too, from the new experts it brings "
        "(default: on when the policy file has a 'routing' section and lengths are selected per request)")
    gate: bool = Field(default=True, description="turn drafting off for steps whose batch size the policy's "
                       "gate table marks as slower than plain decoding")
    gdn_kernel: bool | None = Field(default=None, description="verify GDN layers with the parallel kernel and one "
                                    "state slot per request (true), or keep vLLM's own GDN spec-decode path "
                                    "(false); default: on when its requirements hold")
    capture: str | None = Field(default=None, description="write calibration round records (JSONL) here "
                                "(capture.py); verifies every draft token")
    fixed_length: int | None = Field(default=None, ge=1, description="verify exactly this many tokens "
                                     "(anchor + drafts) per request; for `calibrate costs`")
    drafter_cudagraphs: bool = Field(default=True, description="replay the H-Spec drafting round from CUDA "
                                     "graphs (GPU, unless enforce_eager); false runs it eagerly")
    drafter_compile: bool = Field(default=False, description="run the H-Spec drafter's layers through "
                                  "torch.compile (fewer, fused kernels; the first round compiles them)")
    drafter_fused_norms: bool = Field(default=True, description="run the H-Spec drafter's RMS norms as one "
                                      "Triton kernel each (GPU; drafter.fused.fuse_norms); false: torch's ops")
    drafter_grouped_attention: bool = Field(
        default=True, description="run the H-Spec drafter's attention as two batched matmuls per layer, query "
        "heads grouped by KV head (GPU; drafter.attention.grouped_attention); false: torch's SDPA")
    drafter_candidate_heads: int = Field(default=0, ge=0, description="run the H-Spec drafter's Markov heads "
                                         "through this many candidate previous tokens per position (one pass "
                                         "over W2; kernels.markov.markov_heads(candidates=M)); 0: per position")
    full_graph_lengths: bool | list[int] = Field(
        default=True, description="capture full CUDA graphs for uniform batches of one token per request, the gated "
        "step (true), of the listed lengths, or none besides vLLM's K + 1 (false); selected lengths run in vLLM's "
        "K + 1 graphs")
    tp_broadcast: bool = Field(default=True, description="broadcast the selected lengths from TP rank 0")
    full_graph_spec_steps: bool = Field(
        default=True, description="with the one-slot GDN layer on a GPU, replay spec steps from vLLM's full CUDA "
        "graphs; false runs the engine piecewise")
    gdn_fused_conv: bool = Field(
        default=True, description="with the one-slot GDN layer on a GPU, commit each round's conv window and "
        "convolve its tokens in one Triton launch per layer (kernels.gdn.conv.spec_conv); false: the same as "
        "torch ops (spec_conv_torch)")

    @model_validator(mode="after")
    def _consistent(self) -> HybridSpecOptions:
        if self.select is None:
            self.select = self.policy is not None
        if self.select and self.policy is None:
            raise ValueError('"select": true needs "policy": the policy file that picks the lengths')
        if self.batched and not self.select:
            raise ValueError('"batched": true needs length selection ("select": true and a "policy")')
        if self.fixed_length is not None and self.select:
            raise ValueError('"fixed_length" forces one length; it cannot be combined with "select"')
        if self.capture is not None and (self.select or self.fixed_length is not None):
            raise ValueError('"capture" verifies every draft token; drop "select"/"fixed_length"')
        if self.routing and (not self.select or self.batched):
            raise ValueError('"routing": true corrects lengths selected per request: it needs "policy" (with '
                             'selection on) and "batched": false')
        return self

    def trimming(self, num_speculative_tokens: int) -> tuple[str, str] | None:
        """The option, if any, that makes the target verify fewer tokens than were drafted (length
        selection, or a fixed length below ``K + 1``): its key and how errors describe it."""
        if self.select:
            return "policy", f'"policy": {self.policy!r} (length selection)'
        if self.fixed_length is not None and self.fixed_length < num_speculative_tokens + 1:
            return "fixed_length", (f'"fixed_length": {self.fixed_length} (below num_speculative_tokens + 1 = '
                                    f"{num_speculative_tokens + 1})")
        return None

    def check(self, num_speculative_tokens: int) -> None:
        """Checks that need the engine's settings or the file system; raises ``ValueError``."""
        w_max = num_speculative_tokens + 1
        if isinstance(self.full_graph_lengths, list):
            bad = [w for w in self.full_graph_lengths if isinstance(w, bool) or not 1 <= w <= w_max]
            if bad or not self.full_graph_lengths:
                raise ValueError(f"hybridspec.full_graph_lengths={self.full_graph_lengths!r}: give lengths in "
                                 f"1..num_speculative_tokens + 1 = {w_max}, or true / false")
        if self.fixed_length is not None and self.fixed_length > w_max:
            raise ValueError(f"hybridspec.fixed_length={self.fixed_length} exceeds num_speculative_tokens + 1 "
                             f"= {w_max}")
        if self.policy is not None:
            from vllm_hybridspec.policy.policy_file import load_policy

            policy = load_policy(self.policy)  # InputError (a ValueError) naming the bad field
            if policy.draft_len != num_speculative_tokens:
                raise ValueError(f"policy file {self.policy!r} was calibrated for draft_len={policy.draft_len} "
                                 f"but num_speculative_tokens={num_speculative_tokens}")
            if self.batched and not policy.batched:
                raise ValueError(f"hybridspec.batched=True needs a policy file with a 'batched' section (cost "
                                 f"curves per batch size, from a cost file with 'batched'); {self.policy!r} has none")
            if self.routing and policy.routing is None:
                raise ValueError(f"hybridspec.routing=True needs a policy file with a 'routing' section (from a cost "
                                 f"file with stage0 and expert costs and records with n_new_l0); {self.policy!r} "
                                 "has none")
        if self.capture is not None:
            from vllm_hybridspec.policy.files import check_writable

            # the workers open it for writing at start-up: a directory, a missing directory above it
            # or one without write permission would end the engine there, so they end it here
            check_writable(Path(self.capture).expanduser().resolve(), "hybridspec.capture")  # InputError


def vllm_gdn_path_problem(options: HybridSpecOptions | None, num_speculative_tokens: int) -> str | None:
    """For a target with GDN layers: the error when ``options`` keep vLLM's own GDN spec path
    (``"gdn_kernel": false``) and trim the verified length, which that path does not survive exactly
    (checked in the main process by ``config.resolve_speculative_config`` and in every process by
    ``gdn.enable.gdn_kernel_enabled``)."""
    trims = None if options is None or options.gdn_kernel is not False else options.trimming(num_speculative_tokens)
    if trims is None:
        return None
    key, what = trims
    return (f'"hybridspec": {{"gdn_kernel": false}} with {what}: vLLM\'s own GDN spec-decode path is not exact '
            "when the target verifies fewer tokens than were drafted (docs/benchmarks/choices.md); drop "
            f'"gdn_kernel": false (the one-slot GDN layer) or "{key}"')


def parse_options(raw: Any, num_speculative_tokens: int) -> HybridSpecOptions:
    """Validate the user's ``"hybridspec"`` value; errors name the bad key and value.

    Strict: JSON gives every value its type, so ``"true"`` for a bool or ``"3"`` for a number is a typo
    to report, not a value to coerce."""
    if not isinstance(raw, dict):
        raise ValueError(f'"hybridspec" in --speculative-config must be a JSON object, got {raw!r}')
    try:
        options = HybridSpecOptions.model_validate(raw, strict=True)
    except ValidationError as e:
        raise ValueError(f'invalid "hybridspec" options: {validation_problems(e, raw, HybridSpecOptions)}') from None
    options.check(num_speculative_tokens)
    return options


def validation_problems(error: ValidationError, raw: dict, model: type[BaseModel]) -> str:
    """pydantic's multi-line ``error`` as one line: per top-level key of ``raw``, what would be valid
    (a union's members joined by "or") and the value given; an unknown key with ``model``'s keys."""
    by_key: dict[str, list[str]] = {}
    for err in error.errors(include_url=False):
        msg = err["msg"].removeprefix("Value error, ")
        key = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            msg = f"unknown key{did_you_mean(key, model.model_fields)}, valid keys are {', '.join(model.model_fields)}"
        items = [i for i in err["loc"][1:] if isinstance(i, int)]  # inside a list
        msg += f" at item {items[-1]}" if items else ""
        if msg not in by_key.setdefault(key, []):
            by_key[key].append(msg)
    return "; ".join(f"{key}: {_either(msgs)} (got {raw.get(key)!r})" if key else _either(msgs)
                     for key, msgs in by_key.items())


def _either(msgs: list[str]) -> str:
    """``["Input should be a valid boolean", "Input should be a valid list"]`` as "Input should be a
    valid boolean or a valid list"."""
    head = "Input should be "
    if len(msgs) > 1 and all(m.startswith(head) for m in msgs):
        return head + " or ".join(m.removeprefix(head) for m in msgs)
    return " or ".join(msgs)


def hybridspec_options(vllm_config) -> HybridSpecOptions | None:
    """The validated options in a worker, or ``None`` when the user gave none."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(ADDITIONAL_CONFIG_KEY)
    return None if raw is None else HybridSpecOptions.model_validate(raw)
