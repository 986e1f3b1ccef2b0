"""`hybridspec soak` as a user runs it, against the stub server: a healthy server passes every check;
a server that leaks KV blocks of aborted requests, one whose greedy output drifts, and one that fails a
request each fail the soak naming that check and no other (the negative controls)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.cli import app

from .stub import KV_BLOCKS, Faults, StubServer
from ..seeds import fresh_seed

PROBES, PROBE_TOKENS = 3, 8
ARGS = ["--duration", "2", "--concurrency", "4", "--disconnect-share", "0.3", "--disconnect-after", "3",
        "--output-len", "12", "--probes", str(PROBES), "--probe-tokens", str(PROBE_TOKENS), "--idle-timeout", "1.5",
        "--metrics-interval", "0.2", "--no-progress"]


@pytest.fixture
def prompts(tmp_path) -> list[list[int]]:
    rng = random.Random(fresh_seed("soak_prompts"))
    rows = [[rng.randrange(90) for _ in range(rng.randrange(3, 9))] for _ in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return rows


def _soak(server: StubServer, tmp_path, *args: str):
    out = tmp_path / "soak.json"
    run = CliRunner().invoke(app, ["soak", "--url", server.url, "--prompts", str(tmp_path / "prompts.jsonl"),
                                   "-o", str(out), *ARGS, *args])
    return run, json.loads(out.read_text()) if out.exists() else None


def test_a_healthy_server_passes_every_check(tmp_path, prompts):
    with StubServer() as server:
        run, doc = _soak(server, tmp_path)
    print(run.stdout, run.stderr)
    assert run.exit_code == 0
    assert doc["status"] == "passed" and doc["failed_checks"] == []
    assert all(doc["checks"][name]["passed"] for name in ("no_failed_requests", "kv_cache_idle",
                                                          "probe_outputs_unchanged"))
    soak = doc["soak"]
    assert soak["failed"] == 0 and soak["errors"] == {} and soak["completed"] > 0
    # every disconnect planned happened, and the server saw each one as its client going away
    assert soak["disconnected"] == soak["disconnect_planned"] == server.disconnects > 0
    assert soak["requests"] == soak["completed"] + soak["disconnected"]
    assert server.finished == soak["completed"] + 2 * PROBES
    assert soak["output_tokens"] == 12 * soak["completed"]
    # at most one running request per client, and one per client whose abort the server has yet to see
    assert 0 < doc["kv_cache_usage"]["during"]["max"] <= 2 * 4 / KV_BLOCKS
    idle = doc["kv_cache_usage"]["idle"]
    assert idle["final"] == 0.0 and idle["drained_after_s"] is not None and idle["drained_after_s"] <= 1.5
    expected = [StubServer.tokens_for(p, PROBE_TOKENS) for p in prompts[:PROBES]]
    assert [p["token_ids"] for p in doc["probes"]["before"]] == expected
    assert [p["token_ids"] for p in doc["probes"]["after"]] == expected and doc["probes"]["changed"] == []
    for name in ("no_failed_requests", "kv_cache_idle", "probe_outputs_unchanged"):
        assert f"PASS {name}: " in run.stdout
    assert run.stderr == ""


@pytest.mark.parametrize("faults, check", [
    (Faults(leak_on_disconnect=True), "kv_cache_idle"),
    (Faults(change_output_from=PROBES + 1), "probe_outputs_unchanged"),  # the soak's first request on
    (Faults(http_500_at=PROBES + 2), "no_failed_requests"),
])
def test_a_faulty_server_fails_the_soak_naming_the_check(tmp_path, prompts, faults, check):
    with StubServer(faults) as server:
        run, doc = _soak(server, tmp_path)
    print(run.stdout, run.stderr)
    assert run.exit_code == 1
    assert doc["status"] == "failed" and doc["failed_checks"] == [check]
    assert f"FAIL {check}: " in run.stdout
    assert run.stderr == f"hybridspec soak: error: failed check(s): {check}\n"
    if check == "kv_cache_idle":
        leaked = server.disconnects / KV_BLOCKS
        assert server.disconnects == doc["soak"]["disconnected"] > 0
        assert doc["kv_cache_usage"]["idle"] == {"final": pytest.approx(leaked), "drained_after_s": None,
                                                 "num_samples": doc["kv_cache_usage"]["idle"]["num_samples"],
                                                 "timeout_s": 1.5}
        assert f"KV-cache usage still {leaked:.2%} after 1.5 s idle" in run.stdout
    elif check == "probe_outputs_unchanged":
        assert doc["probes"]["changed"] == list(range(PROBES))
        before, after = doc["probes"]["before"][0]["token_ids"], doc["probes"]["after"][0]["token_ids"]
        assert [i for i, (b, a) in enumerate(zip(before, after)) if b != a] == [2]
        assert f"{PROBES} of {PROBES} probes changed or failed: probe 0 changed at token 2" in run.stdout
    else:
        assert doc["soak"]["failed"] == 1
        assert doc["soak"]["errors"] == {'HTTP 500: {"error": "stub: internal error"}': 1}


def test_a_server_that_goes_away_mid_soak_is_one_error_line(tmp_path, prompts):
    with StubServer() as server:
        server.stop_after(PROBES + 4)  # four soak requests done
        run, doc = _soak(server, tmp_path, "--duration", "30")
    assert run.exit_code == 1
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.output
    assert run.stderr.startswith(f"hybridspec soak: error: the server at {server.url} stopped answering during "
                                 "the soak (")
    assert run.stderr.endswith(f"; partial results in {tmp_path / 'soak.json'}\n")
    assert doc["status"] == "aborted" and doc["soak"]["completed"] > 0 and doc["soak"]["failed"] >= 1
    assert doc["soak"]["duration_s"] < 30


@pytest.mark.parametrize("args, message", [
    (["--disconnect-share", "1.5"], "--disconnect-share 1.5 is not valid; expected a share between 0 and 1."),
    (["--disconnect-after", "12"], "--disconnect-after 12 is not valid; expected an integer from 1 to "
                                   "--output-len - 1 = 11."),
    (["--duration", "0"], "--duration 0 is not valid; expected a positive number of seconds."),
    (["--probes", "9"], "--probes 9 needs as many prompts, but"),
])
def test_bad_arguments_are_one_line_naming_the_value(tmp_path, prompts, args, message):
    with StubServer() as server:
        run, doc = _soak(server, tmp_path, *args)
    assert (run.exit_code, doc, server.completions) == (2, None, 0)
    assert run.stderr.startswith(f"hybridspec soak: error: {message}") and run.stderr.count("\n") == 1


@pytest.mark.timeout(120)
def test_ctrl_c_leaves_the_json_marked_interrupted(tmp_path, prompts):
    """SIGINT to the console command mid-soak: exit 130, one line, and the JSON says where it stopped."""
    out = tmp_path / "soak.json"
    with StubServer() as server:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_hybridspec.cli", "soak", "--url", server.url,
                                 "--prompts", str(tmp_path / "prompts.jsonl"), "-o", str(out), *ARGS,
                                 "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                                # Ctrl-C as a terminal delivers it: a suite started in the background by a
                                # script (`cmd &`) inherits SIGINT ignored, and the soak then never sees it
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 90
        while server.completions <= PROBES + 4:  # the soak itself is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            stdout, stderr = proc.communicate(timeout=30)
            pytest.fail(f"the soak did not exit within 60 s of SIGINT; its stacks:\n{stderr[-6000:]}")
    assert proc.returncode == 130
    assert stderr == f"hybridspec soak: error: interrupted; partial results in {out}\n"
    doc = json.loads(out.read_text())
    assert (doc["status"], doc["error"], doc["config"]["model"]) == ("interrupted", "interrupted", "stub")
