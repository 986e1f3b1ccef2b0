"""``hybridspec kernels fused`` on the CPU: the float64 accuracy check of the fused and unfused rounds
runs (Triton's interpreter) and the command exits cleanly, saying that timing needs a CUDA device."""

import json

import torch
from typer.testing import CliRunner

from vllm_hybridspec.cli import app
from vllm_hybridspec.tools.kernels import fused_round
from vllm_hybridspec.tools.kernels.shapes import SHAPES

runner = CliRunner()


def test_cpu_path_checks_accuracy_and_says_timing_needs_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "fused_round.json"
    res = runner.invoke(app, ["kernels", "fused", "--shape", "tiny", "--batches", "2", "--lengths", "3",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "timing needs a CUDA device" in res.output
    result = json.loads(out.read_text())
    assert result["failed"] == [] and result["rows"] == []
    assert result["meta"]["shape"] == dict(layers=2, HK=2, HV=4, K=32, V=32)
    assert result["meta"]["command"].startswith("hybridspec kernels fused --shape tiny --batches 2 --lengths 3")
    # method x input dtype, each with outputs and states of both paths
    assert sorted(result["accuracy"]) == ["B2_w3_chunk_bfloat16", "B2_w3_chunk_float32",
                                          "B2_w3_recurrent_bfloat16", "B2_w3_recurrent_float32"]
    for key, errs in result["accuracy"].items():
        assert set(errs) == {"fused_out", "fused_state", "unfused_out", "unfused_state"}
        if key.endswith("float32"):
            assert 0 < max(errs.values()) <= 1e-5, (key, errs)
        else:  # bf16 outputs carry bf16 rounding; the states are fp32 over the same (rounded) inputs
            assert 0 < max(errs["fused_out"], errs["unfused_out"]) <= 5e-3, (key, errs)
            assert 0 < max(errs["fused_state"], errs["unfused_state"]) <= 1e-5, (key, errs)


def test_timing_only_commands_refuse_without_cuda_and_lengths_are_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["kernels", "fused", "--tune", "--shape", "tiny"])
    assert res.exit_code == 2 and "timing needs a CUDA device" in res.output
    res = runner.invoke(app, ["kernels", "tune", "--out", str(tmp_path / "t.jsonl")])
    assert res.exit_code == 2 and "timing needs a CUDA device" in res.output
    assert not (tmp_path / "t.jsonl").exists()
    for bad in ("0,3", "4,17", "3,x"):
        res = runner.invoke(app, ["kernels", "fused", "--shape", "tiny", "--lengths", bad])
        assert res.exit_code == 2 and "--lengths" in res.output, (bad, res.output)


def test_round_bytes_count_each_state_once_read_and_once_written():
    shape = SHAPES["35b"]
    assert shape.state_bytes == 32 * 128 * 128 * 4
    total = fused_round.fused_round_bytes(shape, B=4, w=8, m=8)
    # the states dominate: 4 states read and written per layer; the inputs, the 64 factor rows and
    # the outputs add about 15 % at w = 8
    assert 1.1 * 2 * 4 * shape.state_bytes * shape.layers < total < 1.2 * 2 * 4 * shape.state_bytes * shape.layers
