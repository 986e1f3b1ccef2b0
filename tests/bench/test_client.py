"""A request counts as failed only when the server failed it: a pooled connection the server closed
after its keep-alive is retried once on a fresh one (and counted); errors on a fresh connection, after
the response began, or a timeout still fail the request. Against the stub server of ``stub.py``."""

from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from vllm_hybridspec.bench.client import completion_payload, open_session, stream_completion
from vllm_hybridspec.bench.loadgen import BenchConfig, run_bench
from vllm_hybridspec.cli import app

from .stub import Faults, StubServer

PROMPT = [3, 1, 4, 1, 5]


async def _paused_requests(url: str, n: int, pause: float, max_tokens: int = 6):
    async with open_session() as session:
        results = []
        for _ in range(n):
            payload = completion_payload("stub", PROMPT, max_tokens, True)
            results.append(await stream_completion(session, f"{url}/v1/completions", payload, 30.0))
            await asyncio.sleep(pause)
        return results


# The stub's keep-alive, and the client's pause between requests: past it by a full second, which a
# loaded machine's scheduling delays (the stub's loop stamping a connection idle late) do not eat up.
KEEPALIVE = 0.3
PAUSE = KEEPALIVE + 1.0


def test_a_client_pausing_past_the_keep_alive_gets_every_request_answered():
    """Pauses of 1.3 s against a 0.3 s keep-alive: every second request goes out on the pooled connection
    the server has dropped (the other on a fresh one: the dropped connection left the pool, and a retry's
    connection is not pooled). Each drop is retried exactly once, on a fresh connection that is answered,
    and recorded; no request fails.

    The count is the mechanism's, not the scheduler's: request 1 opens a connection that is pooled,
    request 2 finds it past the keep-alive (dropped, retried), request 3 opens one, request 4 finds it
    dropped, request 5 opens one: two drops. It held only on a quiet machine while the stub wrote the
    stream's end in two writes (aiohttp closes a connection released before its body ends, so a client
    that read [DONE] first pooled nothing) and the pause beat the keep-alive by 0.3 s; both are gone."""
    with StubServer(Faults(keepalive=KEEPALIVE)) as server:
        results = asyncio.run(_paused_requests(server.url, 5, PAUSE))
    assert [r.ok for r in results] == [True] * 5 and [r.error for r in results] == [None] * 5
    # what the server saw, request by request, is what the client did: a request it retried met exactly
    # one keep-alive drop, then was answered; a request it did not retry was answered at once
    assert server.completion_log == [x for r in results for x in (["dropped"] if r.retried else []) + ["answered"]]
    assert server.stale_drops == 2  # the stub did drop requests: without the retry these two fail
    assert [r.retried is not None for r in results] == [False, True, False, True, False]
    assert all("Disconnected" in r.retried or "reset" in r.retried.lower() for r in results if r.retried)
    assert server.completions == server.finished == 5  # the stub counts the requests it answered
    assert all(r.token_ids == StubServer.tokens_for(PROMPT, 6) and r.output_tokens == 6 for r in results)


def test_a_request_dropped_on_a_fresh_connection_fails_and_is_not_retried():
    """Negative control: the same drop on a connection that never sat in the pool is the server's."""
    with StubServer(Faults(drop_every=1)) as server:
        results = asyncio.run(_paused_requests(server.url, 2, 0.0))
    assert server.completions == 2  # one attempt each
    assert [(r.ok, r.retried, r.connection_error) for r in results] == [(False, None, True)] * 2
    assert all(r.error.startswith("ServerDisconnectedError") for r in results)


def _bench(server: StubServer, tmp_path, concurrencies: list[int], n: int, **kwargs) -> dict:
    # one KV scrape per level: scrapes every fraction of a second would keep every pooled connection warm
    cfg = BenchConfig(base_url=server.url, concurrencies=concurrencies, num_requests=n, warmup=0, output_len=8,
                      metrics_interval=30.0, **kwargs)
    out = tmp_path / "r.json"
    doc = run_bench(cfg, [PROMPT, [2, 7, 1, 8]], out, progress=False)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    return doc


