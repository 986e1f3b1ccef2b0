"""Installing :data:`table.PATCHES` into vLLM (``engine/plugin.py`` calls :func:`apply` at registration):
resolving a row's references, wrapping once per process, the shared step hooks, replacements and vLLM's
registries. Nothing else in the package patches vLLM (``tests/engine/test_patches.py``)."""

from __future__ import annotations

import importlib
import inspect

from vllm_hybridspec.engine.compat import SUPPORTED_VLLM
from vllm_hybridspec.engine.patches.table import KINDS, Reach, rows

REPLACED: dict[tuple[str, str], object] = {}  # (owner, attr) -> vLLM's object a replace row replaced (audit)


def resolve(ref: str):
    """``"module:Qual.name"`` (or ``"module"``) -> the object."""
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def original_of(value):
    """vLLM's own function under the plugin's wrappers (classmethods and bound methods unwrapped)."""
    value = getattr(value, "__func__", value)
    while getattr(value, "__hspec_wrapped__", False):
        value = value.__wrapped__
    return value


def parameters(value) -> list[str]:
    """The parameter names of vLLM's callable ``value`` as its callers pass them, under the plugin's
    wrappers (a bound method or classmethod without its first; a class: its ``__init__``)."""
    if inspect.isclass(value):
        value = value.__init__
    names = list(inspect.signature(original_of(value)).parameters)
    return names[1:] if inspect.ismethod(value) else names


def params_match(fn, expected: tuple[str, ...]) -> str | None:
    """``None`` when ``fn`` takes the parameters ``expected`` describes, else what it takes instead."""
    got = parameters(fn)
    want = list(expected)
    if want and want[-1] == "...":
        ok = got[: len(want) - 1] == want[:-1]
    else:
        ok = got == want
    return None if ok else f"takes {got}, the plugin expects {want}"


def hooks_key(kind: str) -> str:
    """The ``wrap_once`` key of a row's shared hooks wrapper (``hooks_after`` or ``hooks_before``)."""
    return f"vllm_hybridspec.engine.patches:{kind}"


def _key(make_wrapper) -> str:
    return f"{make_wrapper.__module__}.{make_wrapper.__qualname__}"


def wrap_once(owner, attr: str, make_wrapper, key: str | None = None) -> None:
    """Replace ``owner.attr`` by ``make_wrapper(original)`` unless a wrapper with the same key is already in
    its chain (vLLM may load the plugin several times per process; several features may wrap one method).
    A classmethod stays a classmethod (the maker gets and returns the underlying function)."""
    key = key or _key(make_wrapper)
    static = inspect.getattr_static(owner, attr)
    is_classmethod = isinstance(static, classmethod)
    current = static.__func__ if is_classmethod else getattr(owner, attr)
    link = current
    while link is not None:
        if getattr(link, "__hspec_key__", None) == key:
            return
        link = getattr(link, "__wrapped__", None) if getattr(link, "__hspec_wrapped__", False) else None
    wrapper = make_wrapper(current)
    wrapper.__hspec_wrapped__ = True
    wrapper.__hspec_key__ = key
    wrapper.__wrapped__ = current
    setattr(owner, attr, classmethod(wrapper) if is_classmethod else wrapper)


def _hooks_after(hooks, names: tuple[str, ...]):
    """A maker of a wrapper that calls ``hook(self, *first)`` after vLLM's method for each hook, ``first``
    being the call's arguments named ``names`` (passed by position or by name)."""
    n = len(names)

    def make(original):
        def after(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            first = args[:n] if len(args) >= n else (*args, *(kwargs[p] for p in names[len(args):]))
            for hook in hooks:
                hook(self, *first)
            return result

        return after

    return make


def _hooks_before(hooks):
    """A maker of a wrapper that calls ``hook(self)`` before vLLM's method for each hook."""
    def make(original):
        def before(self, *args, **kwargs):
            for hook in hooks:
                hook(self)
            return original(self, *args, **kwargs)

        return before

    return make


def apply_row(row: Reach) -> None:
    """Install one row (``per_call`` and ``state`` rows are done at their sites)."""
    if row.kind in ("per_call", "state"):
        return
    owner = resolve(row.owner)
    if row.kind == "wrap":
        for ref in row.by:
            wrap_once(owner, row.attr, resolve(ref))  # keyed "module.qualname" of the maker
    elif row.kind in ("hooks_after", "hooks_before"):
        hooks = tuple(resolve(ref) for ref in row.by)
        names = tuple(p for p in row.params[1:] if p != "...")
        make = _hooks_after(hooks, names) if row.kind == "hooks_after" else _hooks_before(hooks)
        wrap_once(owner, row.attr, make, key=hooks_key(row.kind))
    elif row.kind == "replace":
        ours, current = resolve(row.by[0]), getattr(owner, row.attr, None)
        if current is ours:
            return
        if current is None:
            raise RuntimeError(f"vLLM changed: {row.owner}.{row.attr} no longer exists (row {row.name!r} of "
                               f"engine/patches/table.py, written for vLLM {SUPPORTED_VLLM})")
        if inspect.isclass(current) and not (inspect.isclass(ours) and issubclass(ours, current)):
            raise TypeError(f"{row.by[0]} must subclass vLLM's {row.owner}.{row.attr} (row {row.name!r})")
        mismatch = row.params and params_match(current, row.params)
        if mismatch:
            raise RuntimeError(f"vLLM changed: {row.owner}.{row.attr} {mismatch} (row {row.name!r} of "
                               f"engine/patches/table.py, written for vLLM {SUPPORTED_VLLM})")
        REPLACED[(row.owner, row.attr)] = current
        setattr(owner, row.attr, ours)
    elif row.kind == "register":
        _register(row, owner)
    else:
        raise ValueError(f"row {row.name!r} has kind {row.kind!r}; valid kinds: {', '.join(KINDS)}")


def _register(row: Reach, owner) -> None:
    ours_ref = row.by[0]
    if row.attr == "register_oot":
        from vllm.model_executor import custom_op

        ours = resolve(ours_ref)
        if not issubclass(ours, owner):
            raise TypeError(f"{ours_ref} must subclass vLLM's {row.key} (row {row.name!r})")
        current = custom_op.op_registry_oot.get(row.key)
        if current is ours:
            return
        if current is not None:
            raise RuntimeError(f"{row.key} is already replaced by {current} (row {row.name!r})")
        owner.register_oot(ours)
    elif row.attr == "register_model":
        owner.register_model(row.key, ours_ref)  # lazy: "module:Class", imported when a model needs it
    elif row.attr == "register_speculator":
        owner.register_speculator(row.key)(resolve(ours_ref))
    else:
        raise ValueError(f"row {row.name!r} registers through {row.attr!r}; valid: register_oot, register_model, "
                         "register_speculator")


def apply(when: tuple[str, ...]) -> None:
    """Install every row whose ``when`` is in ``when``, in table order."""
    for row in rows(when=when):
        apply_row(row)
