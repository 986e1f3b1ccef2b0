"""A `vllm serve` (or any server) command line run for the length of a benchmark."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServerError(RuntimeError):
    """The managed server did not come up, or went away."""


def url_from_command(command: str, default: str) -> str:
    """``http://host:port`` from ``--host``/``--port`` in a serve command line (vLLM's defaults:
    ``0.0.0.0``, i.e. reachable on loopback, and 8000), or ``default`` when neither is given."""
    argv = shlex.split(command)
    opts = {}
    for i, arg in enumerate(argv):
        for name in ("--host", "--port"):
            if arg == name and i + 1 < len(argv):
                opts[name] = argv[i + 1]
            elif arg.startswith(name + "="):
                opts[name] = arg.split("=", 1)[1]
    if not opts:
        return default
    host = opts.get("--host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{opts.get('--port', '8000')}"


def health_ok(base_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


KV_CAPACITY_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def kv_capacity_from_log(path: Path) -> int | None:
    """The KV-cache capacity in tokens a vLLM server logged at start (the last such line), or None."""
    try:
        found = KV_CAPACITY_LINE.findall(Path(path).read_text(errors="replace"))
    except OSError:
        return None
    return int(found[-1].replace(",", "")) if found else None


class ManagedServer:
    """Starts ``command`` in its own process group, waits for ``/health``, and always stops it.

    Use as a context manager; the process group is terminated (then killed) on exit, errors and
    KeyboardInterrupt included.
    """

    def __init__(self, command: str, base_url: str, log_path: Path, startup_timeout: float = 600.0,
                 env: dict[str, str] | None = None):
        self.argv = shlex.split(command)
        self.env = None if env is None else {**os.environ, **env}
        if not self.argv:
            raise ServerError("The --serve command line is empty; expected e.g. 'vllm serve MODEL'.")
        self.base_url, self.log_path, self.startup_timeout = base_url, Path(log_path), startup_timeout
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        except OSError as e:
            self._log.close()
            raise ServerError(f"Could not start {self.argv[0]!r}: {e}.") from None
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _wait_healthy(self) -> None:
        started = time.monotonic()
        deadline = started + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise ServerError(f"The server exited with code {self.proc.returncode} before it was healthy; "
                                  f"last log lines ({self.log_path}):\n{self.log_tail()}")
            if health_ok(self.base_url):
                self.startup_s = round(time.monotonic() - started, 1)
                return
            time.sleep(1.0)
        raise ServerError(f"The server did not answer {self.base_url}/health within {self.startup_timeout:g} s; "
                          f"last log lines ({self.log_path}):\n{self.log_tail()}")

    def facts(self) -> dict:
        """What the started server's log says of it: its KV-cache capacity in tokens (vLLM's
        ``GPU KV cache size: N tokens`` line, ``vllm.v1.core.kv_cache_utils``; None when absent), the
        seconds it took to answer ``/health``, and the log's name."""
        return {"kv_capacity_tokens": kv_capacity_from_log(self.log_path), "startup_s": self.startup_s,
                "log": self.log_path.name}

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is not None:
            # the whole group: vLLM's engine-core and worker processes outlive a dead API server
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if not self._log.closed:
            self._log.close()


def switch_server(base_url: str, options: dict, timeout: float = 120.0) -> list[dict]:
    """Set the length selector of every worker of a running server (``vllm_hybridspec.engine.length.control``) through
    vLLM's ``/collective_rpc``; returns each worker's answer. Raises :class:`ServerError` saying what is
    missing (the development endpoint, the worker extension) or the option the server refused."""
    from vllm_hybridspec.engine.length.control import CONFIGURE_METHOD, WORKER_EXTENSION

    body = json.dumps({"method": CONFIGURE_METHOD, "kwargs": {"options": json.dumps(options)}}).encode()
    request = urllib.request.Request(f"{base_url}/collective_rpc", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    hint = (f"start the server with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION} "
            "(--serve adds both when --switch is given)")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            answer = json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        if e.code == 404:
            raise ServerError(f"{base_url} has no /collective_rpc endpoint: {hint}.") from None
        raise ServerError(f"switching {options} failed: HTTP {e.code} from {base_url}/collective_rpc: {detail} "
                          f"(does the server have the worker extension? {hint})") from None
    except (urllib.error.URLError, OSError) as e:
        raise ServerError(f"switching {options} failed: {base_url}/collective_rpc unreachable: {e}") from None
    results = answer.get("results") if isinstance(answer, dict) else None
    if not results:
        raise ServerError(f"switching {options}: unexpected answer from {base_url}/collective_rpc: {answer!r}")
    for i, res in enumerate(results):
        if not isinstance(res, dict) or not res.get("ok"):
            error = res.get("error") if isinstance(res, dict) else res
            raise ServerError(f"the server refused switch options {options} (worker {i}): {error}")
    return results
