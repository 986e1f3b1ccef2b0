"""The one error type the policy package raises for bad user input (records, cost and policy files).

Its message is a sentence that names the file, the line or field, the bad value and what would be
valid; the command line prints it and exits non-zero without a traceback.
"""

from __future__ import annotations

import difflib
import re
import types
import typing

from pydantic import BaseModel, ConfigDict, ValidationError

# The pydantic configuration of a schema a user writes by hand (a recipe, its sections): unknown keys
# refused, types never coerced ("2" is not 2, 1.5 is not an int), NaN and infinities refused.
USER_FILE = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class InputError(ValueError):
    """A records, cost or policy file (or an argument) is malformed or inconsistent."""


# The labels pydantic puts in an error's location for the member of a union it tried
# (``("round_ms", "2", "list[float]", 0)``): not fields, so left out of the path a user reads.
_UNION_MEMBER = re.compile(r"(float|int|str|bool|none|(list|dict|tuple|set)\[.*\]|"
                           r"(function|constrained)-[a-z-]+\[.*\]|"
                           r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+)")  # a model class: StepTimes


def in_union(loc: tuple) -> bool:
    return any(isinstance(part, str) and _UNION_MEMBER.fullmatch(part) for part in loc)


def field_path(loc: tuple) -> str:
    """``("cost", "curve", 3)`` -> ``"cost.curve[3]"``."""
    out = ""
    for part in loc:
        if isinstance(part, str) and (_UNION_MEMBER.fullmatch(part) or part == "[key]"):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def did_you_mean(key: str, valid) -> str:
    """`` (did you mean 'max_prompts'?)`` when ``key`` is a near miss of one of ``valid``, else ``""``."""
    close = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the field at ``loc`` inside ``model`` (through optional fields,
    lists and dicts), or ``None`` when ``loc`` leaves the models."""
    annotation = model
    for part in loc:
        annotation = _step(annotation, part)
        if annotation is None:
            return None
    return _step(annotation, None)


def _step(annotation, part):
    """The annotation one ``part`` of a location below ``annotation``; ``part=None``: the model
    ``annotation`` stands for, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if part is None:
            return annotation
        field = annotation.model_fields.get(str(part))
        return None if field is None else field.annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is not type(None) and (found := _step(arg, part)) is not None:
                return found
        return None
    if part is not None and origin in (list, tuple) and args:
        return args[0]
    if part is not None and origin is dict and len(args) == 2:
        return args[1]
    return None


def unknown_key_message(model: type[BaseModel] | None, loc: tuple) -> str:
    """The message for an unknown key at ``loc``: a near miss and the valid keys of the section."""
    section = _model_at(model, loc[:-1]) if model is not None else None
    if section is None:
        return "unknown key"
    valid = list(section.model_fields)
    return f"unknown key{did_you_mean(loc[-1], valid)}; valid keys here: {', '.join(valid)}"


def describe(err: ValidationError, where: str, model: type[BaseModel] | None = None) -> InputError:
    """Turn a pydantic error into a one-line ``InputError`` naming the first bad field and its value
    (and how many more there are), so a command line prints one line per failure.  With ``model``
    (the validated class) an unknown key is named with its near miss and the valid keys."""
    lines = []
    errors = err.errors(include_url=False)
    # a value that fits no member of a union (``float | list[float]``) gets one error per member; the
    # one that reaches deepest into the value says what is wrong (``round_ms.4[1]``, not ``round_ms.4``)
    paths = [field_path(e["loc"]) for e in errors]
    errors = [e for e, p in zip(errors, paths)
              if not (in_union(e["loc"]) and any(q.startswith((p + ".", p + "[")) for q in paths))]
    for e in errors:
        msg = e["msg"].removeprefix("Value error, ")
        path = field_path(e["loc"])
        if e["type"] == "missing":
            lines.append(f"{where}: required field '{path}' is missing")
            continue
        if e["type"] == "extra_forbidden" and model is not None:
            lines.append(f"{where}: field '{path}': {unknown_key_message(model, e['loc'])}")
            continue
        got = e.get("input")
        shown = "" if isinstance(got, dict) or e["type"] == "value_error" else f" (got {got!r:.80})"
        lines.append(f"{where}: field '{path}': {msg}{shown}" if path else f"{where}: {msg}")
    more = f" (and {len(lines) - 1} more problem{'s' * (len(lines) > 2)})" if len(lines) > 1 else ""
    return InputError(lines[0] + more)
