"""`make test`: the whole suite on a CPU machine, in as little wall time as its cores and memory allow.

Part 1, everything but ``tests/serving``, runs in one pytest under pytest-xdist (``-n JOBS``) with
Triton's interpreter on. Part 2 runs each ``tests/serving/test_*.py`` in a pytest process of its own
(engines leave process-wide state behind; the Makefile says why), up to JOBS files at a time, the
longest first (their last measured seconds in ``tests/engine_budget.json``), each file's output printed
whole when it ends, followed by its wall time and the peak resident memory of its process tree. With
more than one job each process runs one OpenMP thread: two processes of two threads on two cores stall
at every OpenMP barrier.

Part 2 is memory-aware: a file starts beside a running one only when ``/proc/meminfo``'s MemAvailable
covers the file's last measured peak (``_peak_gib`` in ``tests/engine_budget.json``; an unknown file
counts as the largest known, this run's included), what the running files may still grow to their own peaks, and a margin
(``--margin-gib``, 3 by default); otherwise it waits, and a smaller file that fits may go first. A
file with nothing beside it always starts, so with ``--jobs 1`` the files run strictly one at a time.

At the end: each part's and the suite's wall time, each engine file's wall time and peak memory, the
ten slowest tests (setup, call and teardown, from each pytest's JUnit XML), every file's engine starts
against its budget, and one closing line of the counts. Exits non-zero when any pytest did.
``--record`` writes the engine files' measured seconds and peaks into ``tests/engine_budget.json``.

    python scripts/test_suite.py                       # the suite, as `make test` runs it
    python scripts/test_suite.py --part engine tests/serving/test_selection.py tests/serving/test_config_at_engine_start.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import engine_starts  # noqa: E402


def env(jobs: int, **extra: str) -> dict[str, str]:
    out = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", **extra}
    if jobs > 1:
        out.setdefault("OMP_NUM_THREADS", "1")
    return out


def part1(jobs: int, junit: Path) -> tuple[int, float]:
    """Everything but tests/serving in one pytest (under xdist with more than one job): exit, peak GiB."""
    args = [sys.executable, "-m", "pytest", "-q", "--durations=15", f"--junitxml={junit / 'part1.xml'}",
            "tests", "--ignore=tests/serving"]
    if jobs > 1:
        args[3:3] = ["-n", str(jobs)]
    run = Running(args, env(jobs, TRITON_INTERPRET="1"))
    return run.wait(), run.peak / GIB


GIB = 1 << 30
UNKNOWN_PEAK_GIB = 10.0  # a file's peak when no file's is known yet (two engine files once took about 17 GB)
PAGE = os.sysconf("SC_PAGE_SIZE")


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes: what can be allocated without swapping."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def tree_rss(root: int) -> int:
    """The resident memory of ``root`` and every process below it, in bytes (shared pages count in
    each process that maps them: an upper bound, which is the safe side for admission)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except OSError:
            pass
    return total


class Running:
    """One pytest process and the peak of its process tree's resident memory, sampled every second."""

    def __init__(self, args: list[str], environ: dict[str, str], log: Path | None = None):
        self.began = time.monotonic()
        self.out = log.open("w") if log else None
        self.proc = subprocess.Popen(args, cwd=ROOT, env=environ, stdout=self.out or None,
                                     stderr=subprocess.STDOUT if self.out else None, text=True)
        self.rss = self.peak = 0
        self.wall = 0.0

    def poll(self) -> int | None:
        self.rss = tree_rss(self.proc.pid)
        self.peak = max(self.peak, self.rss)
        rc = self.proc.poll()
        if rc is not None:
            self.wall = time.monotonic() - self.began
            if self.out:
                self.out.close()
        return rc

    def wait(self) -> int:
        while (rc := self.poll()) is None:
            time.sleep(1)
        return rc


def peaks_known() -> dict[str, float]:
    """Each engine file's last measured peak resident memory (GiB) from ``tests/engine_budget.json``."""
    return json.loads(engine_starts.BUDGET.read_text()).get("_peak_gib", {})


def part2(files: list[str], jobs: int, junit: Path, margin_gib: float) -> tuple[int, dict[str, tuple[float, float]]]:
    """The engine files, ``jobs`` at a time at most, the longest first. A file starts beside others only
    when ``MemAvailable`` covers its own peak (its last measured one; unknown: the largest known), what
    the running files may still grow to their peaks, and ``margin_gib``; otherwise it waits for memory
    (another file ending, or other work on the machine) and the next file that fits may go first.
    With nothing running a file always starts: with ``jobs`` = 1 the files run strictly one at a time."""
    budget = json.loads(engine_starts.BUDGET.read_text())
    seconds, peaks = budget["_seconds"], peaks_known()

    def need(f: str) -> float:  # bytes; peaks measured in this run count as soon as a file ends
        return peaks.get(Path(f).name, max(peaks.values(), default=UNKNOWN_PEAK_GIB)) * GIB

    waiting = sorted(files, key=lambda f: -seconds.get(Path(f).name, 1e9))  # unknown files first
    running: dict[str, Running] = {}
    logs = Path(tempfile.mkdtemp(prefix="engine-files-"))
    status, results, said = 0, {}, None
    while waiting or running:
        for path, run in list(running.items()):
            rc = run.poll()
            if rc is None:
                continue
            del running[path]
            print(f"== {path}\n{(logs / (Path(path).stem + '.log')).read_text()}"
                  f"== {path}: {run.wall:.0f} s, peak {run.peak / GIB:.1f} GiB, exit {rc}", flush=True)
            status = status or rc
            results[path] = (run.wall, run.peak / GIB)
            peaks[Path(path).name] = run.peak / GIB
        if waiting and len(running) < jobs:
            growth = sum(max(0.0, need(p) - r.rss) for p, r in running.items())
            room = mem_available() - growth - margin_gib * GIB
            fits = [f for f in waiting if not running or need(f) <= room]
            if fits:
                path = fits[0]
                waiting.remove(path)
                running[path] = Running([sys.executable, "-m", "pytest", "-q", "--durations=5",
                                         f"--junitxml={junit / (Path(path).stem + '.xml')}", path],
                                        env(jobs), logs / (Path(path).stem + ".log"))
                print(f"== started {path} ({len(running)} running, {mem_available() / GIB:.1f} GiB available)",
                      flush=True)
                said = None
                continue
            if said != (waiting[0], len(running)):
                print(f"== waiting for memory: {waiting[0]} needs {need(waiting[0]) / GIB:.1f} GiB + "
                      f"{margin_gib:g} GiB margin, {room / GIB + margin_gib:.1f} GiB left beside "
                      f"{', '.join(running)}", flush=True)
                said = (waiting[0], len(running))
        time.sleep(1)
    return status, results


