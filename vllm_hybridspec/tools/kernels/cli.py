"""``hybridspec kernels``: the GDN-kernel benchmarks (timings on CUDA; accuracy checks on any device).

    hybridspec kernels compare --out gdn_kernels.md --json gdn_kernels.json   # ours vs vLLM 0.26 vs fla
    hybridspec kernels render gdn_kernels.json --out gdn_kernels.md          # the report again, from JSON
    hybridspec kernels fused --json fused_round.json                         # fused lazy commit vs unfused
    hybridspec kernels fused --tune --lengths 2,8,16 --json tune.json        # the fused round's launch sweep
    hybridspec kernels tune --out tune.jsonl                                 # launch sweep of each part
    hybridspec kernels profile --batch 1 --length 16                         # one round per kernel, for ncu
    hybridspec kernels draft-round --batches 1,4,16,64 --json draft_round.json  # the H-Spec drafting round
    hybridspec kernels spec-conv --json spec_conv.json                        # the one-launch spec-step conv

Without the package installed (a bare GPU machine, ``examples/device_setup.sh``): ``python3 -m
vllm_hybridspec.cli kernels ...``. What each measures: the docstrings of :mod:`.gdn_compare`,
:mod:`.fused_round`, :mod:`.tune`, :mod:`.profile`, :mod:`.draft_round` and :mod:`.spec_conv`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from vllm_hybridspec.tools.engine_args import int_list, output_path, scale_list

kernels_app = typer.Typer(help="Kernel benchmarks: the GDN kernels against vLLM and fla, the fused lazy commit, "
                               "launch sweeps, profiling, the H-Spec drafting round (timings need CUDA; the GDN "
                               "accuracy checks run anywhere).",
                          no_args_is_help=True)

SHAPE = typer.Option("35b", help="35b (Qwen3.6-35B-A3B: 30 layers, 16 key / 32 value heads, 128 x 128 "
                                 "states) or tiny (2 layers, 2 / 4 heads, 32 x 32: seconds on the CPU)")
NO_CUDA = "timing needs a CUDA device, none here"


def _shape(name: str):
    from .shapes import SHAPES

    if name not in SHAPES:
        raise typer.BadParameter(f"--shape must be one of {', '.join(SHAPES)}, got {name!r}")
    return SHAPES[name]


def _lengths(text: str) -> list[int]:
    from vllm_hybridspec.kernels.gdn import MAX_VERIFY_LEN

    values = int_list(text, "lengths")
    if max(values) > MAX_VERIFY_LEN:
        raise typer.BadParameter(f"--lengths must be in 1..{MAX_VERIFY_LEN}, got {text!r}")
    return values


def _output(path: Path | None, option: str) -> None:
    """An output file checked before the run (which can take minutes on the GPU, hours through the
    interpreter): not a directory, in an existing writable directory (the commands make none)."""
    output_path(path, option, make_parents=False)


def _power_of_two(value: int, option: str, low: int = 1, high: int | None = None, why: str = "") -> int:
    if value < low or value & (value - 1) or (high is not None and value > high):
        bounds = f" in {low}..{high}" if high is not None else f" >= {low}" if low > 1 else ""
        raise typer.BadParameter(f"{option} must be a power of two{bounds}{why}, got {value}")
    return value


def _launch(BV: int, BK: int, num_warps: int, precision: str) -> dict:
    """``kernels profile``'s launch settings of the verify kernel, checked before the rounds are built
    (Triton's compiler would refuse them later, on the GPU only, as a traceback): the block sizes enter
    ``tl.arange``, which takes powers of two, ``BK`` is the reduction dimension of ``tl.dot`` (at least
    16 on NVIDIA GPUs), and Triton launches a power of two of warps, at most 32 in a CUDA block."""
    from vllm_hybridspec.kernels.gdn.verify import PRECISIONS

    _power_of_two(BV, "--BV")
    _power_of_two(BK, "--BK", low=16, why=" (the reduction dimension of tl.dot)")
    _power_of_two(num_warps, "--num-warps", high=32)
    if precision not in PRECISIONS:
        raise typer.BadParameter(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return dict(BV=BV, BK=BK, num_warps=num_warps, precision=precision)


def _needs_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        typer.echo(f"{what}: {NO_CUDA}", err=True)
        raise typer.Exit(2)


def _cpu_notice() -> None:
    """Say up front what a run without CUDA does (the 35B shape through the interpreter takes long)."""
    import os

    import torch

    if not torch.cuda.is_available():
        interpret = "" if os.environ.get("TRITON_INTERPRET") == "1" else " (set TRITON_INTERPRET=1)"
        typer.echo(f"no CUDA device: only the accuracy check runs, through Triton's interpreter{interpret}; "
                   "--shape tiny takes seconds, the 35B shape a long time")


def _write(path: Path, text: str) -> None:
    """Beside ``path`` and renamed: a run stopped while writing leaves the earlier file, not half of it."""
    from vllm_hybridspec.policy.files import write_text_atomic

    write_text_atomic(path, text)
    typer.echo(f"wrote {path}")


def _write_json(path: Path | None, data) -> None:
    if path is not None:
        _write(path, json.dumps(data, indent=1))


@kernels_app.command("compare")
def compare(
    shape: str = SHAPE,
    out: Path | None = typer.Option(None, help="markdown report to write"),
    json_out: Path | None = typer.Option(None, "--json", help="raw results to write (`render` re-renders them)"),
    samples: int = typer.Option(30, min=3, help="timed samples of 10 graph replays per variant"),
    lengths: str = typer.Option("2,3,4,8,12,16", help="round lengths w, comma-separated"),
    batches: str = typer.Option("1,4", help="sequences per round B, comma-separated"),
    tune: bool = typer.Option(True, help="choose the launch configuration in this run (--no-tune: the "
                                         "library defaults)"),
    tune_recurrent: bool = typer.Option(False, "--tune-recurrent", help="choose the recurrent verify kernel's launch "
                                                    "configuration in this run"),
    ours_only: bool = typer.Option(False, "--ours-only", help="only our kernels (no vLLM or fla needed): for tuning"),
) -> None:
    """Verification + commit of every GDN layer as one CUDA graph: ours vs vLLM 0.26's spec-decode
    kernel vs fla, against the bandwidth and launch floors, after an accuracy check against vLLM and
    float64. Without CUDA: the accuracy check only."""
    from . import gdn_compare, report

    sh, ws, bs = _shape(shape), _lengths(lengths), int_list(batches, "batches")
    _output(out, "--out")
    _output(json_out, "--json")
    _cpu_notice()
    result = gdn_compare.run(sh, ws, bs, samples=samples, tune=tune, tune_recurrent=tune_recurrent,
                             ours_only=ours_only)
    flags = {"--no-tune": not tune, "--tune-recurrent": tune_recurrent, "--ours-only": ours_only,
             f"--out {out}": out, f"--json {json_out}": json_out}
    result["meta"]["command"] = " ".join(
        [f"hybridspec kernels compare --shape {shape} --lengths {lengths} --batches {batches} --samples {samples}"]
        + [flag for flag, given in flags.items() if given])
    failed = result.pop("failed")
    _write_json(json_out, dict(result, results=report.raw_results(result["results"])))
    if result["results"] and out is not None:
        _write(out, report.render_markdown(result["meta"], result["accuracy"], result["results"]))
    if failed:
        typer.echo(f"ACCURACY CHECK FAILED at (kernel, w, B) = {failed}", err=True)
        raise typer.Exit(1)
    if not result["results"]:
        against = "the float64 reference" + ("" if ours_only else " and vLLM's kernel")
        typer.echo(f"accuracy check passed (ours against {against}, through Triton's interpreter); "
                   f"{NO_CUDA}" + ("; no report written" if out else ""))
    typer.echo(f"done in {result['meta']['seconds']:.0f} s")


@kernels_app.command("render")
def render(
    run_json: Path = typer.Argument(..., exists=True, dir_okay=False, help="the --json of a `compare` run"),
    out: Path | None = typer.Option(None, help="markdown report to write [default: stdout]"),
) -> None:
    """The markdown report of a `compare` run again, from its JSON (derived columns under the
    library's current rule)."""
    from .report import render_file

    _output(out, "--out")
    try:
        text = render_file(run_json)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        typer.echo(f"cannot render {run_json}: {e}", err=True)
        raise typer.Exit(2) from None
    if out is None:
        typer.echo(text, nl=False)
    else:
        _write(out, text)


@kernels_app.command("fused")
def fused(
    shape: str = SHAPE,
    batches: str = typer.Option("1,4", help="sequences per round B, comma-separated"),
    lengths: str = typer.Option("1,2,4,8,16", help="round lengths w, comma-separated"),
    samples: int = typer.Option(30, min=3, help="timed samples per variant"),
    replays: int = typer.Option(10, min=1, help="graph replays per sample"),
    json_out: Path | None = typer.Option(None, "--json", help="where to write the accuracy, the timings and "
                                                              "the run's meta"),
    tune: bool = typer.Option(False, "--tune", help="time the fused round at every launch candidate (no accuracy "
                                          "check, CUDA only)"),
) -> None:
    """One round of every GDN layer as one CUDA graph: the fused lazy commit + verification against
    the unfused verify + commit, with the bandwidth and launch floors, after a float64 accuracy check.
    Without CUDA: the accuracy check only."""
    from . import fused_round

    sh, bs, ws = _shape(shape), int_list(batches, "batches"), _lengths(lengths)
    _output(json_out, "--json")
    if tune:
        _needs_cuda("kernels fused --tune")
        from .tune import tune_fused

        _write_json(json_out, tune_fused(sh, bs, ws, samples, replays))
        return
    _cpu_notice()
    result = fused_round.run(sh, bs, ws, samples, replays)
    result["meta"]["command"] = (f"hybridspec kernels fused --shape {shape} --batches {batches} --lengths "
                                 f"{lengths} --samples {samples} --replays {replays}"
                                 + (f" --json {json_out}" if json_out else ""))
    _write_json(json_out, result)
    if result["failed"]:
        typer.echo(f"accuracy check FAILED for {result['failed']}; nothing timed", err=True)
        raise typer.Exit(1)
    if not result["rows"]:
        typer.echo(f"accuracy check passed; {NO_CUDA}")
        return
    meta = result["meta"]
    typer.echo(f"{meta['device']}: copy bandwidth {meta['copy_bandwidth_TBps']:.2f} TB/s, launch floor "
               f"{meta['launch_floor_ms']:.4f} ms; times in ms per round of {shape} ({sh.layers} layers)")
    typer.echo(fused_round.format_table(result["rows"]))


@kernels_app.command("tune")
def tune(
    out: Path = typer.Option(..., help="JSON lines, one per measurement"),
    shape: str = SHAPE,
    samples: int = typer.Option(15, min=3, help="timed samples of 10 graph replays per candidate"),
) -> None:
    """Launch sweep of the commit, the chunkwise verify and the recurrent verify alone, each at the
    lengths and batches where the comparison misses its targets (CUDA only)."""
    sh = _shape(shape)
    _output(out, "--out")
    _needs_cuda("kernels tune")
    from .tune import sweep_parts

    sweep_parts(sh, out, samples)


@kernels_app.command("profile")
def profile(
    shape: str = SHAPE,
    batch: int = typer.Option(1, "--batch", "-B", min=1, help="sequences per round"),
    length: int = typer.Option(16, "--length", "-w", min=1, max=16, help="round length w"),
    BV: int = typer.Option(64, "--BV", help="value rows per program (a power of two)"),
    BK: int = typer.Option(64, "--BK", help="key chunk (a power of two >= 16)"),
    num_warps: int = typer.Option(4, help="warps per program (a power of two, at most 32)"),
    precision: str = typer.Option("tf32x3", help="tl.dot input precision: tf32x3, tf32, ieee or auto (tf32x3 "
                                  "for fp32 inputs, tf32 for bf16)"),
    rounds: int = typer.Option(4, min=1, help="rounds of verify + commit"),
) -> None:
    """A few rounds of our verify + commit (one layer) for Nsight Compute, then the verify kernel's
    registers and spills."""
    from .profile import profile as run_profile

    sh, launch = _shape(shape), _launch(BV, BK, num_warps, precision)
    kernels = run_profile(sh, batch, length, launch, rounds=rounds)
    for regs, spills in kernels:
        typer.echo(f"verify kernel: registers {regs} spills {spills}")
    if not kernels:
        typer.echo(f"{rounds} rounds run; no compiled kernel metadata (Triton's interpreter, or none "
                   "reported)")


@kernels_app.command("draft-round")
def draft_round(
    batches: str = typer.Option("1,4,16,64", help="requests per round B, comma-separated"),
    capacity: int = typer.Option(512, min=1, help="prefix K/V slots per request"),
    samples: int = typer.Option(20, min=3, help="timed samples per part"),
    replays: int = typer.Option(5, min=1, help="graph replays per sample"),
    tune: bool = typer.Option(False, "--tune", help="time the fused heads at every launch candidate first and use "
                                          "the fastest per B"),
    candidates: int = typer.Option(8, min=1, help="candidate previous tokens per position of the candidate heads"),
    markov_scales: str = typer.Option("", help="also time the candidate heads with the Markov bias scaled by each "
                                      "of these factors (comma-separated, e.g. 0.25,0.1): random weights' bias is "
                                      "as large as the logits, a trained head's a correction"),
    json_out: Path | None = typer.Option(None, "--json", help="where to write the rows, the sweep and the meta"),
) -> None:
    """One H-Spec drafting round at the Qwen3.6-35B-A3B shape (vLLM-free, random bf16 weights): the
    drafter's layers, the LM head, the Markov heads as torch ops, as the fused kernel and through
    candidate previous tokens, the whole round, each one CUDA graph, against the weight-read floor
    (CUDA only)."""
    bs = int_list(batches, "batches")
    scales = tuple(scale_list(markov_scales, "markov-scales")) if markov_scales else ()
    _output(json_out, "--json")
    _needs_cuda("kernels draft-round")
    from . import draft_round as dr

    result = dr.run(bs, capacity, samples, replays, tune, candidates=candidates, markov_scales=scales)
    result["meta"]["command"] = (f"hybridspec kernels draft-round --batches {batches} --capacity {capacity} "
                                 f"--samples {samples} --replays {replays} --candidates {candidates}"
                                 + (f" --markov-scales {markov_scales}" if markov_scales else "")
                                 + (" --tune" if tune else "")
                                 + (f" --json {json_out}" if json_out else ""))
    _write_json(json_out, result)
    if result["failed"]:
        typer.echo("heads check FAILED: " + "; ".join(result["failed"][:5]), err=True)
        raise typer.Exit(1)
    typer.echo(f"ms per round, {result['meta']['device']}, read bandwidth "
               f"{result['meta']['read_bandwidth_TBps']:.2f} TB/s, capacity {capacity}")
    typer.echo(dr.format_table(result["rows"]))


@kernels_app.command("spec-conv")
def spec_conv(
    batches: str = typer.Option("1,4,16", help="requests per step B, comma-separated"),
    lengths: str = typer.Option("2,16", help="tokens per round, comma-separated (16 = K + 1 of a full-graph step)"),
    conv_dim: int = typer.Option(8192, min=1, help="channels (Qwen3.6-35B-A3B: 2 x 16 x 128 + 32 x 128)"),
    width: int = typer.Option(4, min=2, help="the convolution's kernel size K_conv"),
    layers: int = typer.Option(9, min=1, help="GDN layers per step, for the per-step saving (the 12-layer slice: 9)"),
    samples: int = typer.Option(20, min=3, help="timed samples per variant"),
    replays: int = typer.Option(20, min=1, help="graph replays per sample"),
    json_out: Path | None = typer.Option(None, "--json", help="where to write the timings and the run's meta"),
) -> None:
    """The one-slot layer's spec-step convolution of one GDN layer: the one-launch kernel against the
    torch ops it replaced, each a CUDA graph, after checking that they agree (CUDA only)."""
    bs, ls = int_list(batches, "batches"), int_list(lengths, "lengths")
    _output(json_out, "--json")
    _needs_cuda("kernels spec-conv")
    from . import spec_conv as bench

    result = bench.run(bs, ls, conv_dim, width, samples, replays, layers)
    result["meta"]["command"] = (f"hybridspec kernels spec-conv --batches {batches} --lengths {lengths} "
                                 f"--conv-dim {conv_dim} --width {width} --layers {layers}"
                                 + (f" --json {json_out}" if json_out else ""))
    _write_json(json_out, result)
