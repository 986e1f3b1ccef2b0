"""The ``hybridspec`` command line."""

from __future__ import annotations

import typer

from vllm_hybridspec.bench.cli import bench, report
from vllm_hybridspec.policy.cli import calibrate_app, simulate_command
from vllm_hybridspec.train.cli import train
from vllm_hybridspec.train.reference.cli import models

app = typer.Typer(
    name="hybridspec",
    help="vllm-hybridspec: fast, exact speculative decoding for hybrid GDN-MoE models in vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Keep `hybridspec` a command group even while it has a single command."""


@app.command()
def demo(
    max_len: int = typer.Option(16, help="verification length u (tokens of the target input, 2..16)"),
    batch: int = typer.Option(3, help="number of sequences verified together"),
    layers: int = typer.Option(3, help="GDN layers committed in one launch"),
    seed: int = typer.Option(0),
) -> None:
    """Verify and commit one speculative round through GDN layers on the CPU, checked against the
    token-by-token reference (Triton kernels run in the interpreter when no GPU is present)."""
    from vllm_hybridspec.demo import run_gdn_round_demo

    ok = run_gdn_round_demo(max_len=max_len, batch=batch, layers=layers, seed=seed)
    raise typer.Exit(0 if ok else 1)


app.add_typer(calibrate_app, name="calibrate")
app.command("simulate")(simulate_command)
app.command("train")(train)
app.command("models")(models)
app.command("bench")(bench)
app.command("report")(report)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
