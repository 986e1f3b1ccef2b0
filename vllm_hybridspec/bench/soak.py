"""`hybridspec soak`: a closed loop against a server for a set time, with a share of clients that go
away mid-stream, then the checks a long-running speculative server has to pass:

- ``no_failed_requests``: every request the server was sent was answered (a client of ours closing a
  stream on purpose is not a failure; a stale pooled connection retried on a fresh one is not either,
  and both are counted);
- ``kv_cache_idle``: once idle, the server's KV-cache usage (``vllm:kv_cache_usage_perc``) is back to
  0 within a bounded wait, so neither finished nor aborted requests leaked blocks;
- ``probe_outputs_unchanged``: the greedy outputs of a fixed probe set are the same after the soak
  as before it, so no state (drafter, GDN/SSM state, KV) carried over between requests.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vllm_hybridspec.bench.client import RequestResult, completion_payload, open_session, stream_completion
from vllm_hybridspec.bench.loadgen import (BenchAborted, closed_loop, health, level_stats, resolve_model,
                                           retry_stats, write_json)
from vllm_hybridspec.bench.metrics import KV_USAGE, KVUsageSampler, scrape
from vllm_hybridspec.bench.prompts import Prompt

SOAK_VERSION = 1
CHECKS = ("no_failed_requests", "kv_cache_idle", "probe_outputs_unchanged")


@dataclass
class SoakConfig:
    base_url: str
    duration: float  # seconds during which new requests are sent (those in flight then finish)
    concurrency: int = 16
    disconnect_share: float = 0.2  # share of requests whose client closes the connection mid-stream
    disconnect_after: int = 8  # tokens such a client reads first
    output_len: int = 64  # tokens of every other request (EOS ignored)
    num_probes: int = 4  # the first prompts, decoded greedily one at a time before and after
    probe_tokens: int = 32
    idle_timeout: float = 60.0  # seconds the KV-cache usage gets to return to 0 once idle
    model: str | None = None
    request_timeout: float = 600.0
    metrics_interval: float = 1.0
    seed: int = 0  # which requests disconnect
    label: str = ""


async def run_probes(send, model: str, prompts: list[Prompt], max_tokens: int, desc: str,
                     progress: bool) -> list[RequestResult]:
    """The probe prompts one at a time: the batch each is decoded in is the same before and after."""
    results = []
    for prompt in tqdm(prompts, desc=desc, unit="req", disable=not progress, leave=False):
        results.append(await send((completion_payload(model, prompt, max_tokens, True), None)))
    return results


def compare_probes(before: list[RequestResult], after: list[RequestResult]) -> tuple[list[int], str]:
    """The indices of probes whose output changed (or that failed), and a sentence on the first one."""
    changed, first = [], ""
    for i, (b, a) in enumerate(zip(before, after)):
        if b.ok and a.ok and (b.token_ids, b.text) == (a.token_ids, a.text):
            continue
        changed.append(i)
        if first:
            continue
        if not (b.ok and a.ok):
            first = f"probe {i} failed {'before' if not b.ok else 'after'} the soak: {(b.error or a.error)}"
        else:
            j = next((k for k, (x, y) in enumerate(zip(b.token_ids, a.token_ids)) if x != y),
                     min(len(b.token_ids), len(a.token_ids)))
            first = (f"probe {i} changed at token {j}: before {b.token_ids[j:j + 4]}, after {a.token_ids[j:j + 4]}"
                     if b.token_ids or a.token_ids else f"probe {i} changed: before {b.text!r}, after {a.text!r}")
    return changed, first


async def wait_kv_idle(session, base_url: str, timeout: float, interval: float) -> dict:
    """Scrape the KV-cache usage until it reads 0 or ``timeout`` seconds passed. vLLM publishes the
    gauge only after an engine step, so this runs after the closing probes: their last step comes
    after every aborted request was freed."""
    start = time.monotonic()
    samples: list[float] = []
    while True:
        values = await scrape(session, base_url)
        waited = time.monotonic() - start
        if values and KV_USAGE in values:
            samples.append(values[KV_USAGE])
            if samples[-1] <= 0.0:
                return {"final": samples[-1], "drained_after_s": waited, "num_samples": len(samples)}
        if waited >= timeout:
            return {"final": samples[-1] if samples else None, "drained_after_s": None, "num_samples": len(samples)}
        await asyncio.sleep(interval)


def _checks(cfg: SoakConfig, soak: dict, probes_failed: int, idle: dict, changed: list[int],
            first_change: str) -> dict:
    failed = soak["failed"] + probes_failed
    sent = soak["requests"] + 2 * cfg.num_probes
    errors = "; ".join(f"{n} x {e}" for e, n in soak["errors"].items())
    requests = (f"{failed} of {sent} requests failed" + (f" ({errors})" if errors else "")
                + f"; {soak['disconnected']} closed by our clients on purpose, "
                f"{soak['connection_retries']} stale connections retried")
    if idle["drained_after_s"] is not None:
        kv = f"KV-cache usage 0 after {idle['drained_after_s']:.1f} s idle"
    elif idle["final"] is None:
        kv = f"the server exposes no {KV_USAGE} at /metrics"
    else:
        kv = f"KV-cache usage still {idle['final']:.2%} after {cfg.idle_timeout:g} s idle"
    probes = (f"{cfg.num_probes} probes of {cfg.probe_tokens} tokens unchanged" if not changed else
              f"{len(changed)} of {cfg.num_probes} probes changed or failed: {first_change}")
    return {"no_failed_requests": {"passed": failed == 0, "detail": requests},
            "kv_cache_idle": {"passed": idle["drained_after_s"] is not None, "detail": kv},
            "probe_outputs_unchanged": {"passed": not changed, "detail": probes}}


async def _soak(send, alive, session, base_url: str, model: str, prompts: list[Prompt], cfg: SoakConfig,
                progress: bool) -> tuple[dict, dict, str | None]:
    """The closed loop for ``cfg.duration`` seconds: the soak's numbers, the KV usage during it, and
    the last connection error if the server stopped answering (else None)."""
    rng = random.Random(cfg.seed)
    planned = 0

    def items():
        nonlocal planned
        for i in itertools.count():
            cut = rng.random() < cfg.disconnect_share
            planned += cut
            yield (completion_payload(model, prompts[i % len(prompts)], cfg.output_len, True),
                   cfg.disconnect_after if cut else None)

    results: list[RequestResult] = []
    bar = tqdm(total=round(cfg.duration), desc="soak", disable=not progress,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s{postfix}")
    start = time.monotonic()

    counts = {"done": 0, "cut": 0, "failed": 0}  # running counts: a long soak sends many requests

    def on_done(res: RequestResult) -> None:
        counts["done"] += 1
        counts["cut"] += res.disconnected
        counts["failed"] += not res.ok
        bar.update(min(round(time.monotonic() - start), bar.total) - bar.n)
        bar.set_postfix(counts, refresh=False)

    outage = asyncio.Event()
    sampler = KVUsageSampler(session, base_url, cfg.metrics_interval)
    sampler.start()
    try:
        await closed_loop(send, items(), cfg.concurrency, start + cfg.duration, outage, on_done, alive, results)
    finally:
        kv_during = await sampler.stop()
        bar.close()
    measured = [r for r in results if not r.disconnected]  # latencies over requests read to the end
    soak = {**level_stats(cfg.concurrency, len(measured), measured, time.monotonic() - start),
            **retry_stats(results), "requests": len(results), "disconnect_planned": planned,
            "disconnected": sum(r.disconnected for r in results)}
    errors = [r.error for r in results if r.connection_error]
    return soak, kv_during, (errors[-1] if errors else "no answer") if outage.is_set() else None


async def run_soak_async(cfg: SoakConfig, prompts: list[Prompt], out: Path, meta: dict | None = None,
                         server_alive=None, progress: bool = True) -> dict:
    """Probes, the soak, probes again, the idle KV gauge; writes ``out`` (also at the start and after
    the soak) and returns it. Raises BenchAborted when the server stops answering and
    KeyboardInterrupt on Ctrl-C, after writing what was measured."""
    base_url = cfg.base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    doc = {"version": SOAK_VERSION, "kind": "soak", "status": "running", "error": None, "failed_checks": [],
           "checks": {}, "config": {**vars(cfg), **(meta or {})}}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)

    def stopped(status: str, message: str) -> None:
        doc.update(status=status, error=message)
        write_json(out, doc)

    async with open_session() as session:
        alive = lambda: health(base_url, server_alive)
        send = lambda item: stream_completion(session, url, item[0], cfg.request_timeout, disconnect_after=item[1])
        probe_prompts = prompts[:cfg.num_probes]

        async def probes(model: str, when: str) -> list[RequestResult]:
            rs = await run_probes(send, model, probe_prompts, cfg.probe_tokens, f"probes {when}", progress)
            if any(r.connection_error for r in rs) and not await alive():
                raise BenchAborted(f"the server at {base_url} stopped answering during the probes {when} the soak")
            return rs

        try:
            model = doc["config"]["model"] = cfg.model or await resolve_model(session, base_url)
            before = await probes(model, "before")
            soak, kv_during, outage = await _soak(send, alive, session, base_url, model, prompts, cfg, progress)
            doc.update(soak=soak, kv_cache_usage={"during": kv_during})
            write_json(out, doc)
            if outage:
                raise BenchAborted(f"the server at {base_url} stopped answering during the soak ({outage})")
            after = await probes(model, "after")
            idle = await wait_kv_idle(session, base_url, cfg.idle_timeout, min(cfg.metrics_interval, 0.5))
        except BenchAborted as e:
            stopped("aborted", str(e))
            raise
        except (asyncio.CancelledError, KeyboardInterrupt):
            stopped("interrupted", "interrupted")
            raise KeyboardInterrupt from None
    changed, first_change = compare_probes(before, after)
    doc["kv_cache_usage"]["idle"] = {**idle, "timeout_s": cfg.idle_timeout}
    doc["probes"] = {"num_prompts": len(probe_prompts), "max_tokens": cfg.probe_tokens, "changed": changed,
                     **retry_stats(before + after),
                     **{when: [{"token_ids": r.token_ids, "text": r.text, "error": r.error} for r in rs]
                        for when, rs in (("before", before), ("after", after))}}
    probes_failed = sum(not r.ok for r in before + after)
    doc["checks"] = _checks(cfg, soak, probes_failed, idle, changed, first_change)
    doc["failed_checks"] = [name for name in CHECKS if not doc["checks"][name]["passed"]]
    doc["status"] = "failed" if doc["failed_checks"] else "passed"
    write_json(out, doc)
    return doc


def run_soak(cfg: SoakConfig, prompts: list[Prompt], out: Path, **kwargs) -> dict:
    return asyncio.run(run_soak_async(cfg, prompts, out, **kwargs))
