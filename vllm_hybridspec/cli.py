"""The ``hybridspec`` command line."""

from __future__ import annotations

from pathlib import Path

import typer
from typer.core import TyperGroup

try:  # typer >= 0.29 vendors click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer on click
    from click import exceptions as click_errors

from vllm_hybridspec.bench.cli import bench, headline, report, soak
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


class OneLineUsageErrors(TyperGroup):
    """Usage errors (a bad option value, a missing or unknown option) as one line on stderr, exit 2:
    ``hybridspec bench: error: --num-requests '0': Input should be greater than or equal to 1``.
    Click's own form is three lines (usage, hint, error) and leaves out the value given."""

    def invoke(self, ctx):
        argv = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        try:
            return super().invoke(ctx)
        except click_errors.NoArgsIsHelpError:
            raise
        except click_errors.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else ctx.command_path
            typer.echo(f"{where}: error: {usage_message(e, argv)}", err=True)
            raise typer.Exit(e.exit_code) from None


def usage_message(error, argv: list[str]) -> str:
    """``error``'s message in one line, with the option's value from ``argv`` where there was one."""
    param = getattr(error, "param", None)
    if isinstance(error, click_errors.MissingParameter) or not isinstance(error, click_errors.BadParameter):
        return " ".join(error.format_message().split())
    message = " ".join(error.message.split())
    if param is None or not getattr(param, "opts", None):
        return message
    name = next((o for o in param.opts if o.startswith("--")), param.opts[0])
    given = [v for i, a in enumerate(argv) for v in
             ([argv[i + 1]] if a in param.opts and i + 1 < len(argv) else
              [a.split("=", 1)[1]] if "=" in a and a.split("=", 1)[0] in param.opts else [])]
    got = f" {given[-1]!r}" if given and not getattr(param, "is_flag", False) else ""
    return f"{name}{got}: {message}"


app = typer.Typer(
    name="hybridspec",
    cls=OneLineUsageErrors,
    help="vllm-hybridspec: fast, exact speculative decoding for hybrid GDN-MoE models in vLLM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help text, not rich panels
)


@app.callback()
def _root() -> None:
    """Keep `hybridspec` a command group even while it has a single command."""


@app.command()
def demo(
    kind: str = typer.Option("hybrid", help="reference target to serve: hybrid (Qwen3-Next) or dense (Qwen3)"),
    num_prompts: int = typer.Option(8, min=1, help="held-out prompts served"),
    max_tokens: int = typer.Option(48, min=1, help="greedy tokens per prompt"),
    serve: bool = typer.Option(True, help="run the vLLM serving part (--no-serve: kernels only)"),
    max_len: int = typer.Option(16, min=2, max=16, help="kernel round: verification length u (2..16)"),
    batch: int = typer.Option(3, min=1, help="kernel round: sequences verified together"),
    layers: int = typer.Option(3, min=1, help="kernel round: GDN layers committed in one launch"),
    seed: int = typer.Option(0, min=0),
    json_out: Path | None = typer.Option(None, "--json", help="also write the serving table as JSON: "
                                         '{"rows": [{"config", "ratio_all_at_once", "ratio_one_at_a_time", '
                                         '"identical", ...}]}'),
) -> None:
    """Serve a reference model through vLLM: plain decoding, then H-Spec with the drafter's shipped
    length policy (its lengths and batch gate) and with every draft verified, each checked token for
    token against plain decoding; then verify and commit one GDN round with the kernels against the
    reference."""
    from vllm_hybridspec.tools.demo import run_gdn_round_demo, run_serving_demo
    from vllm_hybridspec.tools.engine_args import output_path

    if kind not in ("hybrid", "dense"):
        raise typer.BadParameter(f"--kind must be hybrid or dense, got {kind!r}")
    if json_out is not None and not serve:
        raise typer.BadParameter("--json writes the serving table, which --no-serve leaves out")
    output_path(json_out, "--json", make_parents=False)
    ok = run_serving_demo(kind, num_prompts, max_tokens, json_out=json_out) if serve else True
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
app.command("headline")(headline)
app.command("replay-record")(replay_record)


def main() -> None:  # pragma: no cover - console entry point
    app(prog_name="hybridspec")


if __name__ == "__main__":  # pragma: no cover
    main()
