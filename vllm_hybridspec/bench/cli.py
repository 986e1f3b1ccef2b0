"""`hybridspec bench`, `hybridspec soak` and `hybridspec report`."""

from __future__ import annotations

import json
import math
import platform
import shlex
import urllib.parse
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import typer

from vllm_hybridspec.bench.loadgen import BenchAborted, BenchConfig, run_bench
from vllm_hybridspec.bench.prompts import load_prompts
from vllm_hybridspec.bench.report import write_report
from vllm_hybridspec.bench.server import ManagedServer, ServerError, switch_server, url_from_command
from vllm_hybridspec.bench.soak import CHECKS, SoakConfig, run_soak

DEFAULT_URL = "http://127.0.0.1:8000"
# the options `bench` and `soak` share
URL = typer.Option(None, help="base URL of an OpenAI-compatible server [default: from --serve's --host/--port, "
                              f"else {DEFAULT_URL}]")
SERVE = typer.Option(None, help="a server command line to start (and stop) around the run, "
                                "e.g. \"vllm serve Qwen/Qwen3-8B --port 8000\"")
SERVE_TIMEOUT = typer.Option(900.0, help="seconds to wait for the started server's /health")
PROMPT_FIELD = typer.Option("prompt", help="the JSONL field / dataset column holding the prompt")
MODEL = typer.Option(None, help="model name for the requests [default: the server's first model]")
REQUEST_TIMEOUT = typer.Option(600.0, help="seconds before one request counts as failed")
PROGRESS = typer.Option(True, help="progress bars")


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"--concurrency {text!r} is not a comma-separated list of positive integers, "
                                 "e.g. 1,4,16,64,128.")
    return values


def _check_values(command: str, rows) -> None:
    """``rows`` of ``(option, value, ok, what would be valid)``: the first not ``ok`` (or not a finite
    number) ends the command with exit status 2 and one line."""
    for name, value, ok, valid in rows:
        if not (math.isfinite(value) and ok):
            _fail(f"{name} {value:g} is not valid; expected {valid}.", 2, command)


def _check_server(command: str, url: str | None, serve: str | None) -> None:
    """--url must be an http(s) URL with a host; --serve a command line shlex can split."""
    if url is not None:
        parts = urllib.parse.urlsplit(url)
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            port_ok = False
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            _fail(f"--url {url!r} is not valid; expected http://HOST[:PORT] or https://HOST[:PORT], "
                  f"e.g. {DEFAULT_URL}.", 2, command)
    if serve is not None:
        try:
            argv = shlex.split(serve)
        except ValueError as e:
            _fail(f"--serve {serve!r} is not a command line ({e}); quote it as a shell would.", 2, command)
        if not argv:
            _fail("--serve is empty; expected a server command line, e.g. 'vllm serve MODEL --port 8000'.", 2,
                  command)


def _check_out(command: str, *paths: Path) -> None:
    """Result files: not a directory, below a directory that exists or can be made, and writable."""
    from vllm_hybridspec.policy.errors import InputError
    from vllm_hybridspec.policy.files import check_writable

    for path in paths:
        try:
            check_writable(path, "--out", make_parents=True)
        except InputError as e:
            _fail(f"{e}.", 2, command)


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


def _fail(message: str, code: int = 1, command: str = "bench") -> None:
    typer.echo(f"hybridspec {command}: error: {message}", err=True)
    raise typer.Exit(code)


def _load_prompts_or_exit(command: str, *args) -> list:
    try:
        return load_prompts(*args)
    except ValueError as e:
        _fail(str(e), 2, command)


def _base_url(url: str | None, serve: str | None) -> str:
    return url or (url_from_command(serve, DEFAULT_URL) if serve else DEFAULT_URL)


@contextmanager
def _one_line_errors(command: str, current):
    """What stops a run becomes one line on stderr and an exit code (1: the server or the result file,
    130: Ctrl-C); ``current()`` is the result file being written."""
    try:
        yield
    except ServerError as e:
        _fail(str(e), 1, command)
    except BenchAborted as e:
        _fail(f"{e}; partial results in {current()}", 1, command)
    except OSError as e:  # the result file or the server log could not be written
        _fail(str(e), 1, command)
    except KeyboardInterrupt:
        out = current()
        _fail(f"interrupted{'; partial results in ' + str(out) if out.exists() else ''}", 130, command)


