"""A stand-in for `vllm serve` on loopback: streamed `/v1/completions` (SSE, chunked), `/health`,
`/v1/models` and a `/metrics` KV-usage gauge, with the faults the benchmark must tell apart switched
on per test. It runs its own event loop in a thread, so the code under test can call `asyncio.run`.

Each request's output is a function of its prompt (greedy-like), and each running request holds
one of ``KV_BLOCKS`` KV blocks until it finishes or its client goes away.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

KV_BLOCKS = 64  # each running request holds one


@dataclass
class Faults:
    # a request arriving on a connection idle for longer than this is dropped unanswered, with a reset:
    # what uvicorn does when its keep-alive timer fires while the next request is already on the wire
    # (its loop runs the timer before it reads the socket; on a busy CPU that window is wide)
    keepalive: float | None = None
    fail_mid_stream_every: int = 0  # every n-th completion: two chunks, then the connection is cut
    drop_every: int = 0  # every n-th completion: dropped unanswered, whatever the connection
    http_500_at: int | None = None  # this completion (counting from 1) is answered with HTTP 500
    leak_on_disconnect: bool = False  # a request whose client went away keeps its KV blocks
    change_output_from: int | None = None  # from this completion on, the third token is another one


class StubServer:
    def __init__(self, faults: Faults | None = None, token_delay: float = 0.01):
        self.faults = faults or Faults()
        self.token_delay = token_delay
        self.completions = 0  # completion requests read
        self.stale_drops = 0  # completion requests dropped by the keep-alive rule
        # each completion request in the order read: "dropped" (by the keep-alive rule) or "answered"
        self.completion_log: list[str] = []
        self.connections = 0
        self.disconnects = 0  # streams whose client went away
        self.finished = 0  # streams sent to the end
        self.kv_blocks = 0  # held by running (or leaked) requests
        self._open: dict[asyncio.Task, asyncio.StreamWriter] = {}  # connection handlers
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stop_lock = threading.Lock()

    def __enter__(self) -> StubServer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, "127.0.0.1", 0), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop_after(self, finished: int) -> None:
        """Stop (from another thread) once ``finished`` streams were sent to the end: mid-run, however
        slowly the machine runs the test."""
        def wait_and_stop():
            while self.finished < finished and self._thread.is_alive():
                time.sleep(0.01)
            self.stop()

        threading.Thread(target=wait_and_stop, daemon=True).start()

    def stop(self) -> None:
        """Close the listening socket and every connection, as a server process that died."""
        with self._stop_lock:  # once, whichever thread comes first
            if self._thread.is_alive():
                self._stop()

    def _stop(self) -> None:
        async def stop():
            self._server.close()
            for writer in self._open.values():
                writer.transport.abort()
            if self._open:  # each handler ends as for a client that went away
                await asyncio.wait(list(self._open), timeout=5)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @staticmethod
    def tokens_for(prompt, n: int) -> list[int]:
        seed = sum(prompt) if isinstance(prompt, list) else len(prompt)
        return [(seed + 7 * i) % 90 for i in range(n)]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._open[asyncio.current_task()] = writer
        idle_since = None  # None: a fresh connection
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if (self.faults.keepalive is not None and idle_since is not None
                        and time.monotonic() - idle_since > self.faults.keepalive):
                    if path == "/v1/completions":
                        self.stale_drops += 1
                        self.completion_log.append("dropped")
                    writer.transport.abort()
                    return
                if not await self._answer(method, path, body, reader, writer):
                    return
                idle_since = time.monotonic()
        finally:
            writer.transport.abort()
            self._open.pop(asyncio.current_task(), None)

    async def _answer(self, method, path, body, reader, writer) -> bool:
        """Answer one request; False when the connection is gone."""
        if method == "GET" and path == "/health":
            return await _send(writer, 200, "text/plain", b"")
        if method == "GET" and path == "/v1/models":
            return await _send(writer, 200, "application/json", json.dumps({"data": [{"id": "stub"}]}).encode())
        if method == "GET" and path == "/metrics":
            text = ("# TYPE vllm:kv_cache_usage_perc gauge\n"
                    f'vllm:kv_cache_usage_perc{{engine="0",model_name="stub"}} {self.kv_blocks / KV_BLOCKS}\n')
            return await _send(writer, 200, "text/plain", text.encode())
        if method == "POST" and path == "/v1/completions":
            self.completions += 1
            self.completion_log.append("answered")
            return await self._complete(json.loads(body), self.completions, reader, writer)
        return await _send(writer, 404, "text/plain", b"not found")

    async def _complete(self, req: dict, number: int, reader, writer) -> bool:
        f = self.faults
        if f.drop_every and number % f.drop_every == 0:
            writer.transport.abort()
            return False
        if f.http_500_at == number:
            return await _send(writer, 500, "application/json", b'{"error": "stub: internal error"}')
        tokens = self.tokens_for(req["prompt"], req["max_tokens"])
        if f.change_output_from is not None and number >= f.change_output_from and len(tokens) > 2:
            tokens[2] = (tokens[2] + 1) % 90
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.kv_blocks += 1
        release = True
        try:
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.token_delay)
                if reader.at_eof() or writer.is_closing():
                    self.disconnects += 1
                    release = not f.leak_on_disconnect
                    return False
                if f.fail_mid_stream_every and number % f.fail_mid_stream_every == 0 and i == 2:
                    writer.transport.abort()
                    return False
                _event(writer, {"choices": [{"index": 0, "text": f" t{token}", "token_ids": [token]}]})
                await writer.drain()
            _event(writer, {"choices": [], "usage": {"completion_tokens": len(tokens)}})
            # the last event and the end of the chunked body in one write, as one segment: a client that
            # stops reading at [DONE] then finds the body complete and pools the connection. Written apart,
            # a busy machine lets the client read [DONE] first, and aiohttp closes a connection released
            # with its body unfinished (which left fewer pooled connections for the keep-alive to drop)
            writer.write(_chunk_bytes(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            self.finished += 1
            return True
        except ConnectionError:
            self.disconnects += 1
            release = not f.leak_on_disconnect
            return False
        finally:
            if release:
                self.kv_blocks -= 1


def _event(writer: asyncio.StreamWriter, doc: dict) -> None:
    _chunk(writer, f"data: {json.dumps(doc)}\n\n".encode())


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(_chunk_bytes(data))


def _chunk_bytes(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _send(writer: asyncio.StreamWriter, status: int, content_type: str, body: bytes) -> bool:
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        await writer.drain()
    except ConnectionError:
        return False
    return True
