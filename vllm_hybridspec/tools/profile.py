"""``hybridspec profile``: where a decode step's time goes. A ``torch.profiler`` trace of a few
``LLMEngine.step`` calls of one in-process engine (CPU activity, plus CUDA activity on a GPU),
summarised by operator.

    hybridspec profile --model /tmp/full-shape/target --load-format dummy --vocab 248000 \\
        --speculative-config '{"method": "hspec", "model": "/tmp/full-shape/hspec", "num_speculative_tokens": 7,
                               "hybridspec": {"fixed_length": 8}}' --lengths 1,8 \\
        --engine-args '{"mamba_ssm_cache_dtype": "float32", "additional_config": {"gdn_prefill_backend": "triton"}}' \\
        --out /tmp/profile

Writes, per profiled length ``w`` (under ``<out>/w<w>/`` with ``--lengths``, else ``<out>/``),
``ops.txt`` (operators by self time, CPU and CUDA), ``summary.json`` (step times, GPU busy time,
kernel launches and aten operators per step, the host time of the top operators, the runner's named
phases), with ``--trace`` a Chrome trace, and with ``--cprofile`` ``host.txt`` (twice as many steps again
under cProfile: the Python functions by cumulative wall time per step, and where the host is blocked,
each function's wall less its CPU time, with the blocking call's callers). Without ``--speculative-config`` it profiles plain
decoding, for the side-by-side. Async scheduling is off by default, so that a step's host and device
work are the step's own; ``--async-scheduling`` profiles the engine as it serves, host preparation
overlapping the device's previous step (no sync between steps; ``step_ms`` is then the mean over the
profiled steps).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer

from vllm_hybridspec.tools.engine_args import EngineOptions, engine_options, int_list, json_object, output_path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the proposer is reachable

LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")


def summarize(averages, steps: int) -> dict:
    """Per-step figures from a profiler's ``key_averages()``: GPU busy time (the kernels' own time),
    kernel launches, aten operators, the top operators by host (self CPU) time and vLLM's named
    phases (its ``record_function`` ranges)."""
    phases = {e.key: round(e.cpu_time_total / 1e3 / steps, 3) for e in averages
              if e.key.startswith(("gpu_model_runner:", "execute_", "propose", "sample", "_")) and e.cpu_time_total > 0}
    busy_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in averages if e.device_type.name == "CUDA")
    top_host = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps) for e in averages), key=lambda kv: -kv[1])
    return {"gpu_busy_ms_per_step": busy_us / 1e3 / steps,
            "kernel_launches_per_step": sum(e.count for e in averages if e.key in LAUNCH_CALLS) / steps,
            "aten_ops_per_step": sum(e.count for e in averages if e.key.startswith("aten::")) / steps,
            "host_ms_per_step_top": {k: round(v, 3) for k, v in top_host[:15]},
            "phases_ms_per_step": dict(sorted(phases.items(), key=lambda kv: -kv[1])[:40])}


def graph_split(events: list[dict], steps: int, top: int = 15) -> dict:
    """The GPU time of a Chrome trace's kernels (and device copies and sets) split by where they were
    launched: each CUDA-graph replay's kernels carry the ``cudaGraphLaunch``'s correlation id, so the
    replays of one captured graph group together (told apart by their kernel counts: a spec step
    replays the target's graph and the drafter's), and everything else is eager. Per group: kernels
    and ms per replay (or per step, eager), and the ``top`` kernel names by time."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})}
    replays: dict[int, list[dict]] = {}
    eager: list[dict] = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        c = e.get("args", {}).get("correlation")
        (replays.setdefault(c, []) if c in launches else eager).append(e)
    groups: dict[int, list[list[dict]]] = {}
    for kernels in replays.values():
        groups.setdefault(len(kernels), []).append(kernels)

    def table(kernels: list[dict], per: int) -> list[dict]:
        by: dict[str, list[float]] = {}
        for k in kernels:
            name = k["name"].replace("void ", "").replace("at::native::", "")[:120]
            by.setdefault(name, []).append(k.get("dur", 0.0))
        rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
        return [{"kernel": n, "us": round(sum(d) / per, 2), "calls": round(len(d) / per, 2)} for n, d in rows]

    out = {"graphs": [], "eager": {}}
    for count, runs in sorted(groups.items(), key=lambda kv: -sum(k.get("dur", 0.0) for r in kv[1] for k in r)):
        flat = [k for r in runs for k in r]
        out["graphs"].append({"kernels_per_replay": count, "replays_per_step": round(len(runs) / steps, 2),
                              "ms_per_replay": round(sum(k.get("dur", 0.0) for k in flat) / len(runs) / 1e3, 4),
                              "top": table(flat, len(runs))})
    out["eager"] = {"kernels_per_step": round(len(eager) / steps, 2),
                    "ms_per_step": round(sum(k.get("dur", 0.0) for k in eager) / steps / 1e3, 4),
                    "top": table(eager, steps)}
    return out


