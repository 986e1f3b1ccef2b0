"""``hybridspec spec-steps-table``: one row per (B, w) of our engine, the untrimmed K + 1 row apart
from the selector's, each with vLLM's verify-all step at the same length where it was measured."""

from __future__ import annotations

import pytest

from vllm_hybridspec.tools.spec_steps import spec_steps_table
from ..seeds import fresh_seed

ID = {"precision": "bfloat16", "gpu": "NVIDIA H100 80GB HBM3"}  # inputs written before they recorded either


def row(b, w, ms, mode="FULL", **extra):
    return {"B": b, "w": w, "ms": ms, "graph_modes": {f"w={w} B={b} {mode}": 48}, **extra}


def test_the_table_keeps_the_untrimmed_row_apart_and_matches_vllm_by_length():
    ours = {"rows": [row(1, 1, 3.6), row(1, 8, 12.3), row(1, 16, 12.5), row(1, 16, 4.9, trimmed=False),
                     row(4, 16, 12.6, mode="PIECEWISE")]}
    plain = {"rows": [{"B": 1, "ms": 3.3}, {"B": 4, "ms": 3.6}]}
    vllm15 = {"speculative_config": {"num_speculative_tokens": 15}, "rows": [row(1, 16, 7.0, mode="PIECEWISE")]}
    table = spec_steps_table(ours, plain, [vllm15], "slice", "cmd", **ID)
    assert table["plain_ms"] == {"1": 3.3, "4": 3.6}
    by = {(r["B"], r["w"], r["trimmed"]): r for r in table["rows"]}
    assert set(by) == {(1, 1, True), (1, 8, True), (1, 16, True), (1, 16, False), (4, 16, True)}
    assert by[(1, 16, False)]["ours_ms"] == 4.9 and by[(1, 16, True)]["ours_ms"] == 12.5
    # vLLM's K = 15 engine verifies 16 tokens: it sits next to both w = 16 rows of B = 1, and nowhere else
    assert by[(1, 16, False)]["vllm_ms"] == by[(1, 16, True)]["vllm_ms"] == 7.0
    assert by[(1, 16, True)]["vllm_mode"] == "PIECEWISE" and by[(1, 8, True)]["vllm_ms"] is None
    assert by[(4, 16, True)]["vllm_ms"] is None and by[(4, 16, True)]["ours_mode"] == "PIECEWISE"


def test_rows_of_each_draft_kind_stay_apart_and_meet_vllm_of_the_same_kind():
    """``spec-steps --drafts model,spread``: a (B, w) row per kind, vLLM's step of the same kind beside it."""
    ours = {"rows": [row(4, 16, 5.0, drafts="model"), row(4, 16, 8.1, drafts="spread"), row(4, 2, 5.2, drafts="spread")]}
    vllm15 = {"speculative_config": {"num_speculative_tokens": 15},
              "rows": [row(4, 16, 5.8, drafts="model"), row(4, 16, 8.5, drafts="spread")]}
    table = spec_steps_table(ours, {"rows": [{"B": 4, "ms": 2.1}]}, [vllm15], "slice", "cmd", **ID)
    by = {(r["B"], r["w"], r["drafts"]): r for r in table["rows"]}
    assert set(by) == {(4, 16, "model"), (4, 16, "spread"), (4, 2, "spread")}
    assert by[(4, 16, "model")]["ours_ms"] == 5.0 and by[(4, 16, "model")]["vllm_ms"] == 5.8
    assert by[(4, 16, "spread")]["ours_ms"] == 8.1 and by[(4, 16, "spread")]["vllm_ms"] == 8.5
    assert by[(4, 2, "spread")]["vllm_ms"] is None
    # a result written before --drafts (no "drafts" key) reads as the drafter's own tokens
    old = spec_steps_table({"rows": [row(1, 16, 4.4)]}, {"rows": [{"B": 1, "ms": 2.0}]}, [vllm15], "s", "c", **ID)
    assert old["rows"][0]["drafts"] == "model" and old["rows"][0]["vllm_ms"] is None


def test_the_table_reads_each_rows_median_where_it_has_one():
    """A capture spike moves a row's mean, not its median: the table takes the median."""
    ours = {"rows": [row(1, 4, 5.14, median_ms=4.59), row(1, 16, 4.46)]}
    plain = {"rows": [{"B": 1, "ms": 2.90, "median_ms": 2.88}]}
    table = spec_steps_table(ours, plain, [], "s", "c", **ID)
    assert table["plain_ms"] == {"1": 2.88}
    assert [r["ours_ms"] for r in table["rows"]] == [4.59, 4.46]


