"""`hybridspec bench` and `hybridspec report` against vLLM's OpenAI server on the CPU (tiny Qwen3, loopback).

Each test starts one server (about 40 s on two cores); the bench runs as the console command, as a user
would run it.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time

import pytest

from .conftest import free_port, serve_command, server_env

HYBRIDSPEC = [sys.executable, "-m", "vllm_hybridspec.cli"]


@pytest.mark.timeout(600)
def test_bench_with_managed_server_and_report(tiny_target, token_prompts, tmp_path):
    """C = 1 and 4, two measured runs of 8 requests of 48 tokens each, against a server the tool starts
    (with n-gram speculation, so the acceptance length is measured); then the report's table and plots."""
    port = free_port()
    serve = shlex.join(serve_command(tiny_target, port, "--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 3, '
                                     '"prompt_lookup_min": 1, "prompt_lookup_max": 2}'))
    out = tmp_path / "ngram.json"
    start = time.monotonic()
    run = subprocess.run([*HYBRIDSPEC, "bench", "--serve", serve, "--prompts", str(token_prompts),
                          "--concurrency", "1,4", "--num-requests", "8", "--warmup", "2", "--output-len", "48",
                          "--repeats", "2", "--metrics-interval", "0.05", "-o", str(out)],
                         env=server_env(), capture_output=True, text=True, timeout=540, check=False)
    print(run.stdout, run.stderr[-3000:], f"bench took {time.monotonic() - start:.0f} s", sep="\n")
    assert run.returncode == 0
    doc = json.loads(out.read_text())
    assert doc["status"] == "ok" and doc["config"]["model"] == str(tiny_target)
    # what the tool read of the server it started: the KV capacity vLLM logged, its start time, the host
    server = doc["config"]["server"]
    assert server["log"] == "ngram.server.log" and server["kv_capacity_tokens"] > 0
    assert f"GPU KV cache size: {server['kv_capacity_tokens']:,} tokens" in (tmp_path / server["log"]).read_text()
    assert 0 < server["startup_s"] < time.monotonic() - start
    assert doc["config"]["host"] == platform.node() and doc["config"]["started_at"].endswith("+00:00")
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 4]
    for lv in doc["levels"]:
        assert (lv["completed"], lv["failed"], lv["not_sent"]) == (16, 0, 0)
        assert lv["warmup"] == {"num_requests": 2, "completed": 2, "failed": 0, "connection_retries": 0}
        assert lv["output_tokens"] == 16 * 48  # ignore_eos: a fixed output length
        assert lv["output_throughput"] == pytest.approx(lv["output_tokens"] / lv["duration_s"])
        spread = lv["output_throughput_spread"]  # each run's 8 * 48 tokens over its own time
        assert len(spread["repeats"]) == 2 and spread["min"] <= lv["output_throughput"] <= spread["max"]
        assert lv["duration_s"] == pytest.approx(sum(8 * 48 / t for t in spread["repeats"]), rel=1e-6)
        assert 0 < lv["itl_s"]["mean"] < lv["e2e_s"]["mean"] and lv["e2e_s"]["p50"] <= lv["e2e_s"]["p99"]
        assert 1.0 <= lv["mean_acceptance_length"] <= 4.0  # 3 speculative tokens + the bonus one
        assert lv["spec_decode"]["num_drafts"] > 0
        assert lv["kv_cache_usage"]["num_samples"] >= 1 and 0 <= lv["kv_cache_usage"]["max"] <= 1.0
    # The gauge is sampled while the level runs; on two busy cores the server may answer /metrics only
    # between requests, so a positive reading is not guaranteed here (tests/bench/test_units.py checks
    # the parsing of non-zero readings).
    # the managed server is gone (its process group terminated)
    assert subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/health"], check=False).returncode != 0

    report = subprocess.run([*HYBRIDSPEC, "report", str(out), "--out-dir", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert report.returncode == 0, report.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| ngram | 1 | 16 / 0 / 0 |" in md and "| ngram | 4 | 16 / 0 / 0 |" in md
    for png in ("throughput.png", "latency.png", "kv_cache.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000


@pytest.mark.timeout(600)
def test_server_killed_mid_run_gives_partial_result(tiny_target, token_prompts, tmp_path):
    """A server without speculation, killed during the second level: one clear error line, exit code 1,
    and a partial JSON with the finished level, the aborted one's counts, and the level never run."""
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen(serve_command(tiny_target, port), env=server_env(), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    out = tmp_path / "killed.json"
    try:
        deadline = time.monotonic() + 300
        while subprocess.run(["curl", "-sf", f"http://127.0.0.1:{port}/health"], capture_output=True, check=False).returncode:
            assert server.poll() is None and time.monotonic() < deadline, "the vLLM server did not start"
            time.sleep(1)
        # C=1: 16 requests (a second or two); C=64: 256 requests of 32 tokens, far longer than the kill delay
        bench = subprocess.Popen([*HYBRIDSPEC, "bench", "--url", f"http://127.0.0.1:{port}", "--prompts",
                                  str(token_prompts), "--concurrency", "1,64,128", "--output-len", "32",
                                  "--warmup", "0", "--no-progress", "-o", str(out)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (out.exists() and json.loads(out.read_text())["levels"]):  # rewritten when C=1 is done
            assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
            time.sleep(0.1)
        time.sleep(1.5)
        os.killpg(server.pid, signal.SIGKILL)
        stdout, stderr = bench.communicate(timeout=120)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
    print(stdout, stderr, sep="\n")
    assert bench.returncode == 1
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "stopped answering during C=64" in errors[0] and str(out) in errors[0]

    doc = json.loads(out.read_text())
    assert doc["status"] == "aborted" and doc["not_run_concurrencies"] == [128]
    first, second = doc["levels"]
    assert (first["concurrency"], first["status"], first["completed"], first["failed"]) == (1, "ok", 16, 0)
    assert first["mean_acceptance_length"] is None  # no speculation: null, not 0
    assert first["kv_cache_usage"]["num_samples"] >= 1
    assert (second["concurrency"], second["status"]) == (64, "aborted")
    assert second["completed"] > 0 and second["failed"] > 0
    assert second["completed"] + second["failed"] + second["not_sent"] == second["num_requests"] == 256
    assert all(("Error" in e) or ("refused" in e) for e in second["errors"])
