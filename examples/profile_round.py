"""Where a decode round's time goes: a ``torch.profiler`` trace of a few ``LLMEngine.step`` calls of one
in-process engine (CPU activity, plus CUDA activity on a GPU), summarised by operator.

    python examples/profile_round.py --target /tmp/full-shape/target --load-format dummy \\
        --speculative-config '{"method": "hspec", "model": "/tmp/full-shape/hspec", "num_speculative_tokens": 7,
                               "hybridspec": {"gdn_kernel": true, "fixed_length": 1}}' \\
        --engine-args '{"mamba_ssm_cache_dtype": "float32", "compilation_config": {"cudagraph_mode": "PIECEWISE"},
                        "additional_config": {"gdn_prefill_backend": "triton"}}' --out /tmp/profile

Writes ``<out>/ops.txt`` (operators by self time, CPU and CUDA), ``<out>/summary.json`` (step times,
the share of each top-level phase: the target's forward, sampling, drafting) and, with ``--trace``,
a Chrome trace. Without ``--speculative-config`` it profiles plain decoding, for the side-by-side.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--speculative-config")
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lengths", default="",
                    help="comma-separated verification lengths w to profile one after another on the same engine "
                         "(needs \"hybridspec\": {\"fixed_length\": ...} in the speculative config); "
                         "results under <out>/w<w>/")
    ap.add_argument("--trace", action="store_true", help="also write a Chrome trace (large)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    t_start = time.perf_counter()
    llm = LLM(model=args.target, skip_tokenizer_init=True, seed=0, load_format=args.load_format,
              speculative_config=spec, async_scheduling=False, max_num_seqs=max(args.batch, 1),
              **json.loads(args.engine_args))
    start_s = round(time.perf_counter() - t_start, 1)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    lengths = [int(w) for w in args.lengths.split(",") if w] or [None]
    params = SamplingParams(temperature=0, max_tokens=len(lengths) * (args.warmup + args.steps + 4) * 16,
                            ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", {"prompt_token_ids": torch.randint(0, args.vocab, (args.prompt_len,),
                                                                        generator=gen).tolist()}, params)
    selector = None
    if lengths != [None]:
        from vllm_hybridspec.engine.compat import in_process_drafter

        selector = getattr(in_process_drafter(llm), "length_selector", None)
        if selector is None or selector.options.fixed_length is None:
            raise SystemExit('--lengths needs "hybridspec": {"fixed_length": ...} in --speculative-config')
    for w in lengths:
        if selector is not None:
            selector.configure(fixed_length=w)
        profile_steps(engine, args, spec, args.out / f"w{w}" if w is not None else args.out, start_s, w)


def profile_steps(engine, args, spec, out: Path, start_s: float, w) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(args.warmup):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    step_ms = []
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(args.steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
    out.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (out / "ops.txt").write_text(
        averages.table(sort_by="self_cpu_time_total", row_limit=60) + "\n\n"
        + (averages.table(sort_by=sort, row_limit=40) if sort != "self_cpu_time_total" else ""))
    # the runner's named phases (vLLM's record_function ranges) and kernel launch counts
    phases = {e.key: round(e.cpu_time_total / 1e3 / args.steps, 3) for e in averages
              if e.key.startswith(("gpu_model_runner:", "execute_", "propose", "sample", "_"))
              and e.cpu_time_total > 0}
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    # GPU busy time: the kernels' own time summed (device ops only), against the wall time of a step
    busy_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in averages if e.device_type.name in ("CUDA",))
    # host time of the top operators (self CPU), per step: where a host-bound step goes
    top_host = sorted(((e.key, e.self_cpu_time_total / 1e3 / args.steps) for e in averages), key=lambda kv: -kv[1])
    summary = {"speculative_config": spec, "verified_length": w, "batch": args.batch, "step_ms": step_ms,
               "gpu_busy_ms_per_step": busy_us / 1e3 / args.steps, "engine_start_s": start_s,
               "mean_step_ms": sum(step_ms) / len(step_ms), "kernel_launches_per_step": launches / args.steps,
               "aten_ops_per_step": sum(e.count for e in averages if e.key.startswith("aten::")) / args.steps,
               "host_ms_per_step_top": {k: round(v, 3) for k, v in top_host[:15]},
               "phases_ms_per_step": dict(sorted(phases.items(), key=lambda kv: -kv[1])[:40])}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.trace:
        prof.export_chrome_trace(str(out / "trace.json"))
    print(json.dumps({"w": w, **{k: summary[k] for k in ("mean_step_ms", "gpu_busy_ms_per_step",
                                                          "kernel_launches_per_step", "aten_ops_per_step",
                                                          "engine_start_s")}}), flush=True)


if __name__ == "__main__":
    main()
