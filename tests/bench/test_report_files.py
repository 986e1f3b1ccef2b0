"""`hybridspec report` on result files it cannot read: one line naming the file and the field, exit 2,
and nothing written. The valid file is a real one, written by the benchmark against the stub server."""

from __future__ import annotations

import copy
import json
import random

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.bench import schema
from vllm_hybridspec.bench.loadgen import BenchConfig, run_bench
from vllm_hybridspec.cli import app

from ..seeds import fresh_seed
from .stub import StubServer


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "good.json"
    with StubServer() as server:
        run_bench(BenchConfig(base_url=server.url, concurrencies=[1, 2], num_requests=4, warmup=1, output_len=6,
                              repeats=2, metrics_interval=0.05), [[1, 2, 3]], out, progress=False)
    return json.loads(out.read_text())


def _report(tmp_path, *files):
    out_dir = tmp_path / "report"
    run = CliRunner().invoke(app, ["report", *map(str, files), "--out-dir", str(out_dir)])
    return run, out_dir


def test_a_valid_result_makes_a_report(result, tmp_path):
    (tmp_path / "good.json").write_text(json.dumps(result))
    run, out_dir = _report(tmp_path, tmp_path / "good.json")
    assert run.exit_code == 0, run.output
    md = (out_dir / "report.md").read_text()
    assert "| good | 1 | 8 / 0 / 0 |" in md and "| good | 2 | 8 / 0 / 0 |" in md


