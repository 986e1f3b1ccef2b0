"""``--speculative-config '{"method": "replay_bench", "model": <H-Spec checkpoint>, ...}'``: validated in the
main process and translated to what vLLM 0.26 runs for H-Spec (benchmarking only; the proposer is
``proposer.ReplayHSpecProposer``)."""

from __future__ import annotations

from pathlib import Path

from vllm_hybridspec.engine.compat import HSPEC_METHOD
from vllm_hybridspec.engine.replay.data import load_continuations, load_replay_rounds
from vllm_hybridspec.policy.errors import InputError

REPLAY_METHOD = "replay_bench"
REPLAY_CONFIG_KEY = "replay_bench"  # the sub-dict of --speculative-config and of additional_config


def parse_replay_options(raw, k: int, vocab_size: int | None = None) -> dict:
    """Validate the ``"replay_bench"`` sub-dict ``{"records": path, "continuations": path, "seed": int}``
    against ``K`` and the target's vocabulary (both files are read); returns it normalised. Raises
    ``ValueError`` (``InputError``) naming the bad key, file, line or field."""
    if not isinstance(raw, dict):
        raise InputError(f'"{REPLAY_CONFIG_KEY}" in --speculative-config must be a JSON object '
                         f'{{"records": ..., "continuations": ..., "seed": 0}}, got {raw!r}')
    unknown = set(raw) - {"records", "continuations", "seed"}
    if unknown:
        raise InputError(f'unknown "{REPLAY_CONFIG_KEY}" keys {sorted(unknown)}; valid are "records" (round-records '
                         f'JSONL), "continuations" (`hybridspec replay-record` JSONL) and "seed"')
    for name in ("records", "continuations"):
        if not isinstance(raw.get(name), str):
            raise InputError(f'"{REPLAY_CONFIG_KEY}" needs "{name}": a file path, got {raw.get(name)!r}')
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise InputError(f'"{REPLAY_CONFIG_KEY}.seed" must be an integer >= 0, got {seed!r}')
    load_replay_rounds(raw["records"], k)
    continuations = load_continuations(raw["continuations"])
    if vocab_size is not None:
        for e in continuations.entries:
            top = int(max(e.prompt.max(), e.output.max()))
            if top >= vocab_size:
                raise InputError(f"continuations file '{continuations.path}': token id {top} (prompt starting "
                                 f"{e.prompt[:8].tolist()}) is outside the target's vocabulary of {vocab_size}; "
                                 f"was it recorded with another model?")
    return {"records": str(Path(raw["records"]).resolve()),
            "continuations": str(Path(raw["continuations"]).resolve()), "seed": seed}


def resolve_replay_speculative_config(spec: dict, target_model_config, load_format: str = "auto", *,
                                      resolve_hspec) -> tuple[dict, dict]:
    """``{"method": "replay_bench", "model": <H-Spec checkpoint>, "num_speculative_tokens": K,
    "replay_bench": {...}}`` as what an H-Spec config becomes (vLLM's ``"dflash"`` method with the
    checkpoint as its draft, validated against the target as for ``"hspec"``, its weight files as the
    engine's ``load_format`` reads them: none with ``"dummy"``); the validated options
    travel to the workers in ``additional_config["replay_bench"]``, where they make the runner's DFlash
    proposer a :class:`~vllm_hybridspec.engine.replay.proposer.ReplayHSpecProposer`. ``resolve_hspec(spec,
    target_model_config, load_format) -> (spec, extra)`` resolves the ``"hspec"`` config
    (``engine.config.resolve_speculative_config``, which calls this function with itself)."""
    spec = dict(spec)
    raw = spec.pop(REPLAY_CONFIG_KEY, None)
    if raw is None:
        raise InputError(f'speculative method "{REPLAY_METHOD}" (benchmarking only) needs "{REPLAY_CONFIG_KEY}": '
                         f'{{"records": <round records JSONL>, "continuations": <continuations JSONL>}}')
    if not spec.get("model"):
        raise InputError(f'speculative method "{REPLAY_METHOD}" needs "model": an H-Spec checkpoint (the drafter '
                         f'that runs every round, whose drafts are then replaced by replayed ones), got '
                         f'{spec.get("model")!r}')
    k = spec.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise InputError(f'speculative method "{REPLAY_METHOD}" needs "num_speculative_tokens" >= 1, got {k!r}')
    resolved, _ = resolve_hspec({**spec, "method": HSPEC_METHOD}, target_model_config, load_format)
    vocab = target_model_config.get_vocab_size() if target_model_config is not None else None
    options = parse_replay_options(raw, resolved["num_speculative_tokens"], vocab)
    return resolved, {REPLAY_CONFIG_KEY: options}


def replay_options(vllm_config) -> dict | None:
    """The ``"replay_bench"`` options :func:`resolve_replay_speculative_config` put in the workers'
    ``VllmConfig.additional_config``, or ``None`` (not a replay engine)."""
    return (getattr(vllm_config, "additional_config", None) or {}).get(REPLAY_CONFIG_KEY)
