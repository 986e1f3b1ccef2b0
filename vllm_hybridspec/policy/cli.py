"""``hybridspec calibrate {fit,synth}`` and ``hybridspec simulate``.

Bad input files end the command with exit status 2 and one message naming the file, line or field.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .errors import InputError

calibrate_app = typer.Typer(help="Fit the verification-length policy (or make synthetic records).",
                            no_args_is_help=True, pretty_exceptions_enable=False)


def fail(err: Exception) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(2)


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
        rounds = Rounds.from_records(load_records(records))
        policy, notes = fit_policy(rounds, load_costs(costs), min_length,
                                   {"records": str(records), "costs": str(costs)})
    except InputError as e:
        raise fail(e) from None
    save_policy(policy, out)
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
    seed: int = typer.Option(0),
    costs_out: Path | None = typer.Option(None, help="also write a matching cost file here"),
    no_routing: bool = typer.Option(False, help="leave out the expert counts"),
) -> None:
    """Synthetic capture-run records whose acceptance depends on confidence (with p_true)."""
    from .records import save_records
    from .synthetic import synthesize, synthetic_costs

    recs = synthesize(rounds, draft_len, seed, routing=not no_routing)
    save_records(recs, out)
    typer.echo(f"wrote {len(recs)} rounds to {out}")
    if costs_out is not None:
        costs_out.write_text(json.dumps(synthetic_costs(draft_len), indent=1) + "\n")
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
    from .policy_file import Policy
    from .records import Rounds, load_records
    from .simulate import format_report, plot_report, simulate, simulate_batched

    try:
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
        plot_report(report, str(plot))
        if not as_json:
            typer.echo(f"wrote {plot}")