def host_functions(engine, steps: int, path: Path, top: int = 40, clock=time.perf_counter, waits: bool = True,
                   runner=None) -> dict:
    """``steps`` more steps under cProfile (``clock``: wall time by default, so a function that waits for
    the device counts the wait), without torch.profiler; writes ``path`` (per step: the plugin's and
    vLLM's functions by cumulative ms, every function by self ms, then the calls that may wait for the
    device, :data:`SYNC_NAMES`, each with its callers) and returns the wall ms per step of the profiled
    steps, the top ``top`` plugin and vLLM functions by cumulative ms per step and the ``syncs``.

    With ``waits`` (and the default wall clock), ``steps`` more steps under cProfile on the main thread's
    CPU time: a function's wall time less its CPU time is time the host spent blocked inside it (a
    device sync, a copy that waits, the GIL held by another thread), so the ``waits`` table (also
    written to ``path``) names where an async-scheduled step stops overlapping the device. With
    ``runner``, the drafter's rounds during the profiled steps (a graph capture in the window costs an
    eager round and a device sync)."""
    import cProfile
    import pstats

    from vllm_hybridspec.tools.spec_steps import drafter_counts

    def profiled(clock_fn):
        before = drafter_counts(runner)
        prof = cProfile.Profile(clock_fn)
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            engine.step()
        prof.disable()
        rounds = {k: n - before[k] for k, n in drafter_counts(runner).items()}
        return pstats.Stats(prof).stats, (time.perf_counter() - t0) * 1e3 / steps, rounds

    balanced = waits and clock == time.perf_counter
    stats, wall_ms, rounds = profiled(_wall_clock if balanced else clock)
    rows, syncs = [], []
    for (file, line, name), (_, nc, tt, ct, callers) in stats.items():
        where = _short(file, line, name)
        rows.append({"where": where, "calls": round(nc / steps, 2),
                     "self_ms": round(tt * 1e3 / steps, 3), "cum_ms": round(ct * 1e3 / steps, 3)})
        if any(s in name for s in SYNC_NAMES):
            syncs.append({"where": where, "calls": round(nc / steps, 2), "self_ms": round(tt * 1e3 / steps, 3),
                          "callers": {_short(*c): round(v[1] / steps, 2) for c, v in callers.items()}})
    rows.sort(key=lambda r: -r["cum_ms"])
    syncs.sort(key=lambda r: -r["self_ms"])
    ours = [r for r in rows if r["where"].startswith("vllm_hybridspec/")]
    vllm = [r for r in rows if r["where"].startswith("vllm/")]
    blocked = None
    if balanced:
        cpu_stats, cpu_wall_ms, cpu_rounds = profiled(_cpu_clock)
        blocked = wait_table(stats, cpu_stats, steps)
        blocked["cpu_pass_wall_ms_per_step"] = round(cpu_wall_ms, 3)
        if cpu_rounds:
            blocked["cpu_pass_drafter_rounds"] = cpu_rounds
        # the same without a profiler: the step's wall and CPU time as it serves
        wall_s = cpu_s = 0.0
        for _ in range(steps):
            w0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            wall_s, cpu_s = wall_s + time.perf_counter() - w0, cpu_s + time.thread_time() - c0
        blocked["unprofiled"] = {"wall_ms_per_step": round(wall_s * 1e3 / steps, 3),
                                 "cpu_ms_per_step": round(cpu_s * 1e3 / steps, 3),
                                 "blocked_ms_per_step": round((wall_s - cpu_s) * 1e3 / steps, 3)}
    with path.open("w") as f:
        f.write(f"wall {wall_ms:.3f} ms per step under cProfile, {steps} steps"
                + (f"; drafter rounds {rounds}" if rounds else "") + "\n\n")
        for title, table, limit in (("vllm_hybridspec (cumulative ms per step)", ours, 100),
                                    ("vllm (cumulative ms per step)", vllm, 100),
                                    ("all, by self time", sorted(rows, key=lambda r: -r["self_ms"]), 80)):
            f.write(f"## {title}\n{'cum_ms':>8} {'self_ms':>8} {'calls':>7}  where\n")
            for r in table[:limit]:
                f.write(f"{r['cum_ms']:8.3f} {r['self_ms']:8.3f} {r['calls']:7.2f}  {r['where']}\n")
            f.write("\n")
        f.write(f"## host waits and device reads ({', '.join(SYNC_NAMES)}): self ms and calls per step, callers\n")
        for r in syncs:
            f.write(f"{r['self_ms']:8.3f} {r['calls']:7.2f}  {r['where']}\n")
            for caller, n in sorted(r["callers"].items(), key=lambda kv: -kv[1]):
                f.write(f"{'':17}{n:7.2f}  <- {caller}\n")
        if blocked is not None:
            f.write("\n" + format_waits(blocked))
    result = {"wall_ms_per_step": round(wall_ms, 3), "plugin": ours[:top], "vllm": vllm[:top], "syncs": syncs}
    if rounds:
        result["drafter_rounds"] = rounds
    if blocked is not None:
        result["waits"] = blocked
    return result


