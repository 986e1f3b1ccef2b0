"""``hybridspec kernels fused`` on the CPU: the float64 accuracy check of the fused and unfused rounds
runs (Triton's interpreter) and the command exits cleanly, saying that timing needs a CUDA device; the
kernels commands' results are written beside and renamed."""

import json
import os

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


def test_kernel_results_that_fail_to_write_keep_the_earlier_file(tmp_path, monkeypatch):
    """The kernels commands write their results (--json, --out) beside and renamed: a failing write keeps
    the earlier file whole and leaves no temporary file; a launch sweep (kernels tune --out) rewrites its
    file after every measurement, so one stopped midway leaves every line measured so far."""
    import pytest

    from vllm_hybridspec.tools.kernels import tune
    from vllm_hybridspec.tools.kernels.cli import _write_json

    out = tmp_path / "fused.json"
    _write_json(out, {"rows": [1]})
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError, match="No space left"):
        _write_json(out, {"rows": [1, 2]})
    assert json.loads(out.read_text()) == {"rows": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["fused.json"]
    monkeypatch.setattr(os, "replace", real_replace)

    measured = iter([0.3, None, 0.1, 0.2])  # None: a candidate that does not compile, passed over

    def ours_ms(*args):
        ms = next(measured, "stop")
        if ms == "stop":
            raise KeyboardInterrupt  # the sweep stopped after the third measurement
        if ms is None:
            raise RuntimeError("out of resources")
        return ms

    monkeypatch.setattr(tune, "ours_ms", ours_ms)
    sweep = tmp_path / "tune.jsonl"
    with pytest.raises(KeyboardInterrupt):
        tune.sweep_parts(SHAPES["tiny"], sweep, samples=3)
    rows = [json.loads(line) for line in sweep.read_text().splitlines()]
    assert [(r["part"], r["cfg"], r["ms"]) for r in rows] == [("commit", cfg, ms) for cfg, ms in
                                                              zip(tune.COMMIT[:1] + tune.COMMIT[2:4], (0.3, 0.1, 0.2))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.json", "tune.jsonl"]
