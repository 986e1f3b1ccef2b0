"""Host (Python / torch dispatch) time per decode step of one in-process engine on the CPU, without the
work that a GPU runs inside CUDA graphs: the target model's forward (``GPUModelRunner._model_forward``,
a full-graph replay on the H200) and the H-Spec drafting round (``HSpecForVLLM.gather_prefix_kv`` +
``HSpecForVLLM.draft``, replayed by ``DraftGraphs.run`` there). What is left is what every step pays on
the host on the GPU too: scheduling, input preparation, sampling, the plugin's plan, cut and selector,
output processing.

    VLLM_TARGET_DEVICE=cpu .venv/bin/python scripts/host_profile.py --engine plain --out /tmp/hp
    VLLM_TARGET_DEVICE=cpu .venv/bin/python scripts/host_profile.py --engine spec --lengths 1,8 --out /tmp/hp
    VLLM_TARGET_DEVICE=cpu .venv/bin/python scripts/host_profile.py --engine vllm_path --dtype bfloat16 --out /tmp/hp

``--engine plain``: the reference hybrid (``models/hybrid``, or ``$HS_MODELS/hybrid``) without a drafter.
``--engine spec``: with its H-Spec drafter (``models/hybrid-hspec``, K = 7) and ``"hybridspec":
{"fixed_length": 8}``; per ``w`` of ``--lengths`` the selector verifies ``w`` tokens per request (``w = 1``:
drafting off, as the batch gate). ``--engine vllm_path``: the same drafter verifying every draft with the
target's GDN layers on vLLM's own spec path and no selector (``"hybridspec": {"gdn_kernel": false}``;
vLLM's CPU GDN path needs ``--dtype bfloat16``). Async scheduling is kept on (as on a GPU;
``CpuPlatform`` turns it off). Per measurement it writes ``<out>/<name>.json`` (step and host ms per step:
the main thread's CPU time, best of ``--repeats``; aten operators per step outside the excluded regions,
by name; among them the kernels, operators with no aten operator below them that are not views or
allocations, what a GPU would launch; and the host reads, Python-level reads of tensor values
(``item``, ``tolist``, ``nonzero``, ...) by line: a device sync on a GPU where the tensor lives on the
device, so on the CPU, where every tensor does, an upper bound on a GPU's syncs), ``<out>/<name>.sources.txt``
(torch calls from Python per step by calling line) and ``<out>/<name>.cprofile.txt`` (cProfile, per-step
cumulative ms of the plugin's functions and of the top vLLM ones). ``--table FILE`` merges the rows into
``docs/benchmarks/host_step.json`` (``config``: ``plain``, ``drafting_off``, ``ours_w<w>``,
``vllm_path_w8``; ``B``, ``dtype``, ``aten_ops``, ``launches``, ``host_syncs`` (the host reads),
``python_ms``, ``torch_calls``).

The timing wrappers reach into vLLM 0.26 (``GPUModelRunner._model_forward``); this is a measurement
script, not part of the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("MAMBA_DETERMINISTIC", "1")

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("HS_MODELS", ROOT / "models"))  # the reference models (HS_MODELS: elsewhere)
sys.path.insert(0, str(ROOT))  # this checkout's vllm_hybridspec, not the one the venv was installed from
EXCLUDED = "hs::excluded"
# the main thread's CPU time: on a shared machine, wall time mostly measures the other processes
CLOCK = time.thread_time


class Excluded:
    """Wall time spent inside the excluded regions (no nesting expected, but nested calls count once)."""

    def __init__(self):
        self.seconds = 0.0
        self.depth = 0
        self.profiling = False

    @contextmanager
    def region(self):
        import torch

        self.depth += 1
        t0 = CLOCK()
        try:
            if self.profiling and self.depth == 1:
                with torch.profiler.record_function(EXCLUDED):
                    yield
            else:
                yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.seconds += CLOCK() - t0


def install_exclusions(excluded: Excluded) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_hybridspec.engine.drafting.model import HSpecForVLLM

    def wrap(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            with excluded.region():
                return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    wrap(GPUModelRunner, "_model_forward")
    wrap(HSpecForVLLM, "draft")
    wrap(HSpecForVLLM, "gather_prefix_kv")


def keep_async_scheduling() -> None:
    """``CpuPlatform.check_and_update_config`` turns async scheduling off; keep it on, as a GPU has it
    (tests/serving/conftest.py's ``async_scheduling`` fixture)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_async(cls, vllm_config):
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(keep_async)


def start(engine: str, k: int, dtype: str, batch: int):
    from vllm import LLM

    spec = None
    if engine in ("spec", "vllm_path"):
        # vllm_path: the same drafter verifying every draft, the target's GDN layers on vLLM's own spec path,
        # no selector (as an engine without "hybridspec" options runs it)
        options = {"gdn_kernel": False} if engine == "vllm_path" else {"fixed_length": k + 1}
        spec = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": k,
                "hybridspec": options}
    return LLM(model=str(MODELS / "hybrid"), skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
               max_model_len=1024, max_num_seqs=max(4, batch), max_num_batched_tokens=512, seed=0,
               mamba_ssm_cache_dtype="float32", speculative_config=spec, async_scheduling=True)