def _wall_clock() -> float:
    """cProfile's clock for the wall pass of ``host_functions``: reads the thread CPU clock too, so that
    both passes pay the same per-event cost (the thread CPU clock is a system call, the wall clock is
    not: with unequal clocks every function with many calls below it looks blocked by a negative
    time)."""
    time.thread_time()
    return time.perf_counter()


def _cpu_clock() -> float:
    time.perf_counter()
    return time.thread_time()


def wait_table(wall_stats: dict, cpu_stats: dict, steps: int, top: int = 25, min_ms: float = 0.005) -> dict:
    """Where the host is blocked, from two cProfile passes of ``steps`` steps each (``pstats``' ``stats``
    dicts): one on wall time, one on the main thread's CPU time. Per function, ms per step of wall
    minus CPU time, inside the function itself (``self``: the call that blocks, e.g. a synchronize or a
    graph launch waiting for a full queue) and below it (``cum``: which step phase it blocks); the
    ``top`` of each at least ``min_ms``, the self ones with their callers. ``total``: the step's wall
    less its CPU time (the root functions' cumulative times)."""
    def per_step(stats):
        return {key: (tt * 1e3 / steps, ct * 1e3 / steps) for key, (_, _, tt, ct, _) in stats.items()}

    wall, cpu = per_step(wall_stats), per_step(cpu_stats)
    rows = []
    for key, (tt, ct) in wall.items():
        c_tt, c_ct = cpu.get(key, (0.0, 0.0))
        rows.append((key, tt - c_tt, ct - c_ct, tt, ct))
    roots = [key for key, value in wall_stats.items() if not value[4]]  # no callers: the profiled calls
    total = sum(wall[k][1] for k in roots) - sum(cpu.get(k, (0.0, 0.0))[1] for k in roots)

    def entry(row, with_callers=False):
        key, self_wait, cum_wait, tt, ct = row
        e = {"where": _short(*key), "self_wait_ms": round(self_wait, 3), "cum_wait_ms": round(cum_wait, 3),
             "self_wall_ms": round(tt, 3), "cum_wall_ms": round(ct, 3)}
        if with_callers:
            callers = wall_stats[key][4]
            e["callers"] = {_short(*c): round(v[1] / steps, 2) for c, v in
                            sorted(callers.items(), key=lambda kv: -kv[1][3])[:4]}
        return e

    by_self = sorted((r for r in rows if r[1] >= min_ms), key=lambda r: -r[1])[:top]
    by_cum = sorted((r for r in rows if r[2] >= min_ms), key=lambda r: -r[2])[:top]
    return {"total_wait_ms_per_step": round(total, 3), "by_self": [entry(r, True) for r in by_self],
            "by_cum": [entry(r) for r in by_cum]}


