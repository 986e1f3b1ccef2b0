"""``hybridspec models``: registered on the ``hybridspec`` typer app in ``vllm_hybridspec/cli.py``."""

from __future__ import annotations

from pathlib import Path

import typer

STAGES = ("corpus", "targets", "prompts", "drafters", "evaluate", "accept")


def models(
    out_dir: Path = typer.Option(Path("models"), help="Where the committed models go"),
    work_dir: Path = typer.Option(Path("out/models-work"), help="Captured data and optimizer checkpoints"),
    stage: list[str] = typer.Option(list(STAGES), help=f"Stages to run, in order: {', '.join(STAGES)}"),
    steps: int = typer.Option(2000, min=1, help="Pretraining steps per target"),
    max_minutes: float = typer.Option(None, help="Stop each target's pretraining after this long"),
    stdlib_root: Path = typer.Option(None, help="The corpus's standard library (default: this Python's); "
                                     "files that differ from split.json's are left out"),
    force: bool = typer.Option(False, help="Redo stages whose outputs exist"),
    seed: int = typer.Option(0, min=0),
) -> None:
    """Build the reference models from scratch: corpus, tokenizer, hybrid and dense targets, H-Spec and
    DFlash drafters for each, acceptance on held-out prompts and capture records (see train/reference/pipeline.py)."""
    from vllm_hybridspec.train.reference.pipeline import BuildSpec, build_all
    from vllm_hybridspec.train.reference.pretrain import PretrainSpec

    import math

    from vllm_hybridspec.tools.engine_args import output_path

    bad = [s for s in stage if s not in STAGES]
    if bad:
        raise typer.BadParameter(f"--stage {bad[0]!r} is not a stage; valid stages are {', '.join(STAGES)}")
    if max_minutes is not None and not (math.isfinite(max_minutes) and max_minutes > 0):
        raise typer.BadParameter(f"--max-minutes {max_minutes:g} is not valid; expected a positive number of minutes")
    if stdlib_root is not None and not (stdlib_root / "os.py").is_file():
        raise typer.BadParameter(f"--stdlib-root {stdlib_root} has no os.py; expected a Python standard library "
                                 "directory such as /usr/lib/python3.12")
    output_path(out_dir, "--out-dir", directory=True)
    output_path(work_dir, "--work-dir", directory=True)
    spec = BuildSpec(
        out_dir=str(out_dir),
        work_dir=str(work_dir),
        seed=seed,
        stdlib_root=str(stdlib_root) if stdlib_root else None,
        pretrain=PretrainSpec(steps=steps, max_minutes=max_minutes, seed=seed),
    )
    build_all(spec, [s for s in STAGES if s in stage], force)