def add_requests(llm, batch: int, tag: str, max_tokens: int):
    import torch
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        llm.llm_engine.add_request(rid, {"prompt_token_ids": torch.randint(2, 8000, (48,), generator=gen).tolist()},
                                   params)
    return ids


def finish(llm, ids):
    engine = llm.llm_engine
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


def timed_steps(engine, excluded: Excluded, steps: int) -> tuple[list[float], list[float]]:
    step_ms, host_ms = [], []
    for _ in range(steps):
        excluded.seconds = 0.0
        t0 = CLOCK()
        engine.step()
        dt = CLOCK() - t0
        step_ms.append(dt * 1e3)
        host_ms.append((dt - excluded.seconds) * 1e3)
    return step_ms, host_ms


def torch_calls(engine, excluded: Excluded, steps: int) -> Counter:
    """torch calls made from Python (a ``TorchFunctionMode``: tensor methods, indexing, torch functions)
    per (calling frame, function), outside the excluded regions; the calling frame is the innermost one
    in this package or in vLLM."""
    from torch.overrides import TorchFunctionMode

    calls: Counter = Counter()
    package, vllm = str(ROOT / "vllm_hybridspec"), "/site-packages/vllm/"

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if excluded.depth == 0:
                frame = sys._getframe(1)
                while frame is not None:
                    file = frame.f_code.co_filename
                    if file.startswith(package) or vllm in file:
                        where = f"{file.split('site-packages/')[-1].replace(str(ROOT) + '/', '')}:{frame.f_lineno}"
                        break
                    frame = frame.f_back
                else:
                    where = "?"
                calls[(where, getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func)))] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for _ in range(steps):
            engine.step()
    return calls


# aten operators that launch no kernel on a GPU: views, metadata and allocations
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "as_strided", "slice", "select", "view", "_unsafe_view", "reshape", "_reshape_alias", "alias", "detach",
    "unsqueeze", "squeeze", "expand", "expand_as", "t", "transpose", "permute", "flatten", "unflatten", "narrow",
    "split", "split_with_sizes", "chunk", "unbind", "lift_fresh", "resolve_conj", "resolve_neg", "empty",
    "empty_strided", "empty_like", "new_empty", "new_empty_strided", "set_", "is_nonzero", "item",
    "_local_scalar_dense", "numpy_T", "view_as", "contiguous", "to", "type_as", "record_stream", "pin_memory",
    "_pin_memory", "is_pinned", "result_type", "size", "stride", "dim"))
