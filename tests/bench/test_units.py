"""The benchmark's parsing and statistics, without a server."""

import json
import time

import pytest

from vllm_hybridspec.bench.client import RequestResult
from vllm_hybridspec.bench.loadgen import level_stats
from vllm_hybridspec.bench.metrics import parse_metrics, spec_decode_delta
from vllm_hybridspec.bench.prompts import load_prompts
from vllm_hybridspec.bench.report import write_report
from vllm_hybridspec.bench.server import url_from_command

METRICS = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
"""


def test_metrics_deltas():
    before = parse_metrics(METRICS)
    assert before["vllm:kv_cache_usage_perc"] == pytest.approx(0.375)  # a fraction per engine: averaged
    after = {**before, "vllm:spec_decode_num_drafts_total": 14.0,
             "vllm:spec_decode_num_draft_tokens_total": 42.0, "vllm:spec_decode_num_accepted_tokens_total": 29.0}
    delta = spec_decode_delta(before, after)
    assert delta["mean_acceptance_length"] == pytest.approx(1 + 9 / 4)
    assert delta["acceptance_rate"] == pytest.approx(9 / 12)
    no_spec = parse_metrics(METRICS.split("# TYPE vllm:spec")[0])
    assert spec_decode_delta(no_spec, no_spec)["mean_acceptance_length"] is None


def test_level_stats_counts_failures_and_per_token_itl():
    ok = RequestResult(ok=True, start=0.0, end=1.0, output_tokens=5, ttft=0.2, itl=[0.2] * 4)
    bad = RequestResult(error="HTTP 500: boom", start=0.0, end=0.1)
    lv = level_stats(4, 10, [ok, ok, bad], duration=2.0)
    assert (lv["completed"], lv["failed"], lv["not_sent"]) == (2, 1, 7)
    assert lv["errors"] == {"HTTP 500: boom": 1}
    assert lv["output_throughput"] == pytest.approx(5.0)
    assert lv["tpot_s"]["mean"] == pytest.approx(0.2)
    assert lv["e2e_s"]["p99"] == pytest.approx(1.0)


def test_url_from_command():
    assert url_from_command("vllm serve m --port 9001", "x") == "http://127.0.0.1:9001"
    assert url_from_command("vllm serve m --host=127.0.0.2", "x") == "http://127.0.0.2:8000"
    assert url_from_command("vllm serve m", "http://127.0.0.1:8000") == "http://127.0.0.1:8000"


def test_prompts_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n[1, 2, 3]\n"bare"\n')
    assert load_prompts(path) == ["hi", [1, 2, 3], "bare"]
    path.write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match="no field 'prompt'"):
        load_prompts(path)
    path.write_text('"fine"\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"p.jsonl:2 is not JSON \(Expecting value: line 2 column 1"):
        load_prompts(path)
    with pytest.raises(ValueError, match="exactly one"):
        load_prompts()


def test_report_of_a_synthetic_result(tmp_path):
    def level(c, tps):
        s = {"mean": 0.01, "p50": 0.01, "p99": 0.02}
        return {"concurrency": c, "num_requests": 8, "completed": 8, "failed": 0, "not_sent": 0,
                "output_throughput": tps, "request_throughput": tps / 16, "ttft_s": s, "itl_s": s, "tpot_s": s,
                "e2e_s": s, "mean_acceptance_length": None, "kv_cache_usage": {"mean": 0.1, "max": 0.2},
                "status": "ok"}
    for name, tps in (("a", 100.0), ("b", 150.0)):
        doc = {"status": "ok", "error": None, "config": {"label": name}, "levels": [level(1, tps), level(4, 3 * tps)]}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    md = write_report([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "out").read_text()
    assert "| b | 4 | 8 / 0 / 0 | 450.0 |" in md
    assert "| a | 1 |" in md and "20.0%" in md
    for png in ("throughput.png", "latency.png", "kv_cache.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000


def test_throughput_spread_of_repeated_runs_in_the_report(tmp_path):
    """A level measured in several runs keeps each run's tokens/s; the table shows the pooled tokens/s with
    the runs' min-max, and one run has no spread."""
    from vllm_hybridspec.bench.loadgen import throughput_spread

    assert throughput_spread([120.0]) is None
    spread = throughput_spread([100.0, 130.0, 90.0])
    assert spread == {"repeats": [100.0, 130.0, 90.0], "median": 100.0, "min": 90.0, "max": 130.0}
    s = {"mean": 0.01, "p50": 0.01, "p99": 0.02}
    level = {"concurrency": 4, "num_requests": 24, "completed": 24, "failed": 0, "not_sent": 0,
             "output_throughput": 104.0, "output_throughput_spread": spread, "request_throughput": 2.0,
             "ttft_s": s, "itl_s": s, "tpot_s": s, "e2e_s": s, "mean_acceptance_length": 1.5,
             "kv_cache_usage": {"mean": 0.1, "max": 0.2}, "status": "ok"}
    doc = {"status": "ok", "error": None, "config": {"label": "x"}, "levels": [level]}
    (tmp_path / "x.json").write_text(json.dumps(doc))
    md = write_report([tmp_path / "x.json"], tmp_path / "out").read_text()
    assert "| x | 4 | 24 / 0 / 0 | 104.0 [90.0-130.0] |" in md
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 1000


