"""`make test`: the whole suite on a CPU machine, in as little wall time as its cores allow.

Part 1, everything but ``tests/serving``, runs in one pytest under pytest-xdist (``-n JOBS``) with
Triton's interpreter on. Part 2 runs each ``tests/serving/test_*.py`` in a pytest process of its own
(engines leave process-wide state behind; the Makefile says why), JOBS files at a time, the longest
first (their last measured seconds in ``tests/engine_budget.json``), each file's output printed whole
when it ends, followed by its wall time. With more than one job each process runs one OpenMP thread:
two processes of two threads on two cores stall at every OpenMP barrier.

At the end: each part's and the suite's wall time, the ten slowest tests (setup, call and teardown,
from each pytest's JUnit XML), every file's engine starts against its budget, and one closing line of
the counts. Exits non-zero when any pytest did.

    python scripts/test_suite.py                       # the suite, as `make test` runs it
    python scripts/test_suite.py --part engine tests/serving/test_selection.py tests/serving/test_config.py
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
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import engine_starts  # noqa: E402


def env(jobs: int, **extra: str) -> dict[str, str]:
    out = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", **extra}
    if jobs > 1:
        out.setdefault("OMP_NUM_THREADS", "1")
    return out


def part1(jobs: int, junit: Path) -> int:
    args = [sys.executable, "-m", "pytest", "-q", "--durations=15", f"--junitxml={junit / 'part1.xml'}",
            "tests", "--ignore=tests/serving"]
    if jobs > 1:
        args[3:3] = ["-n", str(jobs)]
    return subprocess.run(args, cwd=ROOT, env=env(jobs, TRITON_INTERPRET="1"), check=False).returncode


def engine_file(path: str, jobs: int, junit: Path) -> tuple[str, int, float, str]:
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--durations=5",
                           f"--junitxml={junit / (Path(path).stem + '.xml')}", path],
                          cwd=ROOT, env=env(jobs), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=False)
    return path, proc.returncode, time.monotonic() - began, proc.stdout


def part2(files: list[str], jobs: int, junit: Path) -> tuple[int, dict[str, float]]:
    seconds = {k: v for k, v in json.loads(engine_starts.BUDGET.read_text())["_seconds"].items()}
    files = sorted(files, key=lambda f: -seconds.get(Path(f).name, 1e9))  # unknown files first
    status, walls = 0, {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for done in as_completed([pool.submit(engine_file, f, jobs, junit) for f in files]):
            path, rc, wall, output = done.result()
            print(f"== {path}\n{output}== {path}: {wall:.0f} s, exit {rc}", flush=True)
            status = status or rc
            walls[path] = wall
    return status, walls


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
    parser.add_argument("--part", choices=["all", "1", "engine"], default="all")
    parser.add_argument("files", nargs="*", help="engine files (default: tests/serving/test_*.py)")
    opts = parser.parse_args()
    began = time.monotonic()
    junit = Path(tempfile.mkdtemp(prefix="test-suite-junit-"))
    starts_log = junit / "engine_starts.jsonl"
    os.environ[engine_starts.ENV] = str(starts_log)

    status, times = 0, {}
    if opts.part in ("all", "1"):
        t = time.monotonic()
        status = part1(opts.jobs, junit) or status
        times["part 1 (everything but tests/serving)"] = time.monotonic() - t
    if opts.part in ("all", "engine"):
        files = opts.files or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "serving").glob("test_*.py"))
        t = time.monotonic()
        rc, walls = part2(files, opts.jobs, junit)
        status = status or rc
        times[f"part 2 ({len(walls)} engine files, {opts.jobs} at a time; their walls add up to {sum(walls.values()):.0f} s)"] = time.monotonic() - t

    cases = junit_cases(junit)
    print(f"\n== test suite, {opts.jobs} jobs")
    for what, s in times.items():
        print(f"{s:8.0f} s  {what}")
    print(f"{time.monotonic() - began:8.0f} s  the suite")
    print("== the ten slowest tests (setup + call + teardown)")
    for s, name, _ in sorted(cases, reverse=True)[:10]:
        print(f"{s:8.1f} s  {name}")
    counts: dict[str, int] = {}
    if starts_log.exists():
        for line in starts_log.read_text().splitlines():
            test = json.loads(line)["test"]
            counts[test.split("::")[0]] = counts.get(test.split("::")[0], 0) + 1
    budget = engine_starts.budget()
    print(f"== engine starts: {sum(counts.values())} (budget {sum(budget.values())})")
    for f in sorted(set(counts) | set(budget)):
        print(f"{counts.get(f, 0):5d} of {budget.get(f, 0):3d}  {f}")
    outcomes = [o for _, _, o in cases]
    print(f"{outcomes.count('passed')} passed, {outcomes.count('failure') + outcomes.count('error')} failed, "
          f"{outcomes.count('skipped')} skipped")
    return status


if __name__ == "__main__":
    sys.exit(main())
