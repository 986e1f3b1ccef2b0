"""The closed-loop load generator: C clients, each sending its next request as soon as the previous
one finished, for each C in a list; one result dict per level, written as JSON after every level."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from vllm_hybridspec.bench.client import (RequestResult, completion_payload, fresh_session, open_session,
                                          stream_completion)
from vllm_hybridspec.bench.metrics import KVUsageSampler, scrape, spec_decode_delta
from vllm_hybridspec.bench.prompts import Prompt

RESULT_VERSION = 1


class BenchAborted(RuntimeError):
    """The server went away mid-run; the partial result file has been written."""


@dataclass
class BenchConfig:
    base_url: str
    concurrencies: list[int]
    num_requests: int  # measured requests per level; 0: max(16, 4 * C)
    warmup: int  # warm-up requests per level, excluded from every statistic; -1: C
    output_len: int
    ignore_eos: bool = True  # fixed output length; False: stop at EOS (output_len is the cap)
    model: str | None = None  # None: the first model the server lists
    label: str = ""
    request_timeout: float = 600.0
    level_timeout: float = 1800.0  # no new requests after this many seconds of a level
    metrics_interval: float = 0.5
    repeats: int = 1  # measured runs of num_requests per level, back to back, for the throughput's spread

    def requests_for(self, c: int) -> tuple[int, int]:
        n = self.num_requests if self.num_requests > 0 else max(16, 4 * c)
        return n, (c if self.warmup < 0 else self.warmup)


def summarize(values) -> dict:
    if len(values) == 0:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def throughput_spread(tokens_per_s: list[float]) -> dict | None:
    """Median, minimum and maximum of the repeats' output tokens/s (``None`` for a single run)."""
    if len(tokens_per_s) < 2:
        return None
    return {"repeats": tokens_per_s, "median": float(np.median(tokens_per_s)), "min": min(tokens_per_s),
            "max": max(tokens_per_s)}


