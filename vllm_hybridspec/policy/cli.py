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
    min_length: int = typer.Option(2, min=1, max=2, help="shortest nominal length: 2 (paper) or 1 (no draft token)"),
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
    out: Path = typer.Option(..., help="records file to write (JSONL, gzip-compressed if *.gz)"),
    rounds: int = typer.Option(20000, min=1, help="number of rounds"),
    draft_len: int | None = typer.Option(None, min=2, help="D, draft tokens per round (default 15, "
                                                           "or the profile's)"),
    seed: int = typer.Option(0, min=0),
    profile: str | None = typer.Option(None, help="a named acceptance profile (docs/policy.md), "
                                                  "e.g. paper-dflash-qwen3.6; prints what it wrote"),
    costs_out: Path | None = typer.Option(None, help="also write a matching cost file here"),
    summary_out: Path | None = typer.Option(None, help="with --profile: also write its parameters, "
                                                       "the command and the statistics (JSON)"),
    no_routing: bool = typer.Option(False, "--no-routing", help="leave out the expert counts"),
) -> None:
    """Synthetic capture-run records (with p_true): the default generator, whose acceptance depends
    on confidence, or a named profile that reproduces a published drafter's acceptance."""
    from .files import write_text_atomic
    from .profiles import get_profile, synthesize_profile
    from .records import Rounds, save_records
    from .stats import format_stats, record_stats
    from .synthetic import synthesize, synthetic_costs

    try:
        prof = get_profile(profile) if profile is not None else None
        if prof is not None and draft_len not in (None, prof.draft_len):
            raise InputError(f"--draft-len {draft_len} does not match profile '{profile}', which "
                             f"has D = {prof.draft_len}; leave --draft-len out")
        if prof is None and summary_out is not None:
            raise InputError("--summary-out describes a profile; give --profile as well")
        check_outputs(out=out, costs_out=costs_out, summary_out=summary_out)
        d = prof.draft_len if prof else draft_len or 15
        if prof is None:
            recs = synthesize(rounds, d, seed, routing=not no_routing)
        else:
            recs = synthesize_profile(prof, rounds, seed, routing=not no_routing)
            stats = record_stats(Rounds.from_records(recs))
        save_records(recs, out)
        if costs_out is not None:
            k = prof.experts_per_token if prof else 8
            write_text_atomic(costs_out, json.dumps(synthetic_costs(d, k), indent=1) + "\n")
        if summary_out is not None:
            command = (f"hybridspec calibrate synth --profile {profile} --out {out} "
                       f"--rounds {rounds} --seed {seed}" + (" --no-routing" if no_routing else ""))
            summary = {"profile": profile, "parameters": prof.model_dump(), "command": command,
                       "seed": seed, "statistics": stats.as_dict(),
                       "printed": format_stats(stats).splitlines()}
            write_text_atomic(summary_out, json.dumps(summary, indent=1) + "\n")
    except (InputError, OSError) as e:
        raise fail(e) from None
    typer.echo(f"wrote {len(recs)} rounds to {out}")
    if prof is not None:
        typer.echo(f"profile {profile}: {prof.description}")
        typer.echo(format_stats(stats))
    for extra in (costs_out, summary_out):
        if extra is not None:
            typer.echo(f"wrote {extra}")


@calibrate_app.command("stats")
def stats_command(
    records: Path = typer.Option(..., help="capture-run records, JSONL"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Measured acceptance of a records file: AL, per-position acceptance, confidence AUC and
    calibration (the definitions are in docs/policy.md)."""
    from .records import Rounds, load_records
    from .stats import format_stats, record_stats

    try:
        stats = record_stats(Rounds.from_records(load_records(records)))
    except InputError as e:
        raise fail(e) from None
    typer.echo(json.dumps(stats.as_dict(), indent=1) if as_json else format_stats(stats))


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


def _register_time_selector() -> None:
    from .timing import time_selector

    calibrate_app.command("time-selector")(time_selector)


_register_time_selector()