def test_the_table_records_the_layers_and_the_default_drafter_round_per_batch_size():
    """``--layers`` and ``--draft-round``: the table says how many layers the target had, and per batch size
    the drafting round of the engine's default drafter (grouped attention), not another variant's."""
    import random

    rng = random.Random(fresh_seed("spec_steps_table_the_table_records_the_l"))
    grouped = {b: round(rng.uniform(0.5, 3.0), 4) for b in (1, 4, 16)}
    rounds = {"rows": [{"B": b, "round_grouped_ms": ms, "round_fused_ms": ms + 1.0, "round_compiled_ms": ms / 2}
                       for b, ms in grouped.items()]}
    table = spec_steps_table({"rows": [row(1, 4, 5.0)]}, {"rows": [{"B": 1, "ms": 2.0}]}, [], "s", "c",
                             layers=40, draft_round=rounds, **ID)
    assert table["layers"] == 40
    assert table["drafter_round_ms"] == {str(b): ms for b, ms in grouped.items()}
    assert list(table)[-1] == "rows"
    # without them the table has neither key (a slice table written before them reads the same)
    bare = spec_steps_table({"rows": [row(1, 4, 5.0)]}, {"rows": [{"B": 1, "ms": 2.0}]}, [], "s", "c", **ID)
    assert "layers" not in bare and "drafter_round_ms" not in bare


def test_the_table_names_one_precision_and_gpu_and_refuses_inputs_that_mix_them():
    """``spec-steps`` records ``precision`` and ``device``; the table takes them from the inputs, where all
    agree, and refuses a table over runs of two precisions or two GPUs (and one with neither recorded nor named)."""
    def run(precision, device, **extra):
        return {"precision": precision, "device": device, **extra}

    spec = {"speculative_config": {"num_speculative_tokens": 15}}
    ours, plain = run("fp8", "NVIDIA H100", rows=[row(1, 4, 5.0)]), run("fp8", "NVIDIA H100", rows=[{"B": 1, "ms": 2.0}])
    table = spec_steps_table(ours, plain, [run("fp8", "NVIDIA H100", **spec, rows=[row(1, 16, 7.0)])], "s", "c")
    assert (table["precision"], table["gpu"]) == ("fp8", "NVIDIA H100")
    with pytest.raises(ValueError, match="differ in precision: bfloat16, fp8"):
        spec_steps_table(ours, run("bfloat16", "NVIDIA H100", rows=[{"B": 1, "ms": 2.0}]), [], "s", "c")
    with pytest.raises(ValueError, match="differ in gpu: NVIDIA H100, NVIDIA H200"):
        spec_steps_table(ours, plain, [run("fp8", "NVIDIA H200", **spec, rows=[row(1, 16, 7.0)])], "s", "c")
    with pytest.raises(ValueError, match="differ in precision: bfloat16, fp8"):
        spec_steps_table(ours, plain, [], "s", "c", precision="bfloat16")
    with pytest.raises(ValueError, match="precision is not recorded in every input: name it with --precision"):
        spec_steps_table({"rows": [row(1, 4, 5.0)]}, {"rows": [{"B": 1, "ms": 2.0}]}, [], "s", "c")


def test_the_plot_has_a_panel_per_batch_size(tmp_path):
    """``spec-steps-table --plot``: a PNG with one panel per batch size (its width grows with their number)."""
    from PIL import Image

    from vllm_hybridspec.tools.spec_steps import plot_table

    spec = {"speculative_config": {"num_speculative_tokens": 15}}
    sizes = {}
    for batches in ((1,), (1, 4)):
        ours = {"rows": [row(b, w, 3.0 + w / 4 * b, drafts=d) for b in batches for w in (1, 2, 16)
                         for d in ("model", "spread")]}
        plain = {"rows": [{"B": b, "ms": 2.5} for b in batches]}
        vllm = {**spec, "rows": [row(b, 16, 9.0, drafts="spread") for b in batches]}
        table = spec_steps_table(ours, plain, [vllm], "s", "c", layers=40, **ID)
        path = tmp_path / f"p{len(batches)}.png"
        plot_table(table, path)
        sizes[len(batches)] = Image.open(path).size
    assert sizes[2][0] > 1.8 * sizes[1][0] and sizes[2][1] == sizes[1][1]
