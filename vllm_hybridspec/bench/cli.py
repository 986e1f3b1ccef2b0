"""`hybridspec bench` and `hybridspec report`."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import typer

from vllm_hybridspec.bench.loadgen import BenchAborted, BenchConfig, run_bench
from vllm_hybridspec.bench.prompts import load_prompts
from vllm_hybridspec.bench.report import write_report
from vllm_hybridspec.bench.server import ManagedServer, ServerError, switch_server, url_from_command


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of positive integers, e.g. 1,4,16,64,128.")
    return values


def _switches(values: list[str] | None) -> list[tuple[str, dict]]:
    """``LABEL=OPTIONS`` pairs of --switch, in order."""
    from vllm_hybridspec.engine.length.control import parse_switch_options

    out = []
    for value in values or []:
        label, sep, text = value.partition("=")
        label = label.strip()
        if not sep or not label or not label.replace("-", "").replace("_", "").isalnum():
            raise typer.BadParameter(f"--switch {value!r}: expected LABEL=OPTIONS with a label of letters, digits, "
                                     "'-' or '_', e.g. 'all={}' or 'w4={\"fixed_length\": 4}'")
        try:
            out.append((label, parse_switch_options(text or "{}")))
        except ValueError as e:
            raise typer.BadParameter(f"--switch {value!r}: {e}") from None
    if len({label for label, _ in out}) != len(out):
        raise typer.BadParameter(f"--switch labels must differ, got {[label for label, _ in out]}")
    return out


def _with_worker_extension(command: str) -> str:
    from vllm_hybridspec.engine.length.control import WORKER_EXTENSION

    return command if "--worker-extension-cls" in command else f"{command} --worker-extension-cls {WORKER_EXTENSION}"


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"hybridspec bench: error: {message}", err=True)
    raise typer.Exit(code)


def bench(
    out: Path = typer.Option(..., "--out", "-o", help="result JSON (rewritten after every level)"),
    url: str = typer.Option(None, help="base URL of an OpenAI-compatible server [default: from --serve's "
                                       "--host/--port, else http://127.0.0.1:8000]"),
    serve: str = typer.Option(None, help="a server command line to start (and stop) around the run, "
                                         "e.g. \"vllm serve Qwen/Qwen3-8B --port 8000\""),
    serve_timeout: float = typer.Option(900.0, help="seconds to wait for the started server's /health"),
    prompts: Path = typer.Option(None, help="JSONL prompts: one {\"prompt\": text or list of token ids} per line"),
    dataset: str = typer.Option(None, help="a `datasets` name to take prompts from instead"),
    dataset_split: str = typer.Option("train"),
    prompt_field: str = typer.Option("prompt", help="the JSONL field / dataset column holding the prompt"),
    concurrency: str = typer.Option("1,4,16,64,128", help="comma-separated client counts C"),
    num_requests: int = typer.Option(0, help="measured requests per level [default: max(16, 4 C)]"),
    warmup: int = typer.Option(-1, help="warm-up requests per level, excluded from the statistics [default: C]"),
    output_len: int = typer.Option(256, help="output tokens per request"),
    eos: bool = typer.Option(False, "--eos", help="stop at EOS (output-len is then a cap) instead of a fixed length"),
    model: str = typer.Option(None, help="model name for the requests [default: the server's first model]"),
    label: str = typer.Option("", help="configuration name shown by `hybridspec report` [default: file stem]"),
    request_timeout: float = typer.Option(600.0, help="seconds before one request counts as failed"),
    level_timeout: float = typer.Option(1800.0, help="seconds after which a level sends no new requests"),
    metrics_interval: float = typer.Option(0.5, help="seconds between KV-usage scrapes of /metrics"),
    progress: bool = typer.Option(True, help="progress bar per level"),
    repeats: int = typer.Option(1, min=1, help="measured runs of --num-requests per level, back to back (after one "
                                "warm-up): the report gives their tokens/s spread"),
    switch: list[str] = typer.Option(None, "--switch", help="LABEL=OPTIONS (repeatable): run the whole sweep once per "
                                     "setting of the server's length selector, switched in place between sweeps "
                                     "(vllm_hybridspec.engine.length.control; OPTIONS: JSON with fixed_length, policy, gate, "
                                     "batched, drafting; {} verifies every draft); results in OUT-LABEL.json"),
) -> None:
    """Closed-loop load: C clients each send their next streamed completion as soon as the previous one
    finishes, for each C; throughput, latency, acceptance length and KV usage per C, as JSON."""
    levels = _concurrencies(concurrency)
    switches = _switches(switch)
    if output_len < 1:
        raise typer.BadParameter(f"--output-len must be at least 1, got {output_len}.")
    try:
        prompt_list = load_prompts(prompts, dataset, dataset_split, prompt_field)
    except ValueError as e:
        _fail(str(e), 2)
    base_url = url or (url_from_command(serve, "http://127.0.0.1:8000") if serve else "http://127.0.0.1:8000")
    cfg = BenchConfig(base_url=base_url, concurrencies=levels, num_requests=num_requests, warmup=warmup,
                      output_len=output_len, ignore_eos=not eos, model=model, label=label or out.stem,
                      request_timeout=request_timeout, level_timeout=level_timeout,
                      metrics_interval=metrics_interval, repeats=repeats)
    if serve and switches:
        serve = _with_worker_extension(serve)
    meta = {"serve": serve, "prompt_source": str(prompts or dataset), "num_prompts": len(prompt_list)}
    runs = [(None, {}, out, cfg)] if not switches else [
        (name, options, out.with_name(f"{out.stem}-{name}{out.suffix or '.json'}"),
         replace(cfg, label=f"{cfg.label}-{name}")) for name, options in switches]
    docs, current = [], out
    try:
        with ExitStack() as stack:
            server = None
            if serve:
                log = out.with_name(out.stem + ".server.log")
                typer.echo(f"starting the server (log: {log}) and waiting for {base_url}/health", err=True)
                env = {"VLLM_SERVER_DEV_MODE": "1"} if switches else None
                server = stack.enter_context(ManagedServer(serve, base_url, log, serve_timeout, env=env))
            for name, options, current, run_cfg in runs:
                run_meta = meta
                if name is not None:
                    answers = switch_server(base_url, options)
                    typer.echo(f"switched the server to {name} = {json.dumps(options)}", err=True)
                    run_meta = {**meta, "switch": {"label": name, "options": options, "answers": answers}}
                docs.append(run_bench(run_cfg, prompt_list, current, meta=run_meta,
                                      server_alive=(lambda: server.alive) if server else None, progress=progress))
    except ServerError as e:
        _fail(str(e))
    except BenchAborted as e:
        _fail(f"{e}; partial results in {current}")
    except KeyboardInterrupt:
        _fail(f"interrupted{'; partial results in ' + str(current) if current.exists() else ''}", 130)
    for (name, _, path, _), doc in zip(runs, docs):
        if name is not None:
            typer.echo(f"{name}:")
        _print_levels(doc, path)


def _print_levels(doc: dict, out: Path) -> None:
    for lv in doc["levels"]:
        spread = lv.get("output_throughput_spread")
        spread = f" [{_num(spread['min'])}-{_num(spread['max'])} over {len(spread['repeats'])} runs]" if spread else ""
        typer.echo(f"C={lv['concurrency']:>4}: {_num(lv['output_throughput'])} tok/s{spread}, "
                   f"{_num(lv['request_throughput'], '.2f')} req/s, ITL p50 {_num(lv['itl_s']['p50'], '.1f', 1e3)} ms, "
                   f"E2E p50 {_num(lv['e2e_s']['p50'], '.2f')} s, failed {lv['failed']}/{lv['num_requests']}, "
                   f"accept. length {_num(lv['mean_acceptance_length'], '.2f')}, "
                   f"KV max {_num(lv['kv_cache_usage']['max'], '.1%')}")
    failed = sum(lv["failed"] for lv in doc["levels"])
    if failed:
        typer.echo(f"warning: {failed} request(s) failed; their errors are under 'errors' in {out}", err=True)
    typer.echo(f"results: {out}")


def _num(value, spec: str = ".1f", scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def report(
    results: list[str] = typer.Argument(..., help="result JSONs of `hybridspec bench`, one per configuration, or "
                                        "LABEL=PATH[,PATH...] for one configuration measured in several runs "
                                        "(levels merged by concurrency; the last file wins a level measured twice)"),
    out_dir: Path = typer.Option(Path("bench_report"), "--out-dir", "-o"),
) -> None:
    """A markdown table and plots (throughput, latency, KV usage against concurrency) of result files,
    the configurations side by side."""
    try:
        path = write_report(results, out_dir)
    except (OSError, ValueError) as e:
        typer.echo(f"hybridspec report: error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"report: {path}")
