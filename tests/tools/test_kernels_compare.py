"""``hybridspec kernels compare`` and ``render`` without CUDA: the accuracy check of our verify + commit
against vLLM 0.26's spec-decode kernel and the float64 recurrence (both through Triton's interpreter)
at the tiny shape, and the markdown report re-rendered from a saved run's JSON."""

import json
import re
from pathlib import Path

import torch
from typer.testing import CliRunner

from vllm_hybridspec.cli import app
from vllm_hybridspec.tools.kernels import gdn_compare
from vllm_hybridspec.tools.kernels.shapes import SHAPES

runner = CliRunner()
SAVED_RUN = Path(__file__).resolve().parents[2] / "docs/benchmarks/gdn_kernels.json"  # H200, 2026-12-01


def test_cpu_compare_checks_ours_against_vllm_and_fp64_and_says_timing_needs_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out, md = tmp_path / "compare.json", tmp_path / "compare.md"
    res = runner.invoke(app, ["kernels", "compare", "--shape", "tiny", "--lengths", "3", "--batches", "2",
                              "--json", str(out), "--out", str(md)])
    assert res.exit_code == 0, res.output
    assert "against the float64 reference and vLLM's kernel" in res.output
    assert "timing needs a CUDA device" in res.output and "no report written" in res.output
    assert not md.exists()
    result = json.loads(out.read_text())
    assert result["results"] == [] and result["meta"]["device"] == "cpu"
    assert (result["meta"]["layers"], result["meta"]["HV"], result["meta"]["K"]) == (2, 4, 32)
    assert sorted(result["accuracy"]) == ["w3_B2_chunk", "w3_B2_recurrent"]
    for key, acc in result["accuracy"].items():
        # fp32 inputs: ours, vLLM's kernel and float64 agree to fp32 rounding
        assert 0 < max(acc["fp32"].values()) <= 1e-5, (key, acc)
        # bf16 inputs: the outputs are rounded to bf16 (both kernels round alike); the fp32 states are not
        bf16 = acc["bf16"]
        assert 1e-4 < bf16["out_vs_fp64"] <= 5e-3 and bf16["out_vs_vllm"] <= 5e-3, (key, acc)
        assert 0 < bf16["state_vs_fp64"] <= 1e-5 and bf16["state_vs_vllm"] <= 1e-5, (key, acc)


def test_accuracy_check_without_vllm_compares_with_fp64_only():
    acc = gdn_compare.check_accuracy(SHAPES["tiny"], w=2, B=1, verify_cfg=dict(method="recurrent"), commit_cfg={},
                                     device="cpu", with_vllm=False)
    for errs in acc.values():
        assert errs["out_vs_vllm"] is None and errs["state_vs_vllm"] is None
    assert 0 < acc["fp32"]["out_vs_fp64"] <= 1e-5 and 0 < acc["fp32"]["state_vs_fp64"] <= 1e-5
    assert gdn_compare.accurate(acc)
    # the tolerance is what decides: an fp32 error of 1e-3 fails
    assert not gdn_compare.accurate(dict(acc, fp32=dict(acc["fp32"], out_vs_fp64=1e-3)))


def _table(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if re.match(r"\| \d+ \| \d+ \| \d+ \|", line)]


def test_render_rederives_the_saved_h200_run(tmp_path):
    saved = json.loads(SAVED_RUN.read_text())
    md = tmp_path / "gdn_kernels.md"
    res = runner.invoke(app, ["kernels", "render", str(SAVED_RUN), "--out", str(md)])
    assert res.exit_code == 0, res.output
    text = md.read_text()
    assert "Measured on NVIDIA H200 (torch 2.11.0+cu130)" in text
    assert "python examples/bench_gdn_kernels.py --no-tune" in text  # the command that run was made with
    assert "4.22 TB/s" in text and "take 0.0253 ms" in text
    rows = _table(text)
    assert len(rows) == len(saved["results"]) == 24
    for cells, raw in zip(rows, saved["results"]):
        w, B, m, ours, method = int(cells[0]), int(cells[1]), int(cells[2]), float(cells[3]), cells[4]
        assert (w, B, m) == (raw["w"], raw["B"], raw["m"])
        assert method in ("chunk", "recurrent") and ours == round(raw[method], 4)
        assert cells[9] == f"{raw['vllm']:.4f}" and cells[12] == f"{raw['floor']:.4f}"
        assert cells[13] == f"{raw['vllm'] / raw[method]:.2f}x"
        assert cells[14] == f"{raw[method] / raw['floor']:.2f}x"
        assert cells[15] == f"{raw[method] / raw['launch_floor']:.2f}x"
    # w = 2 of one sequence verifies recurrently (0.1512 ms against vLLM's 0.2428 ms: 1.61x)
    assert rows[0][:5] == ["2", "1", "2", "0.1512", "recurrent"] and rows[0][13] == "1.61x"
    # the accuracy table: one row per (w, B, kernel) and input dtype
    acc_rows = [line for line in text.splitlines() if re.match(r"\| \d+ \| \d+ \| (chunk|recurrent) \| (fp32|bf16)", line)]
    assert len(acc_rows) == 2 * len(saved["accuracy"])
    assert "| 2 | 1 | chunk | fp32 | 3.9e-07 | 3.2e-07 | 2.7e-07 | 1.4e-07 |" in acc_rows


def test_render_of_a_new_run_prints_its_command_and_ratios(tmp_path):
    row = dict(w=16, B=4, m=8, chunk=0.5, chunk_iqr=0.01, ours_tf32x3=0.7, chunk_verify=0.4, ours_commit=0.1,
               recurrent=0.5, recurrent_iqr=0.01, recurrent_verify=0.45, vllm=1.5, vllm_iqr=0.02, vllm_copy=2.0,
               fla=None, floor=0.25, floor_verify=0.0833, floor_commit=0.1667, launch_floor=0.025)
    meta = dict(device="NVIDIA H200", torch="2.11.0", layers=30, HK=16, HV=32, K=128, V=128, samples=30,
                copy_bandwidth_TBps=4.2, launch_floor_ms=0.025, verify_config={}, recurrent_config={},
                commit_config={}, command="hybridspec kernels compare --shape 35b --lengths 16 --batches 4")
    errs = dict(out_vs_fp64=1e-6, state_vs_fp64=2e-6, out_vs_vllm=None, state_vs_vllm=None)
    run = tmp_path / "run.json"
    run.write_text(json.dumps(dict(meta=meta, accuracy={"w16_B4_chunk": dict(fp32=errs, bf16=errs)}, results=[row])))
    res = runner.invoke(app, ["kernels", "render", str(run)])
    assert res.exit_code == 0, res.output
    assert "\nhybridspec kernels compare --shape 35b --lengths 16 --batches 4\n" in res.output
    assert "Shape: Qwen3.6-35B-A3B GDN, 30 layers" in res.output
    (cells,) = _table(res.output)
    assert cells[3] == "0.5000" and cells[13:] == ["3.00x", "2.00x", "20.00x"]  # 1.5 / 0.5, 0.5 / 0.25, 0.5 / 0.025
    assert "| 16 | 4 | chunk | fp32 | 1.0e-06 | 2.0e-06 | - | - |" in res.output


def test_render_refuses_a_run_without_timings(tmp_path):
    run = tmp_path / "cpu.json"
    run.write_text(json.dumps(dict(meta=dict(device="cpu"), accuracy={}, results=[])))
    res = runner.invoke(app, ["kernels", "render", str(run)])
    assert res.exit_code == 2 and "no timings" in res.output