def accelerator_name() -> str:
    """The machine's GPU as ``nvidia-smi`` names it (the first), or ``cpu: <model name>`` without one."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.split("\n")
            if names[0].strip():
                return names[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"cpu: {model or platform.processor() or 'unknown'}"


def run_stamp() -> dict:
    """Where and when a run was made (``hybridspec headline`` checks that the ratios it gives come from one
    machine): the host name, its GPU and the UTC start time."""
    return {"host": platform.node(), "gpu": accelerator_name(),
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _managed_server(stack: ExitStack, serve: str | None, base_url: str, out: Path, timeout: float,
                    env: dict | None = None) -> ManagedServer | None:
    """The server of ``--serve``, started (log next to ``out``) and stopped with ``stack``; None without."""
    if not serve:
        return None
    log = out.with_name(out.stem + ".server.log")
    typer.echo(f"starting the server (log: {log}) and waiting for {base_url}/health", err=True)
    return stack.enter_context(ManagedServer(serve, base_url, log, timeout, env=env))


def bench(
    out: Path = typer.Option(..., "--out", "-o", help="result JSON (rewritten after every level)"),
    url: str = URL,
    serve: str = SERVE,
    serve_timeout: float = SERVE_TIMEOUT,
    prompts: Path = typer.Option(None, help="JSONL prompts: one {\"prompt\": text or list of token ids} per line"),
    dataset: str = typer.Option(None, help="a `datasets` name to take prompts from instead"),
    dataset_split: str = typer.Option("train"),
    prompt_field: str = PROMPT_FIELD,
    concurrency: str = typer.Option("1,4,16,64,128", help="comma-separated client counts C"),
    num_requests: int | None = typer.Option(None, min=1, help="measured requests per level [default: max(16, 4 C)]"),
    warmup: int | None = typer.Option(None, min=0, help="warm-up requests per level, excluded from the statistics "
                                      "[default: C]"),
    output_len: int = typer.Option(256, help="output tokens per request"),
    eos: bool = typer.Option(False, "--eos", help="stop at EOS (output-len is then a cap) instead of a fixed length"),
    model: str = MODEL,
    label: str = typer.Option("", help="configuration name shown by `hybridspec report` [default: file stem]"),
    request_timeout: float = REQUEST_TIMEOUT,
    level_timeout: float = typer.Option(1800.0, help="seconds after which a level sends no new requests"),
    metrics_interval: float = typer.Option(0.5, help="seconds between KV-usage scrapes of /metrics"),
    progress: bool = PROGRESS,
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
    _check_values("bench", (("--serve-timeout", serve_timeout, serve_timeout > 0, "a positive number of seconds"),
                            ("--request-timeout", request_timeout, request_timeout > 0, "a positive number of seconds"),
                            ("--level-timeout", level_timeout, level_timeout > 0, "a positive number of seconds"),
                            ("--metrics-interval", metrics_interval, metrics_interval > 0,
                             "a positive number of seconds")))
    _check_server("bench", url, serve)
    outs = [out] if not switches else [out.with_name(f"{out.stem}-{name}{out.suffix or '.json'}")
                                       for name, _ in switches]
    _check_out("bench", *outs)
    prompt_list = _load_prompts_or_exit("bench", prompts, dataset, dataset_split, prompt_field)
    base_url = _base_url(url, serve)
    cfg = BenchConfig(base_url=base_url, concurrencies=levels, num_requests=num_requests or 0,
                      warmup=-1 if warmup is None else warmup,
                      output_len=output_len, ignore_eos=not eos, model=model, label=label or out.stem,
                      request_timeout=request_timeout, level_timeout=level_timeout,
                      metrics_interval=metrics_interval, repeats=repeats)
    if serve and switches:
        serve = _with_worker_extension(serve)
    meta = {"serve": serve, "prompt_source": str(prompts or dataset), "num_prompts": len(prompt_list),
            **run_stamp()}
    runs = [(None, {}, out, cfg)] if not switches else [
        (name, options, path, replace(cfg, label=f"{cfg.label}-{name}"))
        for (name, options), path in zip(switches, outs)]
    docs, current = [], out
    with _one_line_errors("bench", lambda: current), ExitStack() as stack:
        server = _managed_server(stack, serve, base_url, out, serve_timeout,
                                 {"VLLM_SERVER_DEV_MODE": "1"} if switches else None)
        if server is not None:
            meta["server"] = server.facts()
        for name, options, current, run_cfg in runs:
            run_meta = meta
            if name is not None:
                answers = switch_server(base_url, options)
                typer.echo(f"switched the server to {name} = {json.dumps(options)}", err=True)
                run_meta = {**meta, "switch": {"label": name, "options": options, "answers": answers}}
            docs.append(run_bench(run_cfg, prompt_list, current, meta=run_meta,
                                  server_alive=(lambda: server.alive) if server else None, progress=progress))
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


def soak(
    out: Path = typer.Option(..., "--out", "-o", help="result JSON: every number and each check's verdict"),
    duration: float = typer.Option(600.0, help="seconds during which new requests are sent"),
    prompts: Path = typer.Option(..., help="JSONL prompts, as for `bench`; the first --probes of them are the "
                                         "probe set, so a file keeps it fixed from one soak to the next"),
    prompt_field: str = PROMPT_FIELD,
    url: str = URL,
    serve: str = SERVE,
    serve_timeout: float = SERVE_TIMEOUT,
    concurrency: int = typer.Option(16, help="clients C"),
    disconnect_share: float = typer.Option(0.2, help="share of requests whose client closes the connection "
                                           "after --disconnect-after tokens"),
    disconnect_after: int = typer.Option(8, help="tokens a disconnecting client reads first"),
    output_len: int = typer.Option(64, help="output tokens of every other request (EOS ignored)"),
    probes: int = typer.Option(4, help="probe prompts (the first ones), decoded greedily before and after"),
    probe_tokens: int = typer.Option(32, help="greedy tokens per probe"),
    idle_timeout: float = typer.Option(60.0, help="seconds the idle server's KV-cache usage gets to reach 0"),
    model: str = MODEL,
    request_timeout: float = REQUEST_TIMEOUT,
    metrics_interval: float = typer.Option(1.0, help="seconds between KV-usage scrapes of /metrics"),
    seed: int = typer.Option(0, help="seed of which requests disconnect"),
    progress: bool = PROGRESS,
) -> None:
    """A closed loop of C clients for --duration seconds, a share of them going away mid-stream; then
    checks no request failed, the idle KV cache drains to 0, and the probes' greedy outputs are
    unchanged. Exit 1 naming the checks that failed."""
    _check_values("soak", (("--duration", duration, duration > 0, "a positive number of seconds"),
                                   ("--concurrency", concurrency, concurrency >= 1, "an integer >= 1"),
                                   ("--disconnect-share", disconnect_share, 0 <= disconnect_share <= 1,
                                    "a share between 0 and 1"),
                                   ("--output-len", output_len, output_len >= 2, "an integer >= 2"),
                                   ("--disconnect-after", disconnect_after, 1 <= disconnect_after < output_len,
                                    f"an integer from 1 to --output-len - 1 = {output_len - 1}"),
                                   ("--probes", probes, probes >= 1, "an integer >= 1"),
                                   ("--probe-tokens", probe_tokens, probe_tokens >= 1, "an integer >= 1"),
                                   ("--idle-timeout", idle_timeout, idle_timeout >= 0, "a number of seconds >= 0"),
                                   ("--metrics-interval", metrics_interval, metrics_interval > 0,
                                    "a positive number of seconds"),
                                   ("--serve-timeout", serve_timeout, serve_timeout > 0, "a positive number of seconds"),
                                   ("--request-timeout", request_timeout, request_timeout > 0,
                                    "a positive number of seconds"),
                                   ("--seed", seed, seed >= 0, "an integer >= 0")))
    _check_server("soak", url, serve)
    _check_out("soak", out)
    prompt_list = _load_prompts_or_exit("soak", prompts, None, "train", prompt_field)
    if len(prompt_list) < probes:
        _fail(f"--probes {probes} needs as many prompts, but {prompts} has {len(prompt_list)}.", 2, "soak")
    base_url = _base_url(url, serve)
    cfg = SoakConfig(base_url=base_url, duration=duration, concurrency=concurrency, disconnect_share=disconnect_share,
                     disconnect_after=disconnect_after, output_len=output_len, num_probes=probes,
                     probe_tokens=probe_tokens, idle_timeout=idle_timeout, model=model, request_timeout=request_timeout,
                     metrics_interval=metrics_interval, seed=seed, label=out.stem)
    meta = {"serve": serve, "prompt_source": str(prompts), "num_prompts": len(prompt_list)}
    with _one_line_errors("soak", lambda: out), ExitStack() as stack:
        server = _managed_server(stack, serve, base_url, out, serve_timeout)
        doc = run_soak(cfg, prompt_list, out, meta=meta, server_alive=(lambda: server.alive) if server else None,
                       progress=progress)
    s = doc["soak"]
    typer.echo(f"soak: {s['requests']} requests in {s['duration_s']:.0f} s at C = {concurrency} "
               f"({s['disconnected']} closed mid-stream on purpose), {_num(s['output_throughput'])} tok/s over "
               f"those read to the end, KV max {_num(doc['kv_cache_usage']['during']['max'], '.1%')}")
    for name in CHECKS:
        check = doc["checks"][name]
        typer.echo(f"{'PASS' if check['passed'] else 'FAIL'} {name}: {check['detail']}")
    typer.echo(f"results: {out}")
    if doc["failed_checks"]:
        _fail(f"failed check(s): {', '.join(doc['failed_checks'])}", 1, "soak")


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
    from vllm_hybridspec.policy.files import check_output_dir

    try:
        check_output_dir(out_dir, "--out-dir")
        path = write_report(results, out_dir)
    except (OSError, ValueError) as e:
        typer.echo(f"hybridspec report: error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"report: {path}")


def headline(
    plain: str = typer.Option(..., help="plain decoding's result, PATH[,PATH...] (levels merged by concurrency)"),
    hybridspec: str = typer.Option(..., help="HybridSpec's result (per-request lengths, the gate, the routing "
                                   "correction), PATH[,PATH...]"),
    ours_verify_all: str = typer.Option(None, help="ours verifying every draft, PATH[,PATH...]"),
    ours_static: str = typer.Option(None, help="ours at the best static length, PATH[,PATH...]"),
    vllm_verify_all: str = typer.Option(None, help="vLLM's own GDN spec path verifying every draft, PATH[,PATH...]"),
    shape: str = typer.Option(..., help="the target, as headline.json names it (e.g. 'Qwen3.6-35B-A3B shape, "
                              "40 layers, dummy weights, bf16')"),
    profile: str = typer.Option(..., help="the replayed acceptance profile (e.g. paper-dflash-qwen3.6)"),
    draft_len: int = typer.Option(15, "--draft-len", min=1, help="D, draft tokens per round"),
    command: str = typer.Option(..., help="how the results were made (the stage commands), kept in the JSON"),
    out: Path = typer.Option(..., "--out", "-o", help="headline JSON to write"),
    plot_path: Path = typer.Option(None, "--plot", help="also draw each configuration's ratio to plain against C here "
                                   "(PNG)"),
) -> None:
    """headline.json from `hybridspec bench` results: tokens/s per configuration and C, the ratios to plain
    decoding and to vLLM's verify-all, KV capacities, and whether the issue's bars are met."""
    from vllm_hybridspec.bench.headline import build_headline, markdown, write_headline

    from vllm_hybridspec.policy.errors import InputError
    from vllm_hybridspec.policy.files import check_writable

    files = {k: v for k, v in (("plain", plain), ("hybridspec", hybridspec), ("ours_verify_all", ours_verify_all),
                               ("ours_static", ours_static), ("vllm_verify_all", vllm_verify_all)) if v}
    for path, option in ((out, "--out"), (plot_path, "--plot")):
        if path is not None:
            try:
                check_writable(path, option, make_parents=True)
            except InputError as e:
                _fail(str(e), 2, "headline")
    try:
        head = build_headline(files, shape, profile, draft_len, command)
        write_headline(head, out, plot_path)
    except (OSError, ValueError) as e:
        _fail(f"{e}", 2, "headline")
    typer.echo(markdown(head), nl=False)
    typer.echo(f"headline: {out}" + (f", {plot_path}" if plot_path else ""))
