"""`hybridspec headline`: the ratios, bars and KV capacities of headline.json from `hybridspec bench` results
(real result files written against the stub server, their throughputs then scaled by known factors), the
server facts `bench --serve` records, and one-line refusals that write nothing."""

from __future__ import annotations

import copy
import inspect
import json
import random

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.bench.headline import BARS, build_headline
from vllm_hybridspec.bench.loadgen import BenchConfig, run_bench
from vllm_hybridspec.bench.server import KV_CAPACITY_LINE, kv_capacity_from_log
from vllm_hybridspec.cli import app

from .stub import StubServer


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "r.json"
    with StubServer() as server:
        run_bench(BenchConfig(base_url=server.url, concurrencies=[1, 2, 4], num_requests=3, warmup=1, output_len=4,
                              repeats=2, metrics_interval=0.05), [[1, 2, 3]], out, progress=False)
    return json.loads(out.read_text())


def _variant(result: dict, tok_s: dict[int, float], host: str = "h200-a", kv: int | None = None,
             gpu: str = "NVIDIA H100 80GB HBM3", serve: str = "vllm serve m --dtype bfloat16") -> dict:
    """``result`` with each level's tokens/s (and its runs' spread, scaled alike) set to ``tok_s[C]``."""
    doc = copy.deepcopy(result)
    for lv in doc["levels"]:
        scale = tok_s[lv["concurrency"]] / lv["output_throughput"]
        lv["output_throughput"] = tok_s[lv["concurrency"]]
        s = lv["output_throughput_spread"]
        s.update(min=s["min"] * scale, max=s["max"] * scale, repeats=[r * scale for r in s["repeats"]])
    doc["config"].update(host=host, gpu=gpu, serve=serve)
    if kv is not None:
        doc["config"]["server"] = {"kv_capacity_tokens": kv, "startup_s": 120.0, "log": "x.server.log"}
    return doc


