"""The fused-round benchmark's CPU path: its float64 accuracy check runs (Triton's interpreter) and
the command exits cleanly, saying that timing needs a CUDA device."""

import json

import torch

from vllm_hybridspec.tools import fused_round_bench as bench


def test_cpu_path_checks_accuracy_and_says_timing_needs_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "fused_round.json"
    rc = bench.main(["--shape", "tiny", "--batches", "2", "--lengths", "3", "--json", str(out)])
    assert rc == 0
    assert "timing needs a CUDA device" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["failed"] == [] and result["rows"] == []
    # method x input dtype, each with outputs and states of both paths
    assert sorted(result["accuracy"]) == ["B2_w3_chunk_bfloat16", "B2_w3_chunk_float32",
                                          "B2_w3_recurrent_bfloat16", "B2_w3_recurrent_float32"]
    for key, errs in result["accuracy"].items():
        tol = 1e-4 if key.endswith("float32") else 5e-3
        assert set(errs) == {"fused_out", "fused_state", "unfused_out", "unfused_state"}
        assert 0 < max(errs.values()) <= tol, (key, errs)


def test_round_bytes_count_each_state_once_read_and_once_written():
    shape = bench.SHAPES["35b"]
    state = shape.HV * shape.V * shape.K * 4
    total = bench.fused_round_bytes(shape, B=4, w=8, m=8)
    # the states dominate: 4 states read and written per layer; the inputs, the 64 factor rows and
    # the outputs add about 15 % at w = 8
    assert 1.1 * 2 * 4 * state * shape.layers < total < 1.2 * 2 * 4 * state * shape.layers
