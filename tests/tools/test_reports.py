"""The report commands on result files: ``compare-report`` counts identical prompts and finds the
first divergence, ``plot-rounds`` draws an evaluate result, ``calibrate time-selector`` times a round
and picks lengths in range; bad files are refused in one line naming them."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.cli import app
from vllm_hybridspec.tools.compare_report import first_divergence
from ..seeds import fresh_seed

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def compare_result(rng: random.Random, n: int, planted: dict[int, int]) -> tuple[dict, dict]:
    """A plain and a speculative result over ``n`` random outputs, the latter differing from position
    ``planted[p]`` on in prompt ``p``; the plain run records top-2 gaps."""
    outputs = [[rng.randrange(1000) for _ in range(rng.randrange(8, 20))] for _ in range(n)]
    gaps = [[rng.random() for _ in row] for row in outputs]
    spec = [list(row) for row in outputs]
    for p, at in planted.items():
        spec[p][at] = (spec[p][at] + 1) % 1000
    base = {"kv_capacity_tokens": 4096, "engine_start_s": 3.0}
    plain = {**base, "name": "plain", "outputs": outputs, "top2_gaps": gaps, "mean_acceptance_length": None,
             "round_ms": {"b1": {"batch": 1, "length": None, "mean_ms": 10.0, "median_ms": 9.5,
                                 "tokens_per_step": 1.0, "steps": 32}}}
    hspec = {**base, "name": "hspec", "outputs": spec, "mean_acceptance_length": 2.5,
             "round_ms": {"b1w4": {"batch": 1, "length": 4, "mean_ms": 12.5, "median_ms": 12.0,
                                   "tokens_per_step": 2.5, "steps": 32}}}
    return plain, hspec


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([5], [6]) == 0


def test_compare_report_counts_planted_differences(tmp_path):
    rng = random.Random(fresh_seed("reports_compare_report_counts_planted_di"))
    n = rng.randrange(6, 12)
    planted = {p: rng.randrange(0, 8) for p in rng.sample(range(n), 2)}
    plain, hspec = compare_result(rng, n, planted)
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"results": [plain, hspec]}))
    result = runner.invoke(app, ["compare-report", str(path)])
    assert result.exit_code == 0, result.output
    identity = result.output.split("\n\n")[0]
    rows = {line.split("|")[1].strip(): line for line in identity.splitlines() if line.startswith("| ")}
    assert f"| {n}/{n} |" in rows["plain"]
    assert f"| {n - 2}/{n} |" in rows["hspec"]
    # the gaps are the reference's where each planted difference starts, in prompt order
    expected = ", ".join(f"{plain['top2_gaps'][p][planted[p]]:.4g}" for p in sorted(planted))
    assert expected in rows["hspec"]
    # the sweep: tokens/s = tokens per step / ms per step
    sweep = [line for line in result.output.splitlines() if line.startswith("| hspec | 1 | 4 |")]
    assert len(sweep) == 1 and "| 200 |" in sweep[0]
    assert re.search(r"\| plain \| 1 \| plain \| 10\.00 \| 9\.50 \| 1\.00 \| 100 \| 32 \|", result.output)


def test_compare_report_refuses_a_file_that_is_not_a_result(tmp_path):
    bad = tmp_path / "costs.json"
    bad.write_text(json.dumps({"round_ms": {}}))
    result = runner.invoke(app, ["compare-report", str(bad)])
    assert result.exit_code == 2
    assert str(bad) in result.output and "not a hybridspec compare result" in result.output


def test_compare_report_reads_a_stored_h200_result():
    path = ROOT / "docs/benchmarks/h200-2026-12-01/compare-hybrid-float32.json"
    result = runner.invoke(app, ["compare-report", str(path)])
    assert result.exit_code == 0, result.output
    assert re.search(r"\| plain \| (\d+)/\1 \|", result.output)


def test_plot_rounds_draws_an_evaluate_result(tmp_path):
    out = tmp_path / "rounds.png"
    evaluate = ROOT / "docs/benchmarks/h200-2026-12-01/eval-35b/evaluate.json"
    compare = ROOT / "docs/benchmarks/h200-2026-12-01/compare-35b-vllm-gdn.json"
    result = runner.invoke(app, ["plot-rounds", str(evaluate), "--compare", str(compare), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_rounds_refuses_a_compare_file_as_evaluate(tmp_path):
    compare = ROOT / "docs/benchmarks/h200-2026-12-01/compare-35b-vllm-gdn.json"
    result = runner.invoke(app, ["plot-rounds", str(compare), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "not a hybridspec evaluate result" in result.output
    assert not (tmp_path / "x.png").exists()


def test_time_selector_on_the_cpu_picks_lengths_in_range():
    policy = ROOT / "examples/policy_synth.json"
    result = runner.invoke(app, ["calibrate", "time-selector", "--policy", str(policy), "--batch", "32",
                                 "--samples", "3", "--replays", "2", "--routing", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "CPU" in result.output and "not the GPU figure" in result.output
    us = float(re.search(r"median ([\d.]+) us per round", result.output).group(1))
    assert us > 0
    lo, hi = map(int, re.search(r"min (\d+), max (\d+)", result.output).groups())
    assert 1 <= lo <= hi <= 16


def test_time_selector_refuses_a_policy_of_another_draft_length():
    policy = ROOT / "examples/policy_synth.json"
    result = runner.invoke(app, ["calibrate", "time-selector", "--policy", str(policy), "--draft-len", "7",
                                 "--device", "cpu"])
    assert result.exit_code == 2 and "draft_len 15, not --draft-len 7" in result.output


def test_time_selector_takes_the_draft_length_of_the_policy_it_is_given():
    policy = ROOT / "models/hybrid-hspec/policy_cpu.json"   # draft_len 7, not the fitted default 15
    result = runner.invoke(app, ["calibrate", "time-selector", "--policy", str(policy), "--batch", "4",
                                 "--samples", "2", "--replays", "1", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "B = 4, D = 7," in result.output
    lo, hi = map(int, re.search(r"min (\d+), max (\d+)", result.output).groups())
    assert 1 <= lo <= hi <= 8


def test_synth_offers_one_routing_switch():
    result = runner.invoke(app, ["calibrate", "synth", "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert result.output.count("--no-routing") == 1 and "--no-no-routing" not in result.output
    assert "--routing " not in result.output


COMPARE = ROOT / "docs/benchmarks/h200-2026-12-01/compare-hybrid-float32.json"
EVALUATE = ROOT / "docs/benchmarks/h200-2026-12-01/eval-35b/evaluate.json"


def _edited(path, edit):
    doc = json.loads(path.read_text())
    edit(doc)
    return doc


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["results"][0].update(kv_capacity_tokens="1000"), ["'results[0].kv_capacity_tokens'", "valid integer"]),
    (lambda d: d["results"][0].update(kv_capacity_tokens=-5), ["'results[0].kv_capacity_tokens'", "-5"]),
    (lambda d: d["results"][1].update(mean_acceptance_length=0.4), ["'results[1].mean_acceptance_length'", "0.4"]),
    (lambda d: d["results"][0].update(engine_start_s=float("nan")), ["'results[0].engine_start_s' is NaN", "finite"]),
    (lambda d: d["results"][0]["outputs"][0].__setitem__(0, 1.5), ["'results[0].outputs[0][0]'", "1.5"]),
    (lambda d: d["results"][0]["outputs"][0].__setitem__(0, "17"), ["'results[0].outputs[0][0]'", "'17'"]),
    (lambda d: d["results"][1].update(outputs=d["results"][1]["outputs"][:-1], top2_gaps=None),
     ["outputs of", "one prompt set"]),
    (lambda d: d["results"][0].pop("outputs"), ["no 'error', so it needs 'outputs'"]),
    (lambda d: d["results"][0]["top2_gaps"][0].append(0.1), ["'top2_gaps' needs one gap per output token"]),
    (lambda d: d["results"][0].update(round_ms={"B1_wplain": {"batch": 0, "length": None, "steps": 8, "mean_ms": 1.0,
                                                              "median_ms": 1.0, "tokens_per_step": 1.0}}),
     ["'results[0].round_ms.B1_wplain.batch'", "greater than or equal to 1"]),
    (lambda d: d.update(results=[]), ["'results'", "at least 1 item"]),
    (lambda d: d["results"][0].update(name=7), ["'results[0].name'", "valid string"]),
])
def test_compare_report_refuses_a_malformed_result_in_one_line(tmp_path, edit, words):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_edited(COMPARE, edit)))
    result = runner.invoke(app, ["compare-report", str(bad)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "not a hybridspec compare result" in line and str(bad) in line
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["costs"][0].update(mean_ms="7.2"), ["'costs[0].mean_ms'", "valid number", "'7.2'"]),
    (lambda d: d["costs"][0].update(mean_ms=-1.0), ["'costs[0].mean_ms'", "greater than or equal to 0"]),
    (lambda d: d["costs"][0].update(batch=1.0), ["'costs[0].batch'", "valid integer"]),
    (lambda d: d["costs"][0].update(length=0), ["'costs[0].length'", "greater than or equal to 1"]),
    (lambda d: next(iter(d["modes"].values()))["steps"].pop("4"), ["has no 'steps' at batch size 4"]),
    (lambda d: next(iter(d["modes"].values()))["steps"]["1"].update(tokens_per_s=float("inf")),
     ["is Infinity", "finite"]),
    (lambda d: d.update(modes={}), ["'modes'", "at least 1 item"]),
    (lambda d: d.pop("costs"), ["required field 'costs' is missing"]),
    (lambda d: d["costs"][0].update(steps=0), ["'costs[0].steps'", "greater than or equal to 1"]),
    (lambda d: d["costs"][0].update(tokens_per_step=True), ["'costs[0].tokens_per_step'", "valid number", "True"]),
    (lambda d: d["costs"][0].update(median_ms=None), ["'costs[0].median_ms'", "valid number", "None"]),
    (lambda d: next(iter(d["modes"].values()))["steps"]["1"].update(tokens_per_s="133"),
     ["tokens_per_s'", "valid number", "'133'"]),
    (lambda d: d.update(costs={"1": d["costs"][0]}), ["'costs'", "valid array"]),
])
def test_plot_rounds_refuses_a_malformed_evaluate_result_in_one_line(tmp_path, edit, words):
    bad = tmp_path / "evaluate.json"
    bad.write_text(json.dumps(_edited(EVALUATE, edit)))
    out = tmp_path / "x.png"
    result = runner.invoke(app, ["plot-rounds", str(bad), "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "not a hybridspec evaluate result" in line and str(bad) in line
    for w in words:
        assert w in line, (w, line)
    assert not out.exists()
