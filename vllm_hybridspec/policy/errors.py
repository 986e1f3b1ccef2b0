"""The one error type the policy package raises for bad user input (records, cost and policy files).

Its message is a sentence that names the file, the line or field, the bad value and what would be
valid; the command line prints it and exits non-zero without a traceback.
"""

from __future__ import annotations

from pydantic import ValidationError


class InputError(ValueError):
    """A records, cost or policy file (or an argument) is malformed or inconsistent."""


def field_path(loc: tuple) -> str:
    """``("cost", "curve", 3)`` -> ``"cost.curve[3]"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def describe(err: ValidationError, where: str) -> InputError:
    """Turn a pydantic error into a one-line ``InputError`` naming the first bad field and its value
    (and how many more there are), so a command line prints one line per failure."""
    lines = []
    for e in err.errors(include_url=False):
        msg = e["msg"].removeprefix("Value error, ")
        path = field_path(e["loc"])
        if e["type"] == "missing":
            lines.append(f"{where}: required field '{path}' is missing")
            continue
        got = e.get("input")
        shown = "" if isinstance(got, dict) or e["type"] == "value_error" else f" (got {got!r:.80})"
        lines.append(f"{where}: field '{path}': {msg}{shown}" if path else f"{where}: {msg}")
    more = f" (and {len(lines) - 1} more problems)" if len(lines) > 1 else ""
    return InputError(lines[0] + more)
