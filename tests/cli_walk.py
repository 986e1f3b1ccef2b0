"""The ``hybridspec`` command line as data: every command (sub-apps included) and its options, read from
typer's click tree, for the tests that check every option is validated (tests/test_inputs_audit.py,
tests/tools/test_inputs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import typer.main

from vllm_hybridspec.cli import app


@dataclass(frozen=True)
class Option:
    command: str      # "bench", "calibrate fit"
    name: str         # "--num-requests", or an argument's name in capitals ("RESULTS")
    annotation: object
    is_flag: bool
    minimum: float | None
    maximum: float | None
    required: bool

    @property
    def is_number(self) -> bool:
        return self.annotation in (int, float)


def _walk(command, path: list[str]):
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _walk(sub, [*path, name])
        return
    yield " ".join(path), command


def commands() -> dict[str, object]:
    """``{"bench": <click command>, "calibrate fit": ..., ...}``."""
    return dict(_walk(typer.main.get_command(app), []))


def options() -> list[Option]:
    """Every option and argument of every command, ``--help`` left out."""
    found = []
    for path, command in commands().items():
        for param in command.params:
            if param.name == "help":
                continue
            info = param.type_descriptor.parameter_info
            is_option = param.param_type_name == "option"
            name = next(o for o in param.opts if o.startswith("--")) if is_option else param.name.upper()
            found.append(Option(path, name, param.type_descriptor.annotation, bool(getattr(param, "is_flag", False)),
                                getattr(info, "min", None), getattr(info, "max", None), bool(param.required)))
    return found


def ranged() -> list[Option]:
    """Numeric options declared with a ``min`` or ``max``: typer enforces them."""
    return [o for o in options() if o.is_number and (o.minimum is not None or o.maximum is not None)]


def numeric() -> list[Option]:
    return [o for o in options() if o.is_number and o.name.startswith("--")]
