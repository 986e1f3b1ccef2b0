"""`hybridspec bench`, `soak` and `report` on bad options: exit status 2, one line on stderr naming the
option, the value and what would be valid, before any server is contacted or any file written. Then the
writers: a failure midway leaves the earlier file as it was and no temporary file."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.cli import app

UNREACHABLE = "http://127.0.0.1:9"  # nothing listens there: a check that let a value through would fail later


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": [1, 2, 3]}\n')
    return path


def refused_line(result, command: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    prefix = f"hybridspec {command}: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0].removeprefix(prefix)


BENCH = [
    (["--num-requests", "0"], "--num-requests '0': Input should be greater than or equal to 1"),
    (["--num-requests", "-5"], "--num-requests '-5': Input should be greater than or equal to 1"),
    (["--num-requests", "many"], "--num-requests 'many': Input should be a valid integer, unable to parse string "
                                 "as an integer"),
    (["--warmup", "-1"], "--warmup '-1': Input should be greater than or equal to 0"),
    (["--repeats", "0"], "--repeats '0': Input should be greater than or equal to 1"),
    (["--concurrency", "0"], "--concurrency '0' is not a comma-separated list of positive integers, e.g. "
                             "1,4,16,64,128."),
    (["--concurrency", "1,x"], "--concurrency '1,x' is not a comma-separated list of positive integers, e.g. "
                               "1,4,16,64,128."),
    (["--output-len", "0"], "--output-len must be at least 1, got 0."),
    (["--request-timeout", "0"], "--request-timeout 0 is not valid; expected a positive number of seconds."),
    (["--request-timeout", "nan"], "--request-timeout nan is not valid; expected a positive number of seconds."),
    (["--level-timeout", "inf"], "--level-timeout inf is not valid; expected a positive number of seconds."),
    (["--serve-timeout", "-1"], "--serve-timeout -1 is not valid; expected a positive number of seconds."),
    (["--metrics-interval", "0"], "--metrics-interval 0 is not valid; expected a positive number of seconds."),
    (["--url", "localhost:8000"], "--url 'localhost:8000' is not valid; expected http://HOST[:PORT] or "
                                  "https://HOST[:PORT], e.g. http://127.0.0.1:8000."),
    (["--url", "http://127.0.0.1:99999"], "--url 'http://127.0.0.1:99999' is not valid; expected "
                                          "http://HOST[:PORT] or https://HOST[:PORT], e.g. http://127.0.0.1:8000."),
    (["--serve", "vllm serve 'model"], "--serve \"vllm serve 'model\" is not a command line (No closing "
                                       "quotation); quote it as a shell would."),
    (["--serve", " "], "--serve is empty; expected a server command line, e.g. 'vllm serve MODEL --port 8000'."),
    (["--switch", "w 4={}"], "--switch 'w 4={}': expected LABEL=OPTIONS with a label of letters, digits, '-' or "
                             "'_', e.g. 'all={}' or 'w4={\"fixed_length\": 4}'"),
    (["--switch", "a={}", "--switch", "a={}"], "--switch labels must differ, got ['a', 'a']"),
    (["--eos", "--nmu-requests", "3"], "No such option: --nmu-requests (Possible options: --num-requests, "
                                       "--repeats)"),
]


@pytest.mark.parametrize("args, message", BENCH, ids=[" ".join(a) for a, _ in BENCH])
def test_bench_refuses_a_bad_option_before_starting(tmp_path, prompts, args, message):
    out = tmp_path / "results" / "r.json"
    args = ["--url", UNREACHABLE, *args] if "--url" not in args and "--serve" not in args else args
    result = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), "-o", str(out), "--no-progress", *args])
    assert refused_line(result, "bench") == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_bench_refuses_result_paths_and_prompt_sources(tmp_path, prompts):
    def refusal(*args) -> str:
        return refused_line(CliRunner().invoke(app, ["bench", "--url", UNREACHABLE, *map(str, args)]), "bench")

    assert refusal("--prompts", prompts, "-o", tmp_path) == (f"--out '{tmp_path}' is a directory; give the path of "
                                                            "a file to write.")
    assert refusal("--prompts", prompts, "-o", prompts / "r.json") == (
        f"--out '{prompts / 'r.json'}': '{prompts}' is a file, so no directory can be made below it.")
    out = tmp_path / "r.json"
    assert refusal("--prompts", tmp_path / "none.jsonl", "-o", out) == (
        f"Prompt file {tmp_path / 'none.jsonl'} does not exist; expected a JSONL file of prompts.")
    assert refusal("-o", out) == ("Give exactly one prompt source: a JSONL file (--prompts) or a dataset name "
                                  "(--dataset).")
    assert refusal("--prompts", prompts, "--prompt-field", "text", "-o", out) == (
        f"{prompts}:1 has no field 'text' (fields: ['prompt']); pick one with --prompt-field.")
    assert refusal("--prompts", prompts, "-o", out, "--switch", "a={\"fixed_length\": 0}") == (
        "--switch 'a={\"fixed_length\": 0}': switch option fixed_length=0 must be an integer >= 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


SOAK = [
    (["--duration", "inf"], "--duration inf is not valid; expected a positive number of seconds."),
    (["--concurrency", "0"], "--concurrency 0 is not valid; expected an integer >= 1."),
    (["--disconnect-share", "nan"], "--disconnect-share nan is not valid; expected a share between 0 and 1."),
    (["--output-len", "1"], "--output-len 1 is not valid; expected an integer >= 2."),
    (["--probes", "0"], "--probes 0 is not valid; expected an integer >= 1."),
    (["--probe-tokens", "0"], "--probe-tokens 0 is not valid; expected an integer >= 1."),
    (["--idle-timeout", "-1"], "--idle-timeout -1 is not valid; expected a number of seconds >= 0."),
    (["--request-timeout", "0"], "--request-timeout 0 is not valid; expected a positive number of seconds."),
    (["--serve-timeout", "nan"], "--serve-timeout nan is not valid; expected a positive number of seconds."),
    (["--metrics-interval", "-0.5"], "--metrics-interval -0.5 is not valid; expected a positive number of seconds."),
    (["--seed", "-3"], "--seed -3 is not valid; expected an integer >= 0."),
    (["--url", "ftp://host"], "--url 'ftp://host' is not valid; expected http://HOST[:PORT] or https://HOST[:PORT], "
                              "e.g. http://127.0.0.1:8000."),
    (["--serve", "vllm serve m --port '8001"], "--serve \"vllm serve m --port '8001\" is not a command line (No "
                                              "closing quotation); quote it as a shell would."),
]


@pytest.mark.parametrize("args, message", SOAK, ids=[" ".join(a) for a, _ in SOAK])
def test_soak_refuses_a_bad_option_before_starting(tmp_path, prompts, args, message):
    args = ["--url", UNREACHABLE, *args] if "--url" not in args else args
    result = CliRunner().invoke(app, ["soak", "--prompts", str(prompts), "-o", str(tmp_path / "s.json"),
                                      "--no-progress", *args])
    assert refused_line(result, "soak") == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_soak_refuses_an_unwritable_result_path_and_unreadable_prompts(tmp_path, prompts):
    def refusal(*args) -> str:
        return refused_line(CliRunner().invoke(app, ["soak", "--url", UNREACHABLE, *map(str, args)]), "soak")

    assert refusal("--prompts", prompts, "-o", tmp_path) == (f"--out '{tmp_path}' is a directory; give the path of a "
                                                            "file to write.")
    out = tmp_path / "s.json"
    assert refusal("--prompts", tmp_path / "none.jsonl", "-o", out) == (
        f"Prompt file {tmp_path / 'none.jsonl'} does not exist; expected a JSONL file of prompts.")
    assert refusal("--prompts", prompts, "--prompt-field", "text", "-o", out) == (
        f"{prompts}:1 has no field 'text' (fields: ['prompt']); pick one with --prompt-field.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def _result(tmp_path, name="a"):
    s = {"mean": 0.01, "p50": 0.01, "p99": 0.02}
    level = {"concurrency": 1, "num_requests": 8, "completed": 8, "failed": 0, "not_sent": 0,
             "output_throughput": 100.0, "request_throughput": 6.0, "ttft_s": s, "itl_s": s, "e2e_s": s,
             "mean_acceptance_length": None, "kv_cache_usage": {"mean": 0.1, "max": 0.2}, "status": "ok"}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"status": "ok", "error": None, "config": {"label": name}, "levels": [level]}))
    return path


def test_report_refuses_an_out_dir_that_is_a_file(tmp_path):
    result_file = _result(tmp_path)
    run = CliRunner().invoke(app, ["report", str(result_file), "--out-dir", str(result_file)])
    assert refused_line(run, "report") == f"--out-dir '{result_file}' is a file; give a directory to write into"
    run = CliRunner().invoke(app, ["report", str(result_file), "--out-dir", str(result_file / "sub")])
    assert refused_line(run, "report") == (f"--out-dir '{result_file / 'sub'}': '{result_file}' is a file, so no "
                                           "directory can be made below it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_report_whose_plot_fails_midway_leaves_no_partial_files(tmp_path, monkeypatch):
    """Each file of a report is written beside and renamed: a failure while drawing the second plot leaves
    the first plot whole, no report.md and no temporary file."""
    import matplotlib.figure

    from vllm_hybridspec.bench.report import write_report

    calls = {"n": 0}
    real = matplotlib.figure.Figure.savefig

    def flaky(self, path, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            with open(path, "wb") as f:
                f.write(b"half a png")
            raise OSError("disk full")
        return real(self, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", flaky)
    out = tmp_path / "report"
    with pytest.raises(OSError, match="disk full"):
        write_report([_result(tmp_path)], out)
    assert sorted(p.name for p in out.iterdir()) == ["throughput.png"]
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_result_write_keeps_the_earlier_file_and_no_temporary(tmp_path, monkeypatch):
    import os

    from vllm_hybridspec.bench import loadgen

    out = tmp_path / "r.json"
    loadgen.write_json(out, {"status": "running", "levels": []})
    before = out.read_text()

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match=f"could not write {out}: No space left on device"):
        loadgen.write_json(out, {"status": "ok", "levels": [{"concurrency": 1}]})
    assert out.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