def level_stats(c: int, planned: int, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": c,
        "num_requests": planned,
        "completed": len(ok),
        "failed": len(failed),
        "not_sent": planned - len(results),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        **retry_stats(results),
        "duration_s": duration,
        "output_tokens": tokens,
        "output_throughput": tokens / duration if duration > 0 else None,  # tokens/s
        "request_throughput": len(ok) / duration if duration > 0 else None,  # requests/s
        "ttft_s": summarize([r.ttft for r in ok]),
        "itl_s": summarize([g for r in ok for g in r.itl]),
        "tpot_s": summarize([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": summarize([r.e2e for r in ok]),
    }


def retry_stats(results: list[RequestResult]) -> dict:
    """Requests sent again because their pooled connection had been closed by the server while idle
    (:func:`stream_completion`): not failures, but counted, with the errors that were retried."""
    retried = [r.retried for r in results if r.retried is not None]
    return {"connection_retries": len(retried), "retried_errors": dict(Counter(retried).most_common())}


async def closed_loop(send, items: Iterator, c: int, deadline: float, outage: asyncio.Event, on_done, health,
                      results: list[RequestResult]) -> None:
    """``c`` clients, each awaiting ``send(item)`` for the next of ``items`` as soon as its previous one
    returned, appending to ``results``; they stop when ``items`` run out, at ``deadline``
    (``time.monotonic``) or once ``outage`` is set (a connection error the server's health confirms).

    Cancelled (Ctrl-C), it cancels the clients and returns once each has ended its current request: a
    client whose HTTP library turns the cancellation into an error (aiohttp's timeout can) starts no
    other, so the loop cannot run on to its deadline. A client that raises cancels the others."""
    stopping = asyncio.Event()

    async def client() -> None:
        while not stopping.is_set() and not outage.is_set() and time.monotonic() < deadline:
            item = next(items, None)
            if item is None:
                return
            res = await send(item)
            results.append(res)
            on_done(res)
            if res.connection_error and not await health():
                outage.set()

    tasks = [asyncio.ensure_future(client()) for _ in range(c)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        if not all(t.done() for t in tasks):  # cancelled, or a client raised
            stopping.set()
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)
    for t in tasks:
        if not t.cancelled():
            t.result()  # a client's exception


def write_json(path: Path, doc: dict) -> None:
    """Replace ``path`` whole (a reader never sees half a file); OSError names ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(f"could not write {path}: {e.strerror or e}") from None


async def resolve_model(session, base_url: str) -> str:
    """The first model ``/v1/models`` lists; raises BenchAborted saying why there is none."""
    where = f"{base_url}/v1/models"
    try:
        async with session.get(where, timeout=aiohttp.ClientTimeout(total=30)) as r:
            r.raise_for_status()
            doc = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise BenchAborted(f"could not list models at {where}: {type(e).__name__}: {e}") from None
    models = doc.get("data") if isinstance(doc, dict) else None
    if not models or not isinstance(models[0], dict) or not isinstance(models[0].get("id"), str):
        raise BenchAborted(f"{where} lists no model (answer: {str(doc)[:100]}); pass one with --model.")
    return models[0]["id"]


async def health(base_url: str, server_alive) -> bool:
    """Whether the server still answers, asked after a request's connection failed: on a fresh
    connection, so that a stale pooled one cannot make a live server look gone."""
    if server_alive is not None and not server_alive():
        return False
    try:
        async with fresh_session() as fresh, \
                fresh.get(f"{base_url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def run_bench_async(cfg: BenchConfig, prompts: list[Prompt], out: Path, meta: dict | None = None,
                          server_alive=None, progress: bool = True) -> dict:
    """Run every level of ``cfg`` and write the result JSON to ``out`` after each one.

    ``server_alive`` (a callable) tells whether a managed server process still runs. Raises
    BenchAborted, after writing the partial result, when the server stops answering.
    """
    base_url = cfg.base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    doc = {"version": RESULT_VERSION, "status": "running", "error": None,
           "config": {**{k: v for k, v in vars(cfg).items()}, **(meta or {})}, "levels": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)  # a path that cannot be written stops the run before it starts
    async with open_session() as session:
        alive = lambda: health(base_url, server_alive)
        send = lambda payload: stream_completion(session, url, payload, cfg.request_timeout)
        try:
            model = cfg.model or await resolve_model(session, base_url)
        except BenchAborted as e:
            doc.update(status="aborted", error=str(e))
            write_json(out, doc)
            raise
        doc["config"]["model"] = model
        prompt_index = 0

        def take(n: int) -> list[dict]:
            nonlocal prompt_index
            batch = [completion_payload(model, prompts[(prompt_index + i) % len(prompts)], cfg.output_len,
                                        cfg.ignore_eos) for i in range(n)]
            prompt_index += n
            return batch

        for i, c in enumerate(cfg.concurrencies):
            n, warmup = cfg.requests_for(c)
            outage = asyncio.Event()
            bar = tqdm(total=warmup + n * cfg.repeats, desc=f"C={c}", unit="req", disable=not progress, leave=True)
            failures = 0

            def on_done(res: RequestResult, bar=bar) -> None:
                nonlocal failures
                failures += not res.ok
                bar.update(1)
                if failures:
                    bar.set_postfix(failed=failures)

            warm: list[RequestResult] = []
            results: list[RequestResult] = []
            before = after = None
            kv = {"mean": None, "max": None, "num_samples": 0}
            measured_s, repeats = 0.0, []  # the measured runs' total time and each run's output tokens/s
            status = "ok"
            try:
                deadline = time.monotonic() + cfg.level_timeout
                await closed_loop(send, iter(take(warmup)), c, deadline, outage, on_done, alive, warm)
                if not outage.is_set():
                    before = await scrape(session, base_url)
                    sampler = KVUsageSampler(session, base_url, cfg.metrics_interval)
                    sampler.start()
                    try:
                        for _ in range(cfg.repeats):
                            if outage.is_set():
                                break
                            run: list[RequestResult] = []
                            t_run = time.perf_counter()
                            await closed_loop(send, iter(take(n)), c, deadline, outage, on_done, alive, run)
                            run_s = time.perf_counter() - t_run
                            measured_s += run_s
                            results += run
                            if not outage.is_set() and run_s > 0:  # a run cut short is not in the spread
                                repeats.append(sum(r.output_tokens for r in run if r.ok) / run_s)
                    finally:
                        kv = await sampler.stop()
                if not outage.is_set():
                    after = await scrape(session, base_url)
            except (asyncio.CancelledError, KeyboardInterrupt):
                status = "interrupted"
            finally:
                bar.close()
            status = "aborted" if outage.is_set() else status

            level = level_stats(c, n * cfg.repeats, results, measured_s)
            level["output_throughput_spread"] = throughput_spread(repeats)
            level["warmup"] = {"num_requests": warmup, "completed": sum(r.ok for r in warm),
                               "failed": sum(not r.ok for r in warm),
                               "connection_retries": retry_stats(warm)["connection_retries"]}
            level["spec_decode"] = spec_decode_delta(before, after)
            level["mean_acceptance_length"] = level["spec_decode"]["mean_acceptance_length"]
            level["kv_cache_usage"] = kv
            level["status"] = status
            doc["levels"].append(level)
            if status != "ok":
                errors = [r.error for r in warm + results if r.connection_error]
                doc["status"] = status
                doc["error"] = (f"interrupted during C={c}" if status == "interrupted" else
                                f"the server at {base_url} stopped answering during C={c} "
                                f"({errors[-1] if errors else 'no answer'})")
                doc["not_run_concurrencies"] = cfg.concurrencies[i + 1:]
                write_json(out, doc)
                if status == "interrupted":
                    raise KeyboardInterrupt
                raise BenchAborted(doc["error"])
            write_json(out, doc)
    doc["status"] = "ok"
    write_json(out, doc)
    return doc


def run_bench(cfg: BenchConfig, prompts: list[Prompt], out: Path, **kwargs) -> dict:
    return asyncio.run(run_bench_async(cfg, prompts, out, **kwargs))
