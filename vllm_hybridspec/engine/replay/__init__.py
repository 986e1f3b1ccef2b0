"""Replayed acceptance, for benchmarking only: a proposer that proposes the target's own recorded
greedy continuation, corrupted at a rejection point drawn from recorded rounds, so a full-size
target with dummy weights is measured at a real drafter's acceptance (``docs/bench.md``)."""


def install() -> None:
    from vllm_hybridspec.engine.replay.proposer import patch_custom_class_dynamic_draft_count

    patch_custom_class_dynamic_draft_count()
