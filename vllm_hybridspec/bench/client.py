"""One streamed completion request, timed token by token."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp

# A server that went away shows up as one of these; anything else is a failed request, not an outage.
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)
# What a pooled connection that the server closed while it sat idle gives before any response byte
STALE_CONNECTION_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                           aiohttp.ClientConnectionResetError)


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
    token_ids: list[int] = field(default_factory=list)  # as streamed (servers without return_token_ids: none)
    text: str = ""
    retried: str | None = None  # the error of a stale pooled connection, retried once on a fresh one
    disconnected: bool = False  # our client closed the stream on purpose (``disconnect_after``)

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


def open_session() -> aiohttp.ClientSession:
    """The session every request of a run goes through: unlimited connections, and a trace that tells
    :func:`stream_completion` whether a request went out on a pooled connection (the only kind that
    can have been closed by the server's keep-alive timer while it sat in the pool)."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_mark_reused)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trace_configs=[trace])


def fresh_session() -> aiohttp.ClientSession:
    """A session whose every request opens a new connection (and closes it after)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def _mark_reused(session, ctx, params) -> None:
    if ctx.trace_request_ctx is not None:
        ctx.trace_request_ctx.reused = True


async def stream_completion(session: aiohttp.ClientSession, url: str, payload: dict, timeout: float,
                            disconnect_after: int | None = None) -> RequestResult:
    """POST ``payload`` to ``url`` (``/v1/completions``) and read its SSE stream.

    A request that fails before any response byte on a pooled connection (the server closed it after
    its keep-alive, 5 s in uvicorn, while aiohttp keeps idle connections 15 s) never reached the
    server; it is sent once more on a fresh connection and counted in ``retried``. An error on a fresh
    connection, or after the response began, fails the request. ``disconnect_after``: close the
    connection once that many tokens arrived, as a client that goes away mid-stream.
    """
    res = RequestResult(start=time.perf_counter())
    trace = SimpleNamespace(reused=False, responded=False)
    try:
        try:
            await _read(session, url, payload, timeout, disconnect_after, res, trace)
        except STALE_CONNECTION_ERRORS as e:
            if not trace.reused or trace.responded:
                raise
            res.retried = f"{type(e).__name__}: {e}"
            left = max(timeout - (time.perf_counter() - res.start), 1e-3)
            async with fresh_session() as fresh:
                await _read(fresh, url, payload, left, disconnect_after, res, trace)
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g} s"
    except CONNECTION_ERRORS as e:
        res.error = f"{type(e).__name__}: {e}"
        res.connection_error = True
    except ValueError as e:
        res.error = f"the server sent a malformed stream (expected SSE lines of JSON objects): {str(e)[:200]}"
    finally:
        res.end = time.perf_counter()
    if res.error is None and not res.ok:
        res.error = "the stream ended without output tokens"
    return res


async def _read(session, url: str, payload: dict, timeout: float, disconnect_after: int | None,
                res: RequestResult, trace: SimpleNamespace) -> None:
    """One attempt; fills ``res`` (``ok`` and ``error``) and raises what the connection raised."""
    last = res.start
    usage_tokens = None
    async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout),
                            trace_request_ctx=trace) as r:
        trace.responded = True
        if r.status != 200:
            body = (await r.text())[:200].replace("\n", " ")
            res.error = f"HTTP {r.status}: {body}"
            return
        async for raw in r.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError(data)
            if "error" in chunk:
                res.error = f"server error in stream: {str(chunk['error'])[:200]}"
                return
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            n = 0
            for choice in chunk.get("choices") or []:
                n += _tokens_in(choice)
                res.token_ids.extend(choice.get("token_ids") or [])
                res.text += choice.get("text") or ""
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
            if disconnect_after is not None and res.output_tokens >= disconnect_after:
                r.close()  # the connection too: the server sees its client go away
                res.disconnected = res.ok = True
                return
    if usage_tokens is not None:
        res.output_tokens = usage_tokens
    res.ok = res.output_tokens > 0


def _tokens_in(choice: dict) -> int:
    if choice.get("token_ids") is not None:
        return len(choice["token_ids"])
    return 1 if choice.get("text") else 0  # servers without return_token_ids: one token per chunk
