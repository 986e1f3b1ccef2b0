"""Switch a running server's length selection from outside, for benchmarks that compare ways of
decoding on one engine start (``hybridspec bench --switch``).

Engine starts at full-size shapes take minutes. ``hybridspec bench --switch LABEL=OPTIONS`` measures
several settings of one server's length selector in turn (verify every draft, fixed lengths, a policy
with or without its gate, drafting off) instead of starting a server per setting. It needs the server to
be started with

    VLLM_SERVER_DEV_MODE=1 vllm serve ... --worker-extension-cls vllm_hybridspec.engine.length.control.HybridSpecWorkerExtension

(``--serve`` adds both when ``--switch`` is given). vLLM's development endpoint ``/collective_rpc``
then calls :meth:`HybridSpecWorkerExtension.hybridspec_configure` on every worker: each TP rank
switches its own selector, and the lengths stay identical across ranks since rank 0's are broadcast.
The endpoint is for development servers only; do not expose it in production.
"""

from __future__ import annotations

import json

WORKER_EXTENSION = "vllm_hybridspec.engine.length.control.HybridSpecWorkerExtension"
CONFIGURE_METHOD = "hybridspec_configure"
# what LengthSelector.configure accepts
OPTION_KEYS = ("fixed_length", "policy", "gate", "batched", "drafting")


def parse_switch_options(text: str) -> dict:
    """A ``--switch`` value's options: a JSON object with keys among :data:`OPTION_KEYS` (``{}``: verify
    every draft). Raises ``ValueError`` naming the bad value."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"switch options {text!r} are not JSON: {e}") from None
    if not isinstance(options, dict):
        raise ValueError(f"switch options must be a JSON object, got {text!r}")
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"unknown switch option(s) {unknown}; the options are {', '.join(OPTION_KEYS)}")
    for key in ("gate", "batched", "drafting"):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"switch option {key}={options[key]!r} must be true or false")
    fixed = options.get("fixed_length")
    if "fixed_length" in options and (isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 1):
        raise ValueError(f"switch option fixed_length={fixed!r} must be an integer >= 1")
    if "policy" in options and not (isinstance(options["policy"], str) and options["policy"]):
        raise ValueError(f"switch option policy={options['policy']!r} must be a policy file's path")
    if "fixed_length" in options and "policy" in options:
        raise ValueError("switch options fixed_length and policy exclude each other")
    for key in ("gate", "batched"):
        if key in options and "policy" not in options:
            raise ValueError(f"switch option {key} needs a policy (it is the policy's {key})")
    return options


class HybridSpecWorkerExtension:
    """Methods vLLM mixes into its ``Worker`` (``--worker-extension-cls``)."""

    def hybridspec_configure(self, options: str = "{}") -> dict:
        """Set this worker's length selector (``LengthSelector.configure``) from a JSON object of
        :data:`OPTION_KEYS`. Returns ``{"ok": true, "stats": ...}``, or ``{"ok": false, "error": ...}``
        naming the bad value (the selector is then unchanged)."""
        from vllm_hybridspec.engine.compat import worker_runner
        from vllm_hybridspec.engine.length.trimming import selector_of

        try:
            parsed = parse_switch_options(options)
            runner = worker_runner(self)
            if getattr(runner, "drafter", None) is None:
                # vLLM creates the drafter only with a speculative config, and only on the last pipeline stage
                if getattr(runner, "speculative_config", None) is not None:
                    return {"ok": True, "stats": {}}  # a pipeline stage without the drafter: nothing to switch
                raise ValueError("this server has no speculative config, so there is no length selector to switch")
            selector = selector_of(runner)
            if selector is None:
                raise ValueError("this server's drafter has no hybridspec length selector (a speculative config "
                                 "with method hspec, dflash or replay_bench and a \"hybridspec\" dict is needed)")
            selector.configure(**parsed)
        except (ValueError, RuntimeError, OSError) as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "stats": self.hybridspec_stats()}

    def hybridspec_stats(self) -> dict:
        """The selector's counters (rows verified at each length, steps, gated steps) and the drafts the
        rejection sampler saw after the device cut (``verified_drafts``)."""
        from vllm_hybridspec.engine.compat import worker_runner
        from vllm_hybridspec.engine.length.cut import cut_of
        from vllm_hybridspec.engine.length.trimming import selector_of

        runner = worker_runner(self)
        selector = selector_of(runner)
        if selector is None:
            return {}
        stats = selector.stats()
        cut = cut_of(runner)
        return {**stats, "rows_at_length": {str(w): n for w, n in stats["rows_at_length"].items()},
                "verified_drafts": int(cut.verified_drafts) if cut is not None else None,
                "stage0_kept": int(cut.stage0_kept) if cut is not None and cut.expand is not None else None}
