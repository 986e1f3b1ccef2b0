"""One streamed completion request, timed token by token."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

# A server that went away shows up as one of these; anything else is a failed request, not an outage.
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    connection_error: bool = False
    start: float = 0.0
    end: float = 0.0
    output_tokens: int = 0
    ttft: float | None = None
    # one entry per output token after the first: a chunk of k tokens that arrived g seconds after the
    # previous one adds k gaps of g / k, so speculative chunks count per token
    itl: list[float] = field(default_factory=list)

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (robust to chunks that arrive in bursts)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def completion_payload(model: str, prompt, output_len: int, ignore_eos: bool) -> dict:
    # ignore_eos and return_token_ids are vLLM extensions: a fixed output length, and exact token
    # counts per chunk (text chunks may hold several tokens, or none while detokenizing)
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos, "return_token_ids": True}


async def stream_completion(session: aiohttp.ClientSession, url: str, payload: dict,
                            timeout: float) -> RequestResult:
    """POST ``payload`` to ``url`` (``/v1/completions``) and read its SSE stream."""
    res = RequestResult(start=time.perf_counter())
    last = res.start
    usage_tokens = None
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                body = (await r.text())[:200].replace("\n", " ")
                res.error = f"HTTP {r.status}: {body}"
                return res
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"server error in stream: {str(chunk['error'])[:200]}"
                    return res
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                n = sum(_tokens_in(choice) for choice in chunk.get("choices") or [])
                if n == 0:
                    continue
                now = time.perf_counter()
                if res.output_tokens == 0:
                    res.ttft = now - res.start
                    res.itl.extend([0.0] * (n - 1))  # tokens of the first chunk arrive together
                else:
                    res.itl.extend([(now - last) / n] * n)
                res.output_tokens += n
                last = now
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g} s"
        return res
    except CONNECTION_ERRORS as e:
        res.error = f"{type(e).__name__}: {e}"
        res.connection_error = True
        return res
    finally:
        res.end = time.perf_counter()
    if usage_tokens is not None:
        res.output_tokens = usage_tokens
    res.ok = res.output_tokens > 0
    if not res.ok:
        res.error = "the stream ended without output tokens"
    return res


def _tokens_in(choice: dict) -> int:
    if choice.get("token_ids") is not None:
        return len(choice["token_ids"])
    return 1 if choice.get("text") else 0  # servers without return_token_ids: one token per chunk