def _set(doc: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _drop(doc: dict, path: tuple) -> None:
    for key in path[:-1]:
        doc = doc[key]
    del doc[path[-1]]


BROKEN = [  # (how the file is broken, the error after "FILE: ")
    (lambda d: _drop(d, ("levels",)), "no field 'levels' (expected a list of levels"),
    (lambda d: _drop(d, ("levels", 1, "output_throughput")),
     "levels[1]: no field 'output_throughput' (expected a finite number per second in 0..6.71e+13 or null)"),
    (lambda d: _set(d, ("levels", 0, "output_throughput"), "fast"),
     "levels[0].output_throughput: expected a finite number per second in 0..6.71e+13 or null, got the string \"fast\""),
    (lambda d: _set(d, ("levels", 1, "e2e_s", "p99"), "1.5"),
     "levels[1].e2e_s.p99: expected a finite number of seconds in 0..86400 or null, got the string \"1.5\""),
    (lambda d: _set(d, ("levels", 0, "failed"), True), "levels[0].failed: expected an integer in 0..1,000,000,000, got the boolean true"),
    (lambda d: _set(d, ("levels", 0, "concurrency"), 0), "levels[0].concurrency: expected an integer in 1..65,536, got the number 0"),
    (lambda d: _set(d, ("levels", 0, "e2e_s", "mean"), 1e6),
     "levels[0].e2e_s.mean: expected a finite number of seconds in 0..86400 or null, got the number 1000000.0"),
    (lambda d: _set(d, ("levels", 0, "output_throughput_spread", "repeats"), [1.0, None]),
     "levels[0].output_throughput_spread.repeats[1]: expected a finite number per second in 0..6.71e+13, got null"),
    (lambda d: _set(d, ("levels",), {"1": {}}), "levels: expected a list of levels"),
    (lambda d: _set(d, ("levels", 0, "output_throughput"), float("nan")),
     "levels[0].output_throughput: expected a finite number per second in 0..6.71e+13 or null, got the number NaN"),
    (lambda d: _set(d, ("levels", 1, "ttft_s", "p50"), -0.2),
     "levels[1].ttft_s.p50: expected a finite number of seconds in 0..86400 or null, got the number -0.2"),
    (lambda d: _set(d, ("levels", 0, "itl_s", "mean"), float("inf")),
     "levels[0].itl_s.mean: expected a finite number of seconds in 0..86400 or null, got the number Infinity"),
    (lambda d: _set(d, ("levels", 0, "request_throughput"), True),
     "levels[0].request_throughput: expected a finite number per second in 0..6.71e+13 or null, got the boolean true"),
    (lambda d: _set(d, ("levels", 0, "kv_cache_usage"), {"mean": 1.5, "max": 0.2}),
     "levels[0].kv_cache_usage.mean: expected a share in [0, 1] or null, got the number 1.5"),
    (lambda d: _set(d, ("levels", 0, "mean_acceptance_length"), 0.5),
     "levels[0].mean_acceptance_length: expected a finite number in 1..1024 or null, got the number 0.5"),
    (lambda d: _set(d, ("levels", 0, "concurrency"), 1.0),
     "levels[0].concurrency: expected an integer in 1..65,536, got the number 1.0"),
    (lambda d: _set(d, ("levels", 0, "completed"), "8"),
     "levels[0].completed: expected an integer in 0..1,000,000,000, got the string \"8\""),
    (lambda d: _set(d, ("levels", 1, "concurrency"), 1),
     "levels[1].concurrency: 1 is measured twice; one level per concurrency"),
    (lambda d: _set(d, ("levels", 0, "output_throughput_spread"), {"min": 9.0, "max": 3.0, "repeats": [4.0]}),
     "levels[0].output_throughput_spread: min 9.0 and max 3.0 do not hold the repeats [4.0]"),
    (lambda d: _set(d, ("status",), 3), "status: expected a string, got the number 3"),
    (lambda d: _set(d, ("levels", 0, "not_sent"), -1), "levels[0].not_sent: expected an integer in 0..1,000,000,000, got the number -1"),
]


@pytest.mark.parametrize("breaks, message", BROKEN)
def test_a_broken_result_is_refused_naming_the_file_and_the_field(result, tmp_path, breaks, message):
    doc = copy.deepcopy(result)
    breaks(doc)
    (tmp_path / "good.json").write_text(json.dumps(result))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    run, out_dir = _report(tmp_path, tmp_path / "good.json", bad)  # a valid file first: still nothing written
    assert run.exit_code == 2
    assert run.stdout == "" and run.stderr.count("\n") == 1
    assert run.stderr.startswith(f"hybridspec report: error: {bad}: {message}")
    assert not out_dir.exists()


@pytest.mark.parametrize("text, message", [
    ("{\"levels\": [", "not JSON (Expecting value: line 1 column 13 (char 12)); expected a `hybridspec bench` result"),
    ("", "not JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[1, 2]", "expected an object with status, levels, got a list [1, 2]"),
    (json.dumps({"kind": "soak", "status": "passed"}), "a `hybridspec soak` result; the report reads"),
])
def test_a_file_that_is_no_result_is_refused(tmp_path, text, message):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    run, out_dir = _report(tmp_path, bad)
    assert (run.exit_code, run.stderr.count("\n")) == (2, 1)
    assert run.stderr.startswith(f"hybridspec report: error: {bad}: {message}")
    assert not out_dir.exists()


def test_a_missing_file_or_an_empty_merge_entry_is_refused(tmp_path):
    run, out_dir = _report(tmp_path, tmp_path / "missing.json")
    assert run.exit_code == 2
    assert run.stderr == (f"hybridspec report: error: {tmp_path / 'missing.json'}: cannot read it (No such file or "
                          "directory); expected a `hybridspec bench` result JSON.\n")
    run, out_dir = _report(tmp_path, f"all={tmp_path / 'a.json'},")
    assert run.exit_code == 2 and "expected LABEL=PATH[,PATH...]" in run.stderr
    assert not out_dir.exists()


def _redraw(rng: random.Random, value, spec, p: float):
    """``value`` with each leaf redrawn, with probability ``p``, from the ends of the ranges of
    ``bench/schema.py`` and values inside them that its own check accepts (a file inside the model)."""
    if isinstance(spec, schema._Object):
        if not isinstance(value, dict):
            return value
        specs = {**spec.required, **spec.optional}
        return {k: _redraw(rng, v, specs[k], p) if k in specs else v for k, v in value.items()}
    if isinstance(spec, schema._List):
        return [_redraw(rng, v, spec.item, p) for v in value] if isinstance(value, list) else value
    if rng.random() >= p:
        return value
    pool = [v for v in POOL if spec.accepts(v)]
    return rng.choice(pool) if pool else value


POOL = [None, 0, 1, 2, 7, 0.0, 1e-9, 0.5, 1.0, 1.5, 3.7, 1024.0, 1024, schema.MAX_S, schema.MAX_PER_S,
        schema.MAX_COUNT, schema.MAX_BATCH, "ok", ""]


def test_every_result_the_schema_accepts_is_answered(result, tmp_path):
    """``report`` and ``headline`` given results inside the schema (numbers and nulls redrawn from its
    ranges' ends and values inside them): exit 0, or exit 2 with one line; never a traceback."""
    rng = random.Random(fresh_seed("bench_results_inside_the_schema"))
    kept = 0
    for i in range(30):
        doc = _redraw(rng, copy.deepcopy(result), schema._RESULT, rng.choice([1, 2, 4]) / 40)
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(doc))
        try:
            schema.load_result_json(path)
        except schema.InvalidResult:
            continue
        kept += 1
        for args in (["report", str(path), "--out-dir", str(tmp_path / f"report{i}")],
                     ["headline", "--shape", "s", "--profile", "p", "--command", "c", "--plain", str(path),
                      "--hybridspec", str(path), "-o", str(tmp_path / f"h{i}" / "headline.json"),
                      "--plot", str(tmp_path / f"h{i}" / "headline.png")]):
            run = CliRunner().invoke(app, args)
            assert run.exit_code in (0, 2), (args[0], doc, run.output, run.exc_info)
            if run.exit_code == 2:
                assert len(run.output.strip().splitlines()) == 1, (args[0], run.output)
    print(f"{kept} of 30 results inside the schema answered")
    assert kept >= 10, kept
