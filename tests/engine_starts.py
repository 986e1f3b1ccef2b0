"""Counts the vLLM engines that the engine tests start, in every process, against the committed budget
``tests/engine_budget.json`` (issue 31: the suite's time is guarded by counting engine starts, not by
timing them).

An engine start is one ``EngineCore._initialize_kv_caches`` call: every engine core makes exactly one,
in-process (``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or in an engine-core process (an
OpenAI server, tensor parallelism, a tool's child process). The count is made by a vLLM general plugin
that :func:`install` puts on the path of this process and of every child it starts (a ``.dist-info``
with its entry point beside a copy of this file, on ``PYTHONPATH``), since vLLM loads general plugins in
each process that builds an engine before it initialises the KV cache. Each start appends one line,
the test that was running (``PYTEST_CURRENT_TEST``, which child processes inherit), to the file named
by ``HYBRIDSPEC_TEST_ENGINE_STARTS``; ``scripts/test_suite.py`` sets one file for the whole suite and
prints its totals.

An engine started under ``HYBRIDSPEC_TEST_DIAGNOSTIC_ENGINE=1`` (:func:`diagnostic`) is recorded as a
diagnostic and left out of the budget: the identity check's routing-margin engine starts only where a
draw happens to put a router tie in a prompt, so a fixed budget cannot hold it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

ENV = "HYBRIDSPEC_TEST_ENGINE_STARTS"
DIAGNOSTIC_ENV = "HYBRIDSPEC_TEST_DIAGNOSTIC_ENGINE"
PLUGIN = "hybridspec_test_engine_starts"
BUDGET = Path(__file__).with_name("engine_budget.json")


def register() -> None:
    """The vLLM general plugin: count each engine core's KV-cache initialisation (once per engine)."""
    path = os.environ.get(ENV)
    if not path:
        return
    from vllm.v1.engine.core import EngineCore

    original = EngineCore._initialize_kv_caches
    if getattr(original, "counts_engine_starts", False):
        return

    def initialize_kv_caches(self, *args, **kwargs):
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "pid": os.getpid(),
                                "diagnostic": os.environ.get(DIAGNOSTIC_ENV) == "1"}) + "\n")
        return original(self, *args, **kwargs)

    initialize_kv_caches.counts_engine_starts = True
    EngineCore._initialize_kv_caches = initialize_kv_caches


def install() -> Path:
    """Make every engine started from now on, in this process or a child, count itself; returns the
    file the starts go to (``$HYBRIDSPEC_TEST_ENGINE_STARTS`` if set, else a new one)."""
    import sys

    if os.environ.get(ENV):
        log = Path(os.environ[ENV])
    else:
        log = Path(tempfile.mkdtemp(prefix="engine-starts-")) / "starts.jsonl"
        os.environ[ENV] = str(log)
    site = Path(tempfile.mkdtemp(prefix="engine-starts-site-"))
    shutil.copy(__file__, site / f"{PLUGIN}.py")
    info = site / f"{PLUGIN}-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = {PLUGIN}:register\n")
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return log


def starts(log: Path, prefix: str = "", diagnostic: bool = False) -> int:
    """The engine starts recorded in ``log`` by tests whose node id begins with ``prefix``: the
    budgeted ones, or (``diagnostic=True``) the diagnostic ones."""
    if not log.exists():
        return 0
    records = [json.loads(line) for line in log.read_text().splitlines() if line]
    return sum(r["test"].startswith(prefix) and r.get("diagnostic", False) == diagnostic for r in records)


@contextlib.contextmanager
def diagnostic():
    """Engines started inside are recorded as diagnostics, outside the budget."""
    before = os.environ.get(DIAGNOSTIC_ENV)
    os.environ[DIAGNOSTIC_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DIAGNOSTIC_ENV, None)
        else:
            os.environ[DIAGNOSTIC_ENV] = before


def budget() -> dict[str, int]:
    """``{test file relative to the repository: the most engines it may start}``."""
    return {k: v for k, v in json.loads(BUDGET.read_text()).items() if not k.startswith("_")}


def check_module(log: Path, module_nodeid: str) -> None:
    """The engine starts of one test file against its budget (called when the file's tests are done)."""
    used = starts(log, module_nodeid + "::")
    allowed = budget().get(module_nodeid)
    if allowed is None:
        assert used == 0, (f"{module_nodeid} started {used} engine(s) and has no line in {BUDGET.name}: "
                           f"add one (an engine start costs CI from a few seconds for a tiny model to a minute for a server)")
        return
    assert used <= allowed, (f"{module_nodeid} started {used} engines, over its budget of {allowed} in "
                             f"{BUDGET.name}: share an engine (a module-scoped fixture) before raising it")
