"""Holding :data:`table.PATCHES` to the installed vLLM and to the code: :func:`check_row` (one contract
test per row, ``scripts/vllm_release.py``), :func:`apply_what_fits` (porting work on another release),
:func:`reaches_in_vllm` and :func:`is_applied` (what the loaded vLLM holds of the plugin), the syntax-tree
helpers of ``tests/engine/test_patches.py``, and :func:`docs_table`, the table of ``docs/architecture.md``."""

from __future__ import annotations

import inspect

from vllm_hybridspec.engine.patches.install import REPLACED, apply_row, hooks_key, params_match, resolve
from vllm_hybridspec.engine.patches import table
from vllm_hybridspec.engine.patches.table import Reach, rows


def _vllm_object(row: Reach):
    """vLLM's own object at ``row.owner.attr`` (the plugin's wrappers stay; :func:`parameters` sees
    through them), or what a replace row replaced."""
    if row.kind == "replace" and (row.owner, row.attr) in REPLACED:
        return REPLACED[(row.owner, row.attr)]
    return getattr(resolve(row.owner), row.attr)


def _instance_attribute(owner, attr: str) -> bool:
    """Whether instances of the vLLM class ``owner`` carry ``attr`` (a dataclass or pydantic field, a class
    attribute, or ``self.<attr>`` assigned in the class's source)."""
    import dataclasses
    import re

    if dataclasses.is_dataclass(owner) and attr in {f.name for f in dataclasses.fields(owner)}:
        return True
    if attr in getattr(owner, "model_fields", {}) or hasattr(owner, attr):
        return True
    for cls in owner.__mro__[:-1]:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(attr)}\s*(:[^=\n]+)?=", source):
            return True
    return False


def site_writes(site: str, attr: str) -> bool:
    """Whether the function or class ``site`` (``"module:qualname"``) assigns or deletes ``<x>.attr``."""
    import ast
    import textwrap

    node = ast.parse(textwrap.dedent(inspect.getsource(resolve(site))))
    return any(attr in attribute_writes(n) for n in ast.walk(node))


def attribute_writes(node) -> set[str]:
    """The attribute names an ``ast`` statement assigns or deletes (``x.a = ...``, ``x.a, y.b = ...``,
    ``x.a += ...``, ``x.a = y.b = ...``, ``del x.a``)."""
    import ast

    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    else:
        return set()
    found = set()
    for target in targets:
        for t in ast.walk(target):
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, (ast.Store, ast.Del)):
                found.add(t.attr)
    return found


def check_row(row: Reach) -> list[str]:
    """What in the installed vLLM breaks ``row`` (empty when nothing does): the owner or attribute is
    gone, vLLM's symbol takes other parameters than the plugin's code expects, or the plugin's own
    reference does not resolve."""
    problems = []
    try:
        owner = resolve(row.owner)
    except (ImportError, AttributeError) as error:
        return [f"{row.owner} not found ({type(error).__name__}: {error})"]
    for ref in row.by + ((row.site,) if row.site else ()):
        try:
            resolve(ref)
        except (ImportError, AttributeError) as error:
            problems.append(f"the plugin's {ref} does not import ({type(error).__name__}: {error})")
    if row.kind == "state":
        present = _instance_attribute(owner, row.attr)
        if row.new and present:
            problems.append(f"{row.owner}.{row.attr} now exists in vLLM; the plugin's attribute of that name "
                            "would overwrite it")
        elif not row.new and not present:
            problems.append(f"{row.owner}.{row.attr} is no attribute of vLLM's objects any more")
    elif not hasattr(owner, row.attr) and not (row.kind == "per_call" and _instance_attribute(owner, row.attr)):
        problems.append(f"{row.owner}.{row.attr} no longer exists")
    elif row.params:
        mismatch = params_match(_vllm_object(row), row.params)
        if mismatch:
            problems.append(f"{row.owner}.{row.attr} {mismatch}")
    if row.site and not problems:
        try:
            if not site_writes(row.site, row.attr):
                problems.append(f"{row.site} writes no .{row.attr} (the row names it as the one writer)")
        except (OSError, TypeError) as error:
            problems.append(f"{row.site}: no source ({error})")
    return problems


