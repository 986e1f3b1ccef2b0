"""``hybridspec calibrate {fit,synth}`` and ``hybridspec simulate``.

Bad input files, and outputs that cannot be written, end the command with exit status 2 and one
line naming the file, line or field; outputs are checked before the work and written atomically,
so a failed command writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .errors import InputError

calibrate_app = typer.Typer(help="Fit the verification-length policy (or make synthetic records).",
                            no_args_is_help=True, pretty_exceptions_enable=False)


PLOT_FORMATS = (".png", ".pdf", ".svg")


def fail(err: Exception) -> typer.Exit:
    message = "; ".join(line for line in str(err).splitlines() if line.strip())
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def check_outputs(**paths: Path | None) -> None:
    """Refuse unwritable outputs (keyword: the option's name) before any slow work."""
    from .files import check_writable

    for option, path in paths.items():
        if path is not None:
            check_writable(path, "--" + option.replace("_", "-"))


@calibrate_app.command("fit")
def fit(
    records: Path = typer.Option(..., help="capture-run records, JSONL (see docs/policy.md)"),
    costs: Path = typer.Option(..., help="measured costs, JSON (see docs/policy.md)"),
    out: Path = typer.Option(..., help="policy file to write"),
    min_length: int = typer.Option(2, help="shortest nominal length: 2 (paper) or 1 (no draft token)"),
) -> None:
    """Fit acceptance model, cost curve, s, eta, expert tables and the rate rho into a policy file."""
    from .calibrate import fit_policy
    from .cost import load_costs
    from .policy_file import save_policy
    from .records import Rounds, load_records

    try:
        check_outputs(out=out)
        rounds = Rounds.from_records(load_records(records))
        policy, notes = fit_policy(rounds, load_costs(costs), min_length,
                                   {"records": str(records), "costs": str(costs)})
        save_policy(policy, out)
    except (InputError, OSError) as e:
        raise fail(e) from None
    for n in notes:
        typer.echo(f"note: {n}", err=True)
    routing = "with" if policy.routing else "without"
    typer.echo(f"wrote {out}: D = {policy.draft_len}, rho = {policy.rate:.5f} tokens/ms, "
               f"{routing} routing correction, batched B = {sorted(policy.batched) or 'none'}, "
               f"from {policy.fit['untruncated_rounds']} of {policy.fit['rounds']} rounds")


@calibrate_app.command("synth")
def synth(
    out: Path = typer.Option(..., help="records file to write (JSONL)"),
    rounds: int = typer.Option(20000, min=1, help="number of rounds"),
    draft_len: int = typer.Option(15, min=2, help="D, draft tokens per round"),
    seed: int = typer.Option(0, min=0),
    costs_out: Path | None = typer.Option(None, help="also write a matching cost file here"),
    no_routing: bool = typer.Option(False, help="leave out the expert counts"),
) -> None:
    """Synthetic capture-run records whose acceptance depends on confidence (with p_true)."""
    from .files import write_text_atomic
    from .records import save_records
    from .synthetic import synthesize, synthetic_costs

    try:
        check_outputs(out=out, costs_out=costs_out)
        recs = synthesize(rounds, draft_len, seed, routing=not no_routing)
        save_records(recs, out)
        if costs_out is not None:
            write_text_atomic(costs_out, json.dumps(synthetic_costs(draft_len), indent=1) + "\n")
    except (InputError, OSError) as e:
        raise fail(e) from None
    typer.echo(f"wrote {len(recs)} rounds to {out}")
    if costs_out is not None:
        typer.echo(f"wrote {costs_out}")


def simulate_command(
    records: Path = typer.Option(..., help="capture-run records, JSONL"),
    policy: Path = typer.Option(..., help="policy file from `hybridspec calibrate fit`"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    plot: Path | None = typer.Option(None, help="write a PNG of throughputs and lengths"),
    batch: int | None = typer.Option(None, min=1, help="also simulate the batched variant with "
                                                         "B requests per round"),
) -> None:
    """Replay recorded rounds: pooled throughput, mean length and AL of each length policy."""
    from .files import atomic_path
    from .policy_file import Policy
    from .records import Rounds, load_records
    from .simulate import format_report, plot_report, simulate, simulate_batched

    try:
        check_outputs(plot=plot)
        if plot is not None and plot.suffix.lower() not in PLOT_FORMATS:
            raise InputError(f"--plot '{plot}' has suffix '{plot.suffix}'; the image format "
                             f"comes from it: use one of {', '.join(PLOT_FORMATS)}")
        pol = Policy.load(policy, "cpu", None)
        rounds = Rounds.from_records(load_records(records))
        report = simulate(rounds, pol)
        batched = simulate_batched(rounds, pol, batch) if batch else None
    except InputError as e:
        raise fail(e) from None
    if as_json:
        out = report.as_dict()
        if batched:
            out["batched"] = batched.as_dict()
        typer.echo(json.dumps(out, indent=1))
    else:
        typer.echo(format_report(report))
        if batched:
            typer.echo("\n" + format_report(batched))
    if plot is not None:
        try:
            with atomic_path(plot) as tmp:
                plot_report(report, str(tmp))
        except OSError as e:
            raise fail(e) from None
        if not as_json:
            typer.echo(f"wrote {plot}")