def _write(tmp_path, name: str, doc: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def _configs(result, tmp_path, rng, hs_over_plain, hs_over_vllm):
    plain = {c: rng.uniform(50, 5000) for c in (1, 2, 4)}
    hs = {c: plain[c] * hs_over_plain[c] for c in plain}
    vllm = {c: hs[c] / hs_over_vllm[c] for c in plain}
    return plain, hs, vllm, {
        "plain": _write(tmp_path, "plain.json", _variant(result, plain, kv=1_267_712)),
        "hybridspec": _write(tmp_path, "hs.json", _variant(result, hs, kv=1_260_339)),
        "vllm_verify_all": _write(tmp_path, "vllm.json", _variant(result, vllm, kv=233_393)),
    }


def test_ratios_bars_and_kv_from_the_results(result, tmp_path):
    rng = random.Random(7)
    for trial in range(3):
        over_plain = {c: rng.uniform(0.9, 2.2) for c in (1, 2, 4)}
        over_vllm = {c: rng.uniform(1.0, 1.6) for c in (1, 2, 4)}
        plain, hs, vllm, files = _configs(result, tmp_path, rng, over_plain, over_vllm)
        head = build_headline(files, "shape", "paper-dflash-qwen3.6", 15, "cmd")
        assert head["levels"]["2"] == {"plain": plain[2], "hybridspec": hs[2], "vllm_verify_all": vllm[2]}
        for c in (1, 2, 4):
            r = head["ratios"][str(c)]
            assert r["hybridspec_over_plain"] == pytest.approx(over_plain[c], abs=1e-4)
            assert r["hybridspec_over_vllm_verify_all"] == pytest.approx(over_vllm[c], abs=1e-4)
            lo, hi = head["spread"][str(c)]["plain"]
            assert lo <= plain[c] <= hi
        t = head["targets"]
        assert t["c1_over_plain"]["met"] == (over_plain[1] >= BARS["c1_over_plain"])
        assert t["c1_over_vllm_verify_all"]["met"] == (over_vllm[1] >= BARS["c1_over_vllm_verify_all"])
        worst = min(over_plain.values())
        assert t["every_c_over_plain"]["value"] == pytest.approx(worst, abs=1e-4)
        assert t["every_c_over_plain"]["met"] == (worst >= BARS["every_c_over_plain"])
        assert head["kv_tokens"] == {"plain": 1_267_712, "ours": 1_260_339, "vllm": 233_393}
        assert head["same_machine"] and not head["notes"]
        assert (head["precision"], head["gpu"]) == ("bfloat16", "NVIDIA H100 80GB HBM3")


def test_one_precision_and_gpu_named_and_a_mix_noted(result, tmp_path):
    """headline.json names the precision every server ran in (``--quantization``, else ``--dtype``) and the GPU
    every run recorded; results that differ in either give no single value and a note naming each."""
    rng = random.Random(5)
    tok = {c: rng.uniform(50, 500) for c in (1, 2, 4)}
    fp8 = "vllm serve m --dtype bfloat16 --quantization fp8"
    files = {"plain": _write(tmp_path, "p.json", _variant(result, tok, serve=fp8)),
             "hybridspec": _write(tmp_path, "h.json", _variant(result, tok, serve=fp8))}
    head = build_headline(files, "s", "p", 15, "c")
    assert (head["precision"], head["gpu"]) == ("fp8", "NVIDIA H100 80GB HBM3") and not head["notes"]
    files["hybridspec"] = _write(tmp_path, "h.json", _variant(result, tok, gpu="NVIDIA H200"))
    head = build_headline(files, "s", "p", 15, "c")
    assert head["precision"] is None and head["gpu"] is None
    assert "the results do not all name one precision: plain fp8, hybridspec bfloat16" in head["notes"]
    assert "the results do not all name one gpu: plain NVIDIA H100 80GB HBM3, hybridspec NVIDIA H200" in head["notes"]


def test_bars_met_and_missed(result, tmp_path):
    """Hand-set ratios on either side of each bar."""
    rng = random.Random(1)
    _, _, _, files = _configs(result, tmp_path, rng, {1: 1.85, 2: 1.2, 4: 0.98}, {1: 1.31, 2: 1.1, 4: 1.0})
    t = build_headline(files, "s", "p", 15, "c")["targets"]
    assert [t[k]["met"] for k in ("c1_over_plain", "c1_over_vllm_verify_all", "every_c_over_plain")] == [True] * 3
    _, _, _, files = _configs(result, tmp_path, rng, {1: 1.79, 2: 1.2, 4: 0.96}, {1: 1.29, 2: 1.1, 4: 1.0})
    t = build_headline(files, "s", "p", 15, "c")["targets"]
    assert [t[k]["met"] for k in ("c1_over_plain", "c1_over_vllm_verify_all", "every_c_over_plain")] == [False] * 3


def test_merged_runs_another_machine_and_verify_all_acceptance(result, tmp_path):
    """A configuration in two files (C = 4 from the second), one result from another host (a note, and
    same_machine false), the verify-all acceptance length from its C = 1 level."""
    plain = {1: 100.0, 2: 180.0, 4: 300.0}
    first = _variant(result, plain)
    second = _variant(result, {1: 1.0, 2: 1.0, 4: 330.0})
    second["levels"] = [lv for lv in second["levels"] if lv["concurrency"] == 4]
    everyone = _variant(result, {1: 150.0, 2: 200.0, 4: 310.0}, host="h200-b")
    for lv in everyone["levels"]:
        lv["mean_acceptance_length"] = 4.79 if lv["concurrency"] == 1 else 4.5
    files = {"plain": _write(tmp_path, "p1.json", first) + "," + _write(tmp_path, "p2.json", second),
             "hybridspec": _write(tmp_path, "h.json", _variant(result, {1: 200.0, 2: 270.0, 4: 320.0})),
             "ours_verify_all": _write(tmp_path, "a.json", everyone)}
    head = build_headline(files, "s", "p", 15, "c")
    assert head["levels"]["4"]["plain"] == 330.0 and head["levels"]["1"]["plain"] == 100.0
    assert head["ratios"]["4"]["hybridspec_over_plain"] == pytest.approx(320 / 330, abs=1e-4)
    assert head["mean_accepted_verify_all"] == 4.79
    assert head["sources"]["plain"] == ["p1.json", "p2.json"]
    assert not head["same_machine"] and any("one machine" in n for n in head["notes"])
    assert head["kv_tokens"] == {"plain": None, "ours": None, "vllm": None}  # no server facts in these files
    assert "vllm_verify_all" not in head["levels"]["1"]


def _headline(tmp_path, *args):
    return CliRunner().invoke(app, ["headline", "--shape", "s", "--profile", "p", "--command", "c",
                                    "-o", str(tmp_path / "out" / "headline.json"), "--plot",
                                    str(tmp_path / "out" / "headline.png"), *args])


def test_the_command_writes_json_plot_and_table(result, tmp_path):
    rng = random.Random(3)
    _, _, _, files = _configs(result, tmp_path, rng, {1: 1.9, 2: 1.4, 4: 1.1}, {1: 1.4, 2: 1.2, 4: 1.1})
    run = _headline(tmp_path, "--plain", files["plain"], "--hybridspec", files["hybridspec"],
                    "--vllm-verify-all", files["vllm_verify_all"])
    assert run.exit_code == 0, run.output
    head = json.loads((tmp_path / "out" / "headline.json").read_text())
    assert set(head) >= {"shape", "profile", "D", "mean_accepted_verify_all", "levels", "kv_tokens", "command"}
    assert head["D"] == 15 and (tmp_path / "out" / "headline.png").stat().st_size > 1000
    assert "| 1 | " in run.output and "1.900x" in run.output and "c1_over_plain: 1.900 against 1.8 (met)" in run.output


RESULT_OPTIONS = ("--plain", "--hybridspec", "--ours-verify-all", "--ours-static", "--vllm-verify-all")


@pytest.mark.parametrize("option", RESULT_OPTIONS)
@pytest.mark.parametrize("broken, expected", [
    ("missing", "cannot read it"),
    ("not-json", "not JSON"),
    ("no-levels", "no field 'levels'"),
])
def test_a_bad_result_is_one_line_and_nothing_is_written(result, tmp_path, broken, expected, option):
    """Each result option of `hybridspec headline` given a file it cannot read (the others valid)."""
    good = _write(tmp_path, "good.json", result)
    bad = tmp_path / "bad.json"
    if broken == "not-json":
        bad.write_text("{")
    elif broken == "no-levels":
        bad.write_text(json.dumps({"status": "ok"}))
    args = {o: good for o in RESULT_OPTIONS}
    args[option] = str(bad) if option == "--plain" else f"{good},{bad}"  # a merged entry is checked file by file
    run = _headline(tmp_path, *[x for o, f in args.items() for x in (o, f)])
    assert run.exit_code == 2
    lines = [line for line in run.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hybridspec headline: error: ") and str(bad) in lines[0]
    assert expected in lines[0]
    assert not (tmp_path / "out" / "headline.json").exists() and not (tmp_path / "out" / "headline.png").exists()


def test_kv_capacity_from_a_server_log(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("INFO [kv_cache_utils.py:2177] GPU KV cache size: 1,198,372 tokens\n"
                   "(EngineCore pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: 25,352,192 tokens\nrest\n")
    assert kv_capacity_from_log(log) == 25_352_192  # the last line: the engine's, after any earlier one
    log.write_text("no such line\n")
    assert kv_capacity_from_log(log) is None
    assert kv_capacity_from_log(tmp_path / "absent.log") is None


def test_vllm_still_logs_the_kv_capacity_line():
    """Contract: vLLM 0.26's ``vllm.v1.core.kv_cache_utils`` logs the capacity as the regex expects; if vLLM
    rewords it, headline.json's kv_tokens would silently be null."""
    from vllm.v1.core import kv_cache_utils

    source = inspect.getsource(kv_cache_utils)
    assert '"GPU KV cache size: %s tokens", f"{num_tokens:,}"' in source
    assert KV_CAPACITY_LINE.search("GPU KV cache size: %s tokens" % f"{6_481_920:,}").group(1) == "6,481,920"


def test_best_static_length_from_simulate(tmp_path):
    """The static row's length comes from `hybridspec simulate --json` on the profile's records (a real run, a
    policy fitted to the profile's matching costs); a result without the row is refused in one line."""
    from vllm_hybridspec.bench.headline import best_static_length

    records, costs, policy = tmp_path / "r.jsonl.gz", tmp_path / "c.json", tmp_path / "p.json"
    runner = CliRunner()
    for args in (["calibrate", "synth", "--profile", "paper-dflash-qwen3.6", "--rounds", "600", "--out", str(records),
                  "--costs-out", str(costs)],
                 ["calibrate", "fit", "--records", str(records), "--costs", str(costs), "--out", str(policy),
                  "--min-length", "1"]):
        run = runner.invoke(app, args)
        assert run.exit_code == 0, run.output
    run = runner.invoke(app, ["simulate", "--records", str(records), "--policy", str(policy), "--json"])
    assert run.exit_code == 0, run.output
    sim = json.loads(run.stdout[run.stdout.index("{"):])
    static = next(p for p in sim["policies"] if p["name"] == "best static")
    w = best_static_length(sim)
    assert static["detail"] == f"w = {w}" and 2 <= w <= 16
    # it is the static length with the highest simulated throughput: no other length does better
    assert static["throughput"] >= next(p for p in sim["policies"] if p["name"] == "verify-all")["throughput"]
    with pytest.raises(ValueError, match="no 'best static' row"):
        best_static_length({"policies": [{"name": "verify-all", "detail": "w = 16"}]})
    with pytest.raises(ValueError, match="expected 'w = N'"):
        best_static_length({"policies": [{"name": "best static", "detail": "eight"}]})