# Python-level reads of a tensor's values on the host: a device sync on a GPU when the tensor lives there
# (on the CPU every tensor does, so these count host-side tensors too: an upper bound on the GPU's syncs)
HOST_READS = frozenset(("item", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__",
                        "cpu", "any", "all", "equal", "allclose"))


def leaf_kernels(events) -> Counter:
    """The aten operators of ``events`` that would launch a kernel: those without an aten operator below
    them (the dispatcher's innermost call) and not in :data:`NO_KERNEL`."""
    kernels: Counter = Counter()
    for event in events:
        if event.name in NO_KERNEL or any(c.name.startswith("aten::") for c in event.cpu_children):
            continue
        kernels[event.name] += 1
    return kernels


def aten_counts(engine, excluded: Excluded, steps: int) -> tuple[Counter, Counter]:
    """aten operators per step outside the excluded regions (every event, nested ones included, as
    ``hybridspec profile`` counts them), and among them the kernels (:func:`leaf_kernels`)."""
    from torch.profiler import ProfilerActivity, profile

    excluded.profiling = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
    finally:
        excluded.profiling = False
    counts: Counter = Counter()
    outside = []
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, inside = event.cpu_parent, False
        while parent is not None:
            if parent.name == EXCLUDED:
                inside = True
                break
            parent = parent.cpu_parent
        if not inside:
            counts[event.name] += 1
            outside.append(event)
    return counts, leaf_kernels(outside)


def cprofile_steps(engine, steps: int, path: Path) -> list[dict]:
    """``hybridspec profile --cprofile``'s table (``tools.profile.host_functions``) on the main thread's
    CPU time; returns the plugin's functions."""
    from vllm_hybridspec.tools.profile import host_functions

    return host_functions(engine, steps, path, top=80, clock=CLOCK)["plugin"]


def measure(llm, name: str, args, excluded: Excluded) -> dict:
    engine = llm.llm_engine
    per_run = args.warmup + args.steps
    total = per_run * (args.repeats + 2) + 8
    ids = add_requests(llm, args.batch, name, max_tokens=total * (args.k + 1) + 64)
    for _ in range(args.warmup):
        engine.step()
    best = (float("nan"),) * 3
    for _ in range(args.repeats if args.timing else 0):
        step_ms, host_ms = timed_steps(engine, excluded, args.steps)
        row = (statistics.median(host_ms), statistics.median(step_ms), statistics.mean(host_ms))
        if not best[0] <= row[0]:
            best = row
    counts, kernels = aten_counts(engine, excluded, args.steps) if args.timing else (Counter(), Counter())
    n_src = max(4, args.steps // 4)
    sources = torch_calls(engine, excluded, n_src)
    reads = Counter({key: n for key, n in sources.items() if key[1].rsplit(".", 1)[-1] in HOST_READS})
    with (args.out / f"{name}.sources.txt").open("w") as f:
        f.write(f"torch calls from Python per step by calling line (outside the forward and the round): "
                f"{sum(sources.values()) / n_src:.1f}\n")
        for (frame, op), n in sources.most_common():
            f.write(f"{n / n_src:7.2f}  {op:36s} {frame}\n")
    ours = cprofile_steps(engine, args.steps, args.out / f"{name}.cprofile.txt") if args.cprofile else []
    finish(llm, ids)
    per_step = {k: v / args.steps for k, v in counts.most_common()}
    result = {"name": name, "host_ms_median": round(best[0], 3), "step_ms_median": round(best[1], 3),
              "host_ms_mean": round(best[2], 3), "aten_ops_per_step": round(sum(counts.values()) / args.steps, 1),
              "launches_per_step": round(sum(kernels.values()) / args.steps, 1),
              "host_reads_per_step": round(sum(reads.values()) / n_src, 2),
              "torch_calls_per_step": round(sum(sources.values()) / n_src, 1),
              "host_reads": {f"{op} {frame}": round(n / n_src, 2) for (frame, op), n in reads.most_common()},
              "kernels_by_name": {k: round(v / args.steps, 2) for k, v in kernels.most_common()},
              "aten_by_name": {k: round(v, 2) for k, v in per_step.items()},
              "plugin_top": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                             for r in ours[:25]]}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"{name}: host {result['host_ms_median']:.3f} ms/step (median; mean {result['host_ms_mean']:.3f}), "
          f"step {result['step_ms_median']:.3f} ms, {result['aten_ops_per_step']} aten ops/step outside the "
          f"forward and the drafting round, {result['launches_per_step']} of them kernels, "
          f"{result['host_reads_per_step']} host reads", flush=True)
    return result


