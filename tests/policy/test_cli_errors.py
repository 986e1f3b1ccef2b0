"""Bad input and unwritable outputs: one line on stderr naming the file or field, exit status 2,
and nothing written (no output file, no temporary file left beside it)."""

import gzip
import json
import os

import pytest
import torch
from typer.testing import CliRunner

from vllm_hybridspec.cli import app
from vllm_hybridspec.policy import RoundRecord, save_records
from vllm_hybridspec.policy.synthetic import synthesize, synthetic_costs

from ..seeds import fresh_seed

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_refused(r, *words):
    """Exit 2, exactly one stderr line that holds every word, no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    for w in words:
        assert str(w) in lines[0], (w, lines[0])
    assert "Traceback" not in r.output


@pytest.fixture
def inputs(tmp_path):
    """A good records file and a good cost file (fresh random rounds), in their own folder."""
    d = tmp_path / "in"
    d.mkdir()
    save_records(synthesize(400, seed=fresh_seed("cli_errors_inputs")), d / "r.jsonl")
    (d / "c.json").write_text(json.dumps(synthetic_costs()))
    return d


def costs_with(inputs, edit) -> os.PathLike:
    obj = synthetic_costs()
    edit(obj)
    path = inputs / "bad-costs.json"
    # json.dumps writes NaN and Infinity, which Python's JSON reader accepts back
    path.write_text(json.dumps(obj))
    return path


def fit(inputs, out, records=None, costs=None):
    return run("calibrate", "fit", "--records", records or inputs / "r.jsonl",
               "--costs", costs or inputs / "c.json", "--out", out)


@pytest.mark.parametrize("edit,field", [
    (lambda c: (c.pop("stage0"), c.update(s_ms=float("inf"))), "'s_ms' is Infinity"),
    (lambda c: c.update(eta_ms=float("inf")), "'eta_ms' is Infinity"),
    (lambda c: c["stage0"]["ms"].__setitem__(2, float("nan")), "'stage0.ms[2]' is NaN"),
    (lambda c: c["round_ms"].update({"4": float("-inf")}), "'round_ms.4' is -Infinity"),
    (lambda c: c["batched"]["4"]["round_ms"].update({"8": float("nan")}),
     "'batched.4.round_ms.8' is NaN"),
])
def test_fit_refuses_non_finite_costs(inputs, tmp_path, edit, field):
    costs = costs_with(inputs, edit)
    out = tmp_path / "p.json"
    r = fit(inputs, out, costs=costs)
    assert_refused(r, costs, field, "must be finite")
    assert list(tmp_path.iterdir()) == [inputs]


def binary_bytes() -> bytes:
    # bytes 0x80..0xff never start a UTF-8 sequence correctly in this order
    gen = torch.Generator().manual_seed(fresh_seed("cli_errors_binary_bytes"))
    return bytes(torch.randint(128, 256, (4096,), dtype=torch.uint8, generator=gen).tolist())


def test_fit_refuses_binary_records(inputs, tmp_path):
    rec = inputs / "bin.jsonl"
    rec.write_bytes(binary_bytes())
    assert_refused(fit(inputs, tmp_path / "p.json", records=rec), rec, "not UTF-8 text",
                   "expected JSONL")
    assert not (tmp_path / "p.json").exists()


def test_fit_refuses_gz_that_is_not_gzip(inputs, tmp_path):
    rec = inputs / "r.jsonl.gz"
    rec.write_bytes((inputs / "r.jsonl").read_bytes())
    assert_refused(fit(inputs, tmp_path / "p.json", records=rec), rec, "not a readable gzip file")
    assert not (tmp_path / "p.json").exists()


def test_fit_refuses_truncated_gzip(inputs, tmp_path):
    data = gzip.compress((inputs / "r.jsonl").read_bytes())
    rec = inputs / "cut.jsonl.gz"
    rec.write_bytes(data[: len(data) // 2])
    assert_refused(fit(inputs, tmp_path / "p.json", records=rec), rec, "not a readable gzip file")
    assert not (tmp_path / "p.json").exists()


def test_fit_names_gzip_without_gz_suffix(inputs, tmp_path):
    rec = inputs / "zipped.jsonl"
    rec.write_bytes(gzip.compress((inputs / "r.jsonl").read_bytes()))
    assert_refused(fit(inputs, tmp_path / "p.json", records=rec), rec, "name it *.gz")
    assert not (tmp_path / "p.json").exists()


def test_fit_checks_out_before_reading_anything(inputs, tmp_path):
    """A missing output directory is reported even though the records are also bad: the check
    comes before the (slow) fit."""
    rec = inputs / "bin.jsonl"
    rec.write_bytes(binary_bytes())
    out = tmp_path / "no-such-dir" / "p.json"
    assert_refused(fit(inputs, out, records=rec), "--out", out, "does not exist")
    assert not out.parent.exists()


def test_fit_refuses_out_that_is_a_directory(inputs, tmp_path):
    out = tmp_path / "policy.json"
    out.mkdir()
    assert_refused(fit(inputs, out), "--out", out, "is a directory")
    assert list(out.iterdir()) == []


def test_failed_write_leaves_old_file_and_no_temporary(tmp_path, monkeypatch):
    """save_records writes to a temporary file and renames it: a failure part-way leaves the
    previous file as it was and nothing else."""
    path = tmp_path / "r.jsonl.gz"
    old = [RoundRecord(conf=[0.5], ent=[1.0], accepted=0)]
    save_records(old, path)
    before = path.read_bytes()
    calls = {"n": 0}
    real = RoundRecord.model_dump_json

    def flaky(self, **kw):
        calls["n"] += 1
        if calls["n"] == 50:
            raise OSError("disk full")
        return real(self, **kw)

    monkeypatch.setattr(RoundRecord, "model_dump_json", flaky)
    with pytest.raises(OSError, match="disk full"):
        save_records(synthesize(200, seed=fresh_seed("cli_errors_flaky")), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_synth_checks_every_output_first(tmp_path):
    out, costs = tmp_path / "r.jsonl", tmp_path / "c.json"
    costs.mkdir()
    assert_refused(run("calibrate", "synth", "--out", out, "--rounds", 50, "--costs-out", costs),
                   "--costs-out", costs, "is a directory")
    assert not out.exists() and list(costs.iterdir()) == []
    missing = tmp_path / "nowhere" / "r.jsonl"
    assert_refused(run("calibrate", "synth", "--out", missing, "--rounds", 50), "--out", missing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


@pytest.fixture
def fitted(inputs):
    pol = inputs / "p.json"
    assert fit(inputs, pol).exit_code == 0
    return pol


def simulate(records, policy, *extra):
    return run("simulate", "--records", records, "--policy", policy, *extra)


@pytest.mark.parametrize("field,value,shown", [
    ("rate", float("nan"), "'rate' is NaN"),
    ("routing.s", float("inf"), "'routing.s' is Infinity"),
    ("cost.curve[3]", float("-inf"), "'cost.curve[3]' is -Infinity"),
])
def test_simulate_refuses_non_finite_policy(inputs, fitted, field, value, shown):
    obj = json.loads(fitted.read_text())
    *parents, last = field.replace("[", ".").replace("]", "").split(".")
    target = obj
    for k in parents:
        target = target[k]
    target[int(last) if last.isdigit() else last] = value
    bad = inputs / "bad-policy.json"
    bad.write_text(json.dumps(obj))
    assert_refused(simulate(inputs / "r.jsonl", bad), bad, shown, "must be finite")


def test_simulate_refuses_binary_policy_and_records(inputs, fitted):
    blob = inputs / "blob.bin"
    blob.write_bytes(binary_bytes())
    assert_refused(simulate(inputs / "r.jsonl", blob), blob, "not UTF-8 text", "policy file")
    assert_refused(simulate(blob, fitted), blob, "not UTF-8 text", "JSONL")
    gz = inputs / "fake.jsonl.gz"
    gz.write_bytes(binary_bytes())
    assert_refused(simulate(gz, fitted), gz, "not a readable gzip file")


def test_simulate_checks_the_plot_path_first(inputs, fitted, tmp_path):
    missing = tmp_path / "plots" / "sim.png"
    assert_refused(simulate(inputs / "r.jsonl", fitted, "--plot", missing), "--plot", missing,
                   "does not exist")
    odd = tmp_path / "sim.bmpx"
    assert_refused(simulate(inputs / "r.jsonl", fitted, "--plot", odd), "--plot", ".png")
    assert list(tmp_path.iterdir()) == [inputs]
