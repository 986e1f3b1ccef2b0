"""The ``hybridspec`` command line."""

from __future__ import annotations

import typer

from vllm_hybridspec.bench.cli import bench, report, soak
from vllm_hybridspec.policy.cli import calibrate_app, simulate_command
from vllm_hybridspec.tools import calibrate as _calibrate_vllm  # noqa: F401  (adds capture, costs)
from vllm_hybridspec.tools.checks import check_app
from vllm_hybridspec.tools.compare import compare
from vllm_hybridspec.tools.compare_report import compare_report
from vllm_hybridspec.tools.evaluate import evaluate_command
from vllm_hybridspec.tools.full_shape import full_shape
from vllm_hybridspec.tools.kernels.cli import kernels_app
from vllm_hybridspec.tools.plots import plot_rounds
from vllm_hybridspec.tools.profile import profile_command
from vllm_hybridspec.tools.replay_record import replay_record
from vllm_hybridspec.tools.spec_steps import spec_steps, spec_steps_table_command
from vllm_hybridspec.train.cli import train
from vllm_hybridspec.train.reference.cli import models

app = typer.Typer(
    name="hybridspec",
    help="vllm-hybridspec: fast, exact speculative decoding for hybrid GDN-MoE models in vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # usage errors as one plain line ("Error: Invalid value: ..."), not a wrapped panel
)


@app.callback()
def _root() -> None:
    """Keep `hybridspec` a command group even while it has a single command."""


@app.command()
def demo(
    kind: str = typer.Option("hybrid", help="reference target to serve: hybrid (Qwen3-Next) or dense (Qwen3)"),
    num_prompts: int = typer.Option(8, help="held-out prompts served"),
    max_tokens: int = typer.Option(48, help="greedy tokens per prompt"),
    serve: bool = typer.Option(True, help="run the vLLM serving part (--no-serve: kernels only)"),
    max_len: int = typer.Option(16, help="kernel round: verification length u (2..16)"),
    batch: int = typer.Option(3, help="kernel round: sequences verified together"),
    layers: int = typer.Option(3, help="kernel round: GDN layers committed in one launch"),
    seed: int = typer.Option(0),
) -> None:
    """Serve a reference model through vLLM with its H-Spec drafter and check the output equals plain
    decoding; then verify and commit one GDN round with the kernels against the reference."""
    from vllm_hybridspec.tools.demo import run_gdn_round_demo, run_serving_demo

    if kind not in ("hybrid", "dense"):
        raise typer.BadParameter(f"--kind must be hybrid or dense, got {kind!r}")
    ok = run_serving_demo(kind, num_prompts, max_tokens) if serve else True
    ok = run_gdn_round_demo(max_len=max_len, batch=batch, layers=layers, seed=seed) and ok
    raise typer.Exit(0 if ok else 1)


app.add_typer(calibrate_app, name="calibrate")
app.add_typer(kernels_app, name="kernels")
app.command("compare")(compare)
app.command("compare-report")(compare_report)
app.add_typer(check_app, name="check")
app.command("profile")(profile_command)
app.command("plot-rounds")(plot_rounds)
app.command("evaluate")(evaluate_command)
app.command("spec-steps")(spec_steps)
app.command("spec-steps-table")(spec_steps_table_command)
app.command("full-shape")(full_shape)
app.command("simulate")(simulate_command)
app.command("train")(train)
app.command("models")(models)
app.command("bench")(bench)
app.command("soak")(soak)
app.command("report")(report)
app.command("replay-record")(replay_record)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