def _ours(value) -> bool:
    try:
        if isinstance(value, (classmethod, staticmethod)) or inspect.ismethod(value):
            value = value.__func__
        if not (inspect.isfunction(value) or inspect.isclass(value)):
            return False
        module = getattr(value, "__module__", None)
        return bool(getattr(value, "__hspec_wrapped__", False)) or (
            isinstance(module, str) and module.split(".")[0] == "vllm_hybridspec")
    except Exception:  # lazy placeholders of optional dependencies raise on any attribute
        return False


def reaches_in_vllm() -> set[tuple[str, str]]:
    """``(owner, attr)`` of every module and class attribute of the loaded vLLM that holds the plugin's
    code (a wrapper made by :func:`wrap_once` or a function or class of ``vllm_hybridspec``), in the
    table's ``owner`` spelling."""
    import sys

    found = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "vllm" or name.startswith("vllm.")):
            continue
        for attr, value in list(vars(module).items()):
            if _ours(value):
                found.add((name, attr))
            if inspect.isclass(value) and value.__module__ == name:
                for cls_attr, cls_value in list(vars(value).items()):
                    if _ours(cls_value):
                        found.add((f"{name}:{value.__qualname__}", cls_attr))
    return found


def is_applied(row: Reach) -> bool:
    """Whether an applied row's change is in the loaded vLLM."""
    owner = resolve(row.owner)
    if row.kind == "replace":
        return getattr(owner, row.attr) is resolve(row.by[0])
    if row.kind == "register":
        if row.attr == "register_oot":
            from vllm.model_executor import custom_op

            return custom_op.op_registry_oot.get(row.key) is resolve(row.by[0])
        if row.attr == "register_model":
            return row.key in owner.get_supported_archs()
        from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

        return SUPPORTED_SPECULATORS_TYPES.get(row.key) is resolve(row.by[0])
    keys, link = set(), getattr(getattr(owner, row.attr), "__func__", getattr(owner, row.attr))
    while getattr(link, "__hspec_wrapped__", False):
        keys.add(link.__hspec_key__)
        link = link.__wrapped__
    want = {ref.replace(":", ".") for ref in row.by} if row.kind == "wrap" else {hooks_key(row.kind)}
    return want <= keys


def apply_what_fits(when: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """Porting work on another vLLM release: install the rows of ``when`` that :func:`check_row` finds
    intact, in table order; returns ``(row name, problems)`` of those left out."""
    left_out = []
    for row in rows(when=when):
        problems = check_row(row)
        if problems:
            left_out.append((row.name, problems))
        else:
            apply_row(row)
    return left_out


_HOW = {"hooks_after": "hooks after", "hooks_before": "hooks before", "per_call": "per call"}
_WHEN = {"cpu": " (CPU only)", "other_vllm": " (other vLLM only)"}


def docs_table() -> str:
    """The table as ``docs/architecture.md`` shows it (``tests/engine/test_patches.py`` holds the two equal):
    one line per row, the plugin's code relative to ``vllm_hybridspec.engine``."""
    lines = ["| feature | vLLM 0.26 symbol | how | plugin code | why |", "| --- | --- | --- | --- | --- |"]
    for r in table.PATCHES:
        owner = r.owner.rpartition(":")[2] if ":" in r.owner else r.owner.rpartition(".")[2]
        how = _HOW.get(r.kind, r.kind) + (" (added)" if r.new else "") + _WHEN.get(r.when, "")
        code = ", ".join(f"`{ref.removeprefix('vllm_hybridspec.engine.')}`" for ref in r.by or (r.site,))
        lines.append(f"| {r.feature} | `{owner}.{r.attr}` | {how} | {code} | {r.why} |")
    return "\n".join(lines) + "\n"