def format_waits(waits: dict) -> str:
    clean = waits.get("unprofiled")
    lines = [f"## where the host is blocked (wall less the main thread's CPU time, ms per step; "
             f"{waits['total_wait_ms_per_step']:.3f} in all under cProfile"
             + (f"; without it {clean['blocked_ms_per_step']:.3f} of a {clean['wall_ms_per_step']:.3f} ms step"
                if clean else "") + ")",
             "### inside the function itself, with its callers",
             f"{'wait_ms':>8} {'wall_ms':>8}  where"]
    for r in waits["by_self"]:
        lines.append(f"{r['self_wait_ms']:8.3f} {r['self_wall_ms']:8.3f}  {r['where']}")
        lines += [f"{'':19}{n:7.2f}  <- {c}" for c, n in r["callers"].items()]
    lines += ["### below the function (the phase it blocks)", f"{'wait_ms':>8} {'wall_ms':>8}  where"]
    lines += [f"{r['cum_wait_ms']:8.3f} {r['cum_wall_ms']:8.3f}  {r['where']}" for r in waits["by_cum"]]
    return "\n".join(lines) + "\n"


# functions whose name says they may wait for the device (cProfile names builtins by their method name)
SYNC_NAMES = ("synchronize", "'item'", "'tolist'", "'cpu'", "_local_scalar_dense", "'numpy'")


def _short(file: str, line: int, name: str) -> str:
    """``file:line(name)`` with the file from its package on (``vllm_hybridspec/...``, ``vllm/...``)."""
    for root in ("vllm_hybridspec/", "/vllm/"):
        if root in file:
            file = file[file.index(root):].lstrip("/")
            break
    else:
        file = file.split("site-packages/")[-1]
    return f"{file}:{line}({name})"