def test_bench_after_a_wide_level_reuses_idle_connections_without_failures(tmp_path):
    """C = 8, then C = 1: the one client cycles through the eight pooled connections (aiohttp hands out
    the oldest first), each idle for longer than the 1 s keep-alive by the time it comes round."""
    with StubServer(Faults(keepalive=1.0), token_delay=0.05) as server:
        doc = _bench(server, tmp_path, [8, 1], 12)
    narrow = doc["levels"][1]
    assert doc["status"] == "ok"
    assert [(lv["completed"], lv["failed"]) for lv in doc["levels"]] == [(12, 0), (12, 0)]
    retries = sum(lv["connection_retries"] for lv in doc["levels"])
    assert retries == server.stale_drops >= 1 and narrow["connection_retries"] >= 1
    assert sum(narrow["retried_errors"].values()) == narrow["connection_retries"]
    assert server.completions == server.finished == 24


def test_errors_after_the_response_began_still_count_as_failed(tmp_path):
    """Negative control: every second stream is cut after two tokens: those requests fail, none is retried."""
    with StubServer(Faults(fail_mid_stream_every=2)) as server:
        doc = _bench(server, tmp_path, [2], 8)
    (lv,) = doc["levels"]
    assert (lv["completed"], lv["failed"], lv["connection_retries"]) == (4, 4, 0)
    assert server.completions == 8
    assert all(e.startswith("ClientPayloadError") for e in lv["errors"]) and sum(lv["errors"].values()) == 4
    assert doc["status"] == "ok"  # the stub stayed healthy: failed requests, not an outage


def test_a_request_that_times_out_is_one_failed_request_with_a_plain_message(tmp_path):
    with StubServer(token_delay=0.2) as server:
        doc = _bench(server, tmp_path, [2], 2, request_timeout=0.5)
    (lv,) = doc["levels"]
    assert (lv["completed"], lv["failed"]) == (0, 2) and lv["errors"] == {"timed out after 0.5 s": 2}


def _bench_cli(server: StubServer, tmp_path, out, *args: str):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    return CliRunner().invoke(app, ["bench", "--url", server.url, "--prompts", str(prompts), "--warmup", "0",
                                    "--output-len", "8", "--no-progress", "-o", str(out), *args])


def test_a_server_that_goes_away_mid_bench_is_one_error_line(tmp_path):
    out = tmp_path / "r.json"
    with StubServer(token_delay=0.05) as server:
        server.stop_after(4)
        run = _bench_cli(server, tmp_path, out, "--concurrency", "2,4", "--num-requests", "400")
    assert run.exit_code == 1 and run.stderr.count("\n") == 1 and "Traceback" not in run.output
    assert run.stderr.startswith(f"hybridspec bench: error: the server at {server.url} stopped answering during C=2 (")
    doc = json.loads(out.read_text())
    assert doc["status"] == "aborted" and doc["not_run_concurrencies"] == [4]
    (lv,) = doc["levels"]
    assert lv["completed"] > 0 and lv["failed"] >= 1 and lv["completed"] + lv["failed"] + lv["not_sent"] == 400


def test_a_result_path_that_cannot_be_written_is_one_error_line(tmp_path):
    """Refused before any request (exit 2, as every bad option); a path that turns bad later is exit 1."""
    (tmp_path / "taken").mkdir()
    with StubServer() as server:
        run = _bench_cli(server, tmp_path, tmp_path / "taken", "--concurrency", "1", "--num-requests", "2")
    assert run.exit_code == 2
    assert run.stderr == (f"hybridspec bench: error: --out '{tmp_path / 'taken'}' is a directory; give the path "
                          "of a file to write.\n")
    assert server.completions == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "taken"]