def config_name(name: str) -> str:
    """``host_step.json``'s config of a measurement: ``plain``, ``drafting_off`` (w = 1), ``ours_w<w>`` or
    ``vllm_path_w<K + 1>``."""
    base = name.split("-b")[0]
    return {"w1": "drafting_off"}.get(base, base if base.startswith(("plain", "vllm_path")) else f"ours_{base}")


def merge_table(path: Path, results: list[dict], batch: int, dtype: str, command: str) -> None:
    """Put this run's rows into ``path`` (``docs/benchmarks/host_step.json``: per config and batch size, the
    host's work per step outside the forward and the drafting round), replacing rows of the same config,
    batch size and dtype; the table's ``command`` lists the runs that wrote it."""
    table = json.loads(path.read_text()) if path.exists() else {"rows": [], "command": []}
    rows = [{"config": config_name(r["name"]), "B": batch, "dtype": dtype, "aten_ops": r["aten_ops_per_step"],
             "launches": r["launches_per_step"], "host_syncs": r["host_reads_per_step"],
             "python_ms": r["host_ms_median"], "torch_calls": r["torch_calls_per_step"]} for r in results]
    keys = {(r["config"], r["B"], r["dtype"]) for r in rows}
    table["rows"] = [r for r in table["rows"] if (r["config"], r["B"], r.get("dtype")) not in keys] + rows
    order = ["plain", "drafting_off"]
    table["rows"].sort(key=lambda r: (r["B"], order.index(r["config"]) if r["config"] in order else 2, r["config"]))
    if command not in table["command"]:
        table["command"].append(command)
    path.write_text(json.dumps(table, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["plain", "spec", "vllm_path"], required=True)
    parser.add_argument("--lengths", default="1,8", help="spec engine: verification lengths (1: drafting off)")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-timing", dest="timing", action="store_false",
                        help="no timing and no aten counts (quick)")
    parser.add_argument("--no-cprofile", dest="cprofile", action="store_false")
    parser.add_argument("--tag", default="", help="suffix of the result names (before/after)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table", type=Path, help="merge the rows into this host_step.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    keep_async_scheduling()
    excluded = Excluded()
    install_exclusions(excluded)
    llm = start(args.engine, args.k, args.dtype, args.batch)
    from vllm_hybridspec.engine.compat import length_selector

    results = []
    if args.engine == "plain":
        results.append(measure(llm, f"plain-b{args.batch}{args.tag}", args, excluded))
    elif args.engine == "vllm_path":
        results.append(measure(llm, f"vllm_path_w{args.k + 1}-b{args.batch}{args.tag}", args, excluded))
    else:
        selector = length_selector(llm)
        for w in [int(x) for x in args.lengths.split(",")]:
            if w == 1:
                selector.configure(drafting=False)
            else:
                selector.configure(fixed_length=w)
            results.append(measure(llm, f"w{w}-b{args.batch}{args.tag}", args, excluded))
    if args.table is not None:
        merge_table(args.table, results, args.batch, args.dtype,
                    "VLLM_TARGET_DEVICE=cpu python scripts/host_profile.py " + " ".join(sys.argv[1:]))
    print(json.dumps([{k: r[k] for k in ("name", "host_ms_median", "step_ms_median", "aten_ops_per_step",
                                         "launches_per_step", "host_reads_per_step")}
                      for r in results]))


if __name__ == "__main__":
    main()