def junit_cases(junit: Path) -> list[tuple[float, str, str]]:
    """``(seconds, node id, outcome)`` of every test case in the JUnit files."""
    cases = []
    for xml in sorted(junit.glob("*.xml")):
        for case in ET.parse(xml).iter("testcase"):
            outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            name = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            cases.append((float(case.get("time", 0)), name, outcome))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="pytest-xdist workers in part 1, engine files at once in part 2 (default: min(2, cores))")
    parser.add_argument("--margin-gib", type=float, default=3.0,
                        help="memory kept free beyond the engine files' peaks before another file starts beside "
                             "a running one (default 3)")
    parser.add_argument("--record", action="store_true",
                        help="write the engine files' measured seconds and peak GiB into tests/engine_budget.json")
    parser.add_argument("--part", choices=["all", "1", "engine"], default="all")
    parser.add_argument("files", nargs="*", help="engine files (default: tests/serving/test_*.py)")
    opts = parser.parse_args()
    began = time.monotonic()
    junit = Path(tempfile.mkdtemp(prefix="test-suite-junit-"))
    starts_log = junit / "engine_starts.jsonl"
    os.environ[engine_starts.ENV] = str(starts_log)

    status, times, results = 0, {}, {}
    if opts.part in ("all", "1"):
        t = time.monotonic()
        rc, peak = part1(opts.jobs, junit)
        status = status or rc
        times[f"part 1 (everything but tests/serving; peak {peak:.1f} GiB)"] = time.monotonic() - t
    if opts.part in ("all", "engine"):
        files = opts.files or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "serving").glob("test_*.py"))
        t = time.monotonic()
        rc, results = part2(files, opts.jobs, junit, opts.margin_gib)
        status = status or rc
        walls = sum(w for w, _ in results.values())
        times[f"part 2 ({len(results)} engine files, {opts.jobs} at a time at most; their walls add up to "
              f"{walls:.0f} s)"] = time.monotonic() - t

    cases = junit_cases(junit)
    print(f"\n== test suite, {opts.jobs} jobs")
    for what, s in times.items():
        print(f"{s:8.0f} s  {what}")
    print(f"{time.monotonic() - began:8.0f} s  the suite")
    if results:
        print("== the engine files (wall, peak resident memory of the file's process tree)")
        for path, (wall, peak) in sorted(results.items(), key=lambda kv: -kv[1][0]):
            print(f"{wall:8.0f} s {peak:6.1f} GiB  {path}")
    print("== the ten slowest tests (setup + call + teardown)")
    for s, name, _ in sorted(cases, reverse=True)[:10]:
        print(f"{s:8.1f} s  {name}")
    counts: dict[str, int] = {}
    diagnostics = 0  # the identity check's routing-margin engines, outside the budget
    if starts_log.exists():
        for line in starts_log.read_text().splitlines():
            record = json.loads(line)
            if record.get("diagnostic"):
                diagnostics += 1
                continue
            test = record["test"]
            counts[test.split("::")[0]] = counts.get(test.split("::")[0], 0) + 1
    budget = engine_starts.budget()
    print(f"== engine starts: {sum(counts.values())} (budget {sum(budget.values())}), and {diagnostics} "
          "diagnostic (routing margins)")
    for f in sorted(set(counts) | set(budget)):
        print(f"{counts.get(f, 0):5d} of {budget.get(f, 0):3d}  {f}")
    outcomes = [o for _, _, o in cases]
    print(f"{outcomes.count('passed')} passed, {outcomes.count('failure') + outcomes.count('error')} failed, "
          f"{outcomes.count('skipped')} skipped")
    if opts.record and results:
        doc = json.loads(engine_starts.BUDGET.read_text())
        for path, (wall, peak) in results.items():
            doc["_seconds"][Path(path).name] = round(wall)
            doc.setdefault("_peak_gib", {})[Path(path).name] = round(peak, 1)
        for key in ("_seconds", "_peak_gib"):
            doc[key] = dict(sorted(doc[key].items(), key=lambda kv: -kv[1]))
        engine_starts.BUDGET.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"== recorded the engine files' seconds and peaks in {engine_starts.BUDGET.relative_to(ROOT)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