def test_report_merges_the_sweeps_of_one_configuration(tmp_path):
    """LABEL=a.json,b.json: one line per configuration from sweeps run in separate calls; a level measured
    in both comes from the last file, and the report says which value it replaced; a cut sweep is flagged."""
    s = {"mean": 0.01, "p50": 0.01, "p99": 0.02}

    def level(c, tps):
        return {"concurrency": c, "num_requests": 8, "completed": 8, "failed": 0, "not_sent": 0,
                "output_throughput": tps, "request_throughput": tps / 16, "ttft_s": s, "itl_s": s, "tpot_s": s,
                "e2e_s": s, "mean_acceptance_length": 1.7, "kv_cache_usage": {"mean": 0.1, "max": 0.2},
                "status": "ok"}
    small = {"status": "ok", "error": None, "config": {"label": "x-small"}, "levels": [level(1, 41.6), level(4, 133.0),
                                                                                      level(16, 431.2)]}
    big = {"status": "running", "error": None, "config": {"label": "x-big"}, "levels": [level(16, 453.8),
                                                                                       level(64, 755.4)]}
    (tmp_path / "small.json").write_text(json.dumps(small))
    (tmp_path / "big.json").write_text(json.dumps(big))
    md = write_report([f"all={tmp_path / 'small.json'},{tmp_path / 'big.json'}"], tmp_path / "out").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| all |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "4", "16", "64"]
    assert "| all | 16 | 8 / 0 / 0 | 453.8 |" in md
    assert "C = 16 measured in small.json (431.2 tok/s) and big.json (453.8 tok/s)" in md
    assert "- all: partly ok: big.json: running: None" in md
    assert "merged from small.json, big.json" in md
    with pytest.raises(ValueError, match="'all=': expected LABEL=PATH"):
        write_report(["all="], tmp_path / "out2")


def test_a_cancelled_closed_loop_ends_even_if_a_request_swallows_the_cancellation():
    """Ctrl-C cancels the closed loop while its clients wait on requests whose HTTP layer turns the
    cancellation into an ordinary result (aiohttp's timeout can; a CI soak then ran on to its deadline).
    The loop must end when its in-flight requests return, not at its deadline 30 s later, and start no new
    request."""
    import asyncio

    from vllm_hybridspec.bench.loadgen import closed_loop

    sent = []

    async def send(item):
        sent.append(item)
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # swallowed, as a library that reports it as a timeout
        return RequestResult(ok=True, output_tokens=1)

    async def main():
        results = []
        task = asyncio.ensure_future(closed_loop(send, iter(range(10**6)), 4, time.monotonic() + 30,
                                                 asyncio.Event(), lambda r: None, None, results))
        await asyncio.sleep(0.3)
        task.cancel()
        at_cancel = len(sent)
        # a loop that sends on after the cancel runs to its 30 s deadline: wait_for's timeout ends it here
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        return at_cancel, len(sent), len(results)

    at_cancel, num_sent, num_results = asyncio.run(main())
    print(f"{at_cancel} requests sent before the cancel, {num_sent} in all, {num_results} results")
    assert num_sent == at_cancel  # none sent after the cancel
    assert num_sent == num_results  # every request sent was answered


def test_the_kv_sampler_stops_even_if_a_scrape_swallows_the_cancellation(monkeypatch):
    """``KVUsageSampler.stop`` cancels its loop while a scrape is under way whose HTTP layer turns the
    cancellation into no answer (aiohttp's timeout can; a soak given Ctrl-C would then hang in ``stop``).
    It must return, not scrape on."""
    import asyncio

    from vllm_hybridspec.bench import metrics

    scrapes, swallowed = [], []

    async def scrape(session, base_url):
        scrapes.append(time.monotonic())
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            if swallowed:  # the first cancellation only, so that a stuck sampler can still be ended below
                raise
            swallowed.append(True)
            return None  # swallowed, as aiohttp's timeout turned into "no answer"
        return {metrics.KV_USAGE: 0.5}

    monkeypatch.setattr(metrics, "scrape", scrape)

    async def main():
        sampler = metrics.KVUsageSampler(None, "http://stub", interval=0.01)
        sampler.start()
        await asyncio.sleep(0.5)
        stop = asyncio.ensure_future(sampler.stop())
        await asyncio.wait({stop}, timeout=2)  # a liveness bound: a working stop returns at its next await
        ended, stuck = time.monotonic(), not stop.done()
        while not stop.done():  # a sampler that ignores its stop: cancel until one lands between scrapes
            sampler._task.cancel()
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a loop still running would scrape again meanwhile
        return stuck, stop.result(), [t for t in scrapes if t > ended]

    stuck, kv, later = asyncio.run(main())
    assert not stuck, "KVUsageSampler.stop did not return within 2 s of a cancellation the scrape swallowed"
    assert later == []  # no scrape after the stop returned
    assert kv["num_samples"] >= 1 and kv["mean"] == 0.5
