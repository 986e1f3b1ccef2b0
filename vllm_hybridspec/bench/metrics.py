"""The server's Prometheus counters and gauges that the benchmark reports (vLLM names, v0.26:
``vllm/v1/spec_decode/metrics.py`` and ``vllm/v1/metrics/loggers.py``)."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
KV_USAGE = "vllm:kv_cache_usage_perc"  # a gauge in [0, 1]
WANTED = (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, KV_USAGE)


def parse_metrics(text: str) -> dict[str, float]:
    """The wanted samples over their labels (engines): counters summed, the KV-usage gauge (a
    fraction per engine) averaged; absent ones are left out."""
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WANTED:
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
                counts[sample.name] = counts.get(sample.name, 0) + 1
    if KV_USAGE in values:
        values[KV_USAGE] /= counts[KV_USAGE]
    return values


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    """One scrape of ``/metrics``; None when the server has no such endpoint or does not answer."""
    try:
        async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            return parse_metrics(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def spec_decode_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """Mean acceptance length (accepted tokens per draft, plus the bonus token) and acceptance rate
    between two scrapes; None without speculation (the counters are absent) or without drafts."""
    out = {"num_drafts": None, "num_draft_tokens": None, "num_accepted_tokens": None,
           "mean_acceptance_length": None, "acceptance_rate": None}
    if not before or not after or any(k not in before or k not in after
                                       for k in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED)):
        return out
    drafts = after[SPEC_DRAFTS] - before[SPEC_DRAFTS]
    draft_tokens = after[SPEC_DRAFT_TOKENS] - before[SPEC_DRAFT_TOKENS]
    accepted = after[SPEC_ACCEPTED] - before[SPEC_ACCEPTED]
    out.update(num_drafts=int(drafts), num_draft_tokens=int(draft_tokens), num_accepted_tokens=int(accepted))
    if drafts > 0:
        out["mean_acceptance_length"] = 1.0 + accepted / drafts
    if draft_tokens > 0:
        out["acceptance_rate"] = accepted / draft_tokens
    return out


class KVUsageSampler:
    """Samples the KV-cache usage gauge every ``interval`` seconds while a level runs.

    :meth:`stop` ends the loop through a flag as well as by cancelling it: a cancellation that arrives
    inside a scrape can come out of aiohttp's timeout as an ordinary ``TimeoutError``, which ``scrape``
    reports as no answer, and a loop that only waited for its cancellation then ran on, leaving a soak
    that got Ctrl-C hanging in ``stop``."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval: float):
        self.session, self.base_url, self.interval = session, base_url, interval
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def _loop(self) -> None:
        while not self._stopping:
            values = await scrape(self.session, self.base_url)
            if values and KV_USAGE in values:
                self.samples.append(values[KV_USAGE])
            if not self._stopping:
                await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if not self.samples:
            return {"mean": None, "max": None, "num_samples": 0}
        return {"mean": sum(self.samples) / len(self.samples), "max": max(self.samples),
                "num_samples": len(self.samples)}