def profile_steps(engine, steps: int, warmup: int, out: Path, trace: bool, runner=None, sync: bool = True,
                  cprofile: bool = False) -> dict:
    """``warmup`` untimed steps, then ``steps`` profiled ones; writes ``ops.txt``, ``summary.json``
    (and ``trace.json``) under ``out`` and returns the summary (with ``runner``, the drafter's rounds
    of the profiled steps: graph replays, captures, eager rounds). ``sync=False`` (async scheduling):
    no device sync between steps, one time for all of them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from vllm_hybridspec.tools.spec_steps import drafter_counts

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        engine.step()
    rounds_before = drafter_counts(runner)
    step_ms = []
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            if cuda and sync:
                torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            torch.cuda.synchronize()
        if not sync:
            step_ms = [(time.perf_counter() - start) * 1e3 / steps] * steps
    out.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=60)]
    if cuda:
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=40))
    (out / "ops.txt").write_text("\n\n".join(tables) + "\n")
    summary = {"step_ms": step_ms, "mean_step_ms": sum(step_ms) / len(step_ms), **summarize(averages, steps)}
    rounds = {key: n - rounds_before[key] for key, n in drafter_counts(runner).items()}
    if rounds:
        summary["drafter_rounds"] = rounds
    if trace:
        prof.export_chrome_trace(str(out / "trace.json"))
        summary["gpu_split"] = graph_split(json.loads((out / "trace.json").read_text())["traceEvents"], steps)
    if cprofile:
        summary["host_functions"] = host_functions(engine, steps, out / "host.txt", runner=runner)
    if cuda:
        summary["host_syncs"] = device_syncs(engine, steps)
    return summary


def device_syncs(engine, steps: int) -> dict:
    """``steps`` more steps under torch's CUDA sync debug mode: the operations that made the host wait
    for the device (a value read, a blocking copy to the host, ``nonzero``), per step and by the Python
    line that issued them (torch's warning names the innermost frame)."""
    import warnings
    from collections import Counter

    import torch

    where: Counter = Counter()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            where[_short(w.filename, w.lineno, "sync")] += 1
    return {"per_step": round(sum(where.values()) / steps, 2),
            "by_line": {k: round(n / steps, 2) for k, n in where.most_common()}}


def profile_command(
    engine: EngineOptions,
    speculative_config: str = typer.Option(None, help="the drafter, as --speculative-config JSON (none: plain "
                                           "decoding)"),
    batch: int = typer.Option(1, min=1, help="requests decoding together"),
    prompt_len: int = typer.Option(96, min=1, help="random prompt length"),
    vocab: int = typer.Option(1000, min=2, help="random prompt token-id range"),
    lengths: str = typer.Option(None, help="verification lengths w to profile one after another on the same engine, "
                                "w = 1: drafting off (needs \"hybridspec\": {\"fixed_length\": ...} in the speculative config)"),
    warmup: int = typer.Option(8, min=1, help="untimed steps before each profile"),
    steps: int = typer.Option(6, min=1, help="profiled steps"),
    trace: bool = typer.Option(False, help="also write a Chrome trace (large)"),
    cprofile: bool = typer.Option(False, help="then twice as many steps again under cProfile, without "
                                  "torch.profiler: host.txt and summary.json's host_functions (the plugin's and "
                                  "vLLM's functions by cumulative wall ms per step, and where the host is blocked: "
                                  "wall less the main thread's CPU time per function)"),
    async_scheduling: bool = typer.Option(False, "--async-scheduling", help="profile with async scheduling on, as "
                                          "the engine serves (no sync between steps)"),
    out: Path = typer.Option(..., help="result directory"),
) -> None:
    """A torch.profiler summary of a few decode steps of one engine, per verification length."""
    import torch
    from vllm import LLM, SamplingParams

    from vllm_hybridspec.engine.compat import in_process_runner, length_selector

    spec = json_object(speculative_config, "speculative-config") or None
    ws = int_list(lengths, "lengths") if lengths else [None]
    if "async_scheduling" in engine.engine_args:
        # the flag is passed to vllm.LLM after --engine-args and decides how steps are timed (a sync
        # after each, or none): the key would be overridden without a word
        raise typer.BadParameter("--engine-args key 'async_scheduling' is set by --async-scheduling here; give "
                                 "that flag (or leave it out) instead")
    output_path(out, "--out", directory=True)
    t0 = time.perf_counter()
    llm = LLM(**engine.llm_kwargs(speculative_config=spec, async_scheduling=async_scheduling,
                                  max_num_seqs=max(batch, engine.max_num_seqs or 1)))
    start_s = round(time.perf_counter() - t0, 1)
    selector = None
    if ws != [None]:
        selector = length_selector(llm)
        if selector is None or selector.options.fixed_length is None:
            raise typer.BadParameter('--lengths needs "hybridspec": {"fixed_length": ...} in --speculative-config')
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=len(ws) * (warmup + steps + 4) * 16, ignore_eos=True)
    for i in range(batch):
        llm.llm_engine.add_request(f"p{i}", {"prompt_token_ids": torch.randint(0, vocab, (prompt_len,),
                                                                                generator=gen).tolist()}, params)
    for w in ws:
        if selector is not None and w == 1:  # drafting off, as the batch gate runs a step (and spec-steps)
            selector.configure(drafting=False)
        elif selector is not None:
            selector.configure(fixed_length=w)
        summary = profile_steps(llm.llm_engine, steps, warmup, out / f"w{w}" if w is not None else out, trace,
                                in_process_runner(llm), sync=not async_scheduling, cprofile=cprofile)
        summary.update(speculative_config=spec, verified_length=w, batch=batch, engine_start_s=start_s,
                       async_scheduling=async_scheduling)
        ((out / f"w{w}") if w is not None else out).joinpath("summary.json").write_text(json.dumps(summary, indent=1))
        typer.echo(json.dumps({"w": w, **{k: summary[k] for k in ("mean_step_ms", "gpu_busy_ms_per_step",
                                                                 "kernel_launches_per_step", "aten_ops_per_step",
                                                                 "engine_start_s")},
                                **({"host_syncs": summary["host_syncs"]["per_step"]} if "host_syncs" in summary else {}),
                                **({"drafter_rounds": summary["drafter_rounds"]} if "drafter_rounds" in summary else {})}))


profile_command = engine_options(profile_command)
