"""``hybridspec calibrate synth`` -> ``calibrate fit`` -> ``simulate``, and the exit on bad input."""

import json

from typer.testing import CliRunner

from vllm_hybridspec.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_synth_fit_simulate(tmp_path):
    rec, test, costs, pol = (tmp_path / n for n in ("r.jsonl", "t.jsonl", "c.json", "p.json"))
    r = run("calibrate", "synth", "--out", rec, "--rounds", 3000, "--seed", 90, "--costs-out", costs)
    assert r.exit_code == 0, r.output
    assert run("calibrate", "synth", "--out", test, "--rounds", 3000, "--seed", 91).exit_code == 0
    r = run("calibrate", "fit", "--records", rec, "--costs", costs, "--out", pol)
    assert r.exit_code == 0, r.output
    assert "with routing correction" in r.output and json.loads(pol.read_text())["version"] == 1
    png = tmp_path / "sim.png"
    r = run("simulate", "--records", test, "--policy", pol, "--json", "--plot", png, "--batch", 4)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    names = [p["name"] for p in out["policies"]]
    assert names == ["verify-all", "best static", "EVICT ratio", "ratio, calibrated", "D-Cut",
                     "hybridspec", "hybridspec+routing", "oracle", "oracle+routing"]
    assert out["rounds"] + out["truncated_excluded"] == 3000
    tp = {p["name"]: p["throughput"] for p in out["policies"]}
    assert tp["hybridspec"] > tp["verify-all"] and out["oracle_ratio"]["hybridspec"] > 0.95
    assert [p["name"] for p in out["batched"]["policies"]][-1] == "B=4 shared length"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = run("simulate", "--records", test, "--policy", pol)
    assert r.exit_code == 0 and "hybridspec / its oracle" in r.stdout


def test_bad_input_exits_with_a_message(tmp_path):
    rec = tmp_path / "r.jsonl"
    rec.write_text('{"conf": [0.5, 0.4], "ent": [1.0, 1.0], "accepted": 1}\n'
                   '{"conf": [0.5, 0.4], "ent": [1.0, 1.0], "accepted": "two"}\n')
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"round_ms": {"2": 5.0, "3": 6.0}}))
    r = run("calibrate", "fit", "--records", rec, "--costs", costs, "--out", tmp_path / "p.json")
    assert r.exit_code == 2
    assert f"error: {rec} line 2: field 'accepted'" in r.stderr
    assert "Traceback" not in r.output
    rec.write_text('{"conf": [0.5, 0.4], "ent": [1.0, 1.0], "accepted": 1}\n'
                   '{"conf": [0.5, 0.4], "ent": [1.0, 1.0], "accepted": 0}\n')
    r = run("calibrate", "fit", "--records", rec, "--costs", costs, "--out", tmp_path / "p.json")
    assert r.exit_code == 2 and "three or more lengths" in r.stderr
    r = run("simulate", "--records", rec, "--policy", tmp_path / "missing.json")
    assert r.exit_code == 2 and "policy file" in r.stderr and "does not exist" in r.stderr
    assert not (tmp_path / "p.json").exists()
