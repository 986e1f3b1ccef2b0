"""Every reach into vLLM is a row of ``engine/patches.py``, and nothing else in the package reaches in.

Two checks, each shown to catch a planted reach:

* in the code (``ast``): outside ``engine/patches.py`` nothing calls ``wrap_once`` or vLLM's registries
  (``register_oot``, ``register_model``, ``register_speculator``), ``setattr``s on or assigns to an
  attribute of a name imported from vLLM, and the vLLM attributes the table's ``per_call`` and ``state``
  rows write are written only at the row's ``site``;
* in the loaded vLLM, after the plugin registered: every module and class attribute that holds the
  plugin's code is a row of the table, and every row that applies here is in place.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vllm_hybridspec.engine import patches

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_hybridspec"
REGISTRIES = {"wrap_once", "register_oot", "register_model", "register_speculator"}


def _vllm_names(tree) -> set[str]:
    """Names a module binds to vLLM objects by import, anywhere in it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "vllm"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _sites_of(attr: str) -> set[str]:
    return {r.site for r in patches.PATCHES if r.kind in ("per_call", "state") and r.attr == attr}


def reaches_outside_the_table(root: Path) -> list[str]:
    """``path:line what`` for every reach into vLLM in the package at ``root`` that is not made by
    ``engine/patches.py`` or at a row's ``site``."""
    written = {r.attr for r in patches.PATCHES if r.kind in ("per_call", "state")}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if rel.as_posix() == "vllm_hybridspec/engine/patches.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        vllm_names = _vllm_names(tree)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        in_engine = rel.parts[:2] == ("vllm_hybridspec", "engine")
        # the qualified name of the function or class each node sits in
        scopes: dict[ast.AST, str] = {}

        def walk(node, scope):
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = f"{scope}.{child.name}" if scope else child.name
                scopes[child] = inner
                walk(child, inner)

        walk(tree, "")
        for node in ast.walk(tree):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.Call):
                fn = node.func
                called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
                if called in REGISTRIES:
                    found.append(f"{rel}:{line} calls {called}")
                elif called == "setattr" and node.args and _root(node.args[0]) in vllm_names:
                    found.append(f"{rel}:{line} setattr on {_root(node.args[0])} (vLLM)")
            for attr in patches.attribute_writes(node):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in (t for target in targets for t in ast.walk(target)):
                    if isinstance(t, ast.Attribute) and t.attr == attr and _root(t) in vllm_names:
                        found.append(f"{rel}:{line} writes {_root(t)}.{attr} (vLLM)")
                if in_engine and attr in written:
                    scope = scopes.get(node, "")
                    sites = _sites_of(attr)
                    if not any(site == f"{module}:{scope}" or f"{module}:{scope}".startswith(site + ".")
                               for site in sites):
                        found.append(f"{rel}:{line} writes .{attr} in {scope or 'the module'}, not at its row's "
                                     f"site ({', '.join(sorted(sites))})")
    return sorted(set(found))


def test_no_reach_into_vllm_outside_the_table():
    assert reaches_outside_the_table(PACKAGE) == []


PLANTED = [
    ("from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
     "from vllm_hybridspec.engine.patches import wrap_once\n"
     "def install():\n    wrap_once(GPUModelRunner, '_sample', lambda original: original)\n",
     "calls wrap_once"),
    ("from vllm.v1.worker import gpu_model_runner\n"
     "def install(cls):\n    gpu_model_runner.DFlashProposer = cls\n",
     "writes gpu_model_runner.DFlashProposer (vLLM)"),
    ("import vllm._custom_ops as ops\n"
     "def install(fn):\n    setattr(ops, 'chunk_gated_delta_rule_cpu', fn)\n",
     "setattr on ops (vLLM)"),
    ("def gate(scheduler):\n    scheduler.dynamic_sd_lookup = None\n",
     "writes .dynamic_sd_lookup in gate, not at its row's site"),
    ("from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention as Q\n"
     "def install(cls):\n    Q.register_oot(cls)\n",
     "calls register_oot"),
]


@pytest.mark.parametrize("planted, expected", PLANTED)
def test_the_code_check_catches_a_planted_reach(tmp_path, planted, expected):
    """Negative control: a copy of ``engine/length`` with one planted module fails the check, naming it."""
    import shutil

    root = tmp_path / "vllm_hybridspec"
    shutil.copytree(PACKAGE / "engine" / "length", root / "engine" / "length")
    assert reaches_outside_the_table(root) == []
    (root / "engine" / "length" / "planted.py").write_text(planted)
    found = reaches_outside_the_table(root)
    assert len(found) == 1 and "planted.py:" in found[0] and expected in found[0], found


def _applicable() -> tuple[str, ...]:
    from vllm.platforms import current_platform

    return ("always", "cpu") if current_platform.is_cpu() else ("always",)


def test_the_loaded_vllm_holds_the_plugin_only_where_the_table_says():
    from vllm_hybridspec.engine import plugin

    plugin.register()
    table = {(r.owner, r.attr) for r in patches.PATCHES}
    assert sorted(patches.reaches_in_vllm() - table) == []
    applied = [r for r in patches.rows(when=_applicable()) if r.kind not in ("per_call", "state")]
    assert len(applied) == 33
    assert [r.name for r in applied if not patches.is_applied(r)] == []


def test_the_vllm_check_catches_a_planted_reach(monkeypatch):
    """Negative controls: a plugin function set on a vLLM class, and a wrapper made by ``wrap_once`` on a
    method no row names, are both found and named."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_hybridspec.engine import plugin
    from vllm_hybridspec.engine.length.gate import skips_drafting

    plugin.register()
    monkeypatch.setattr(GPUModelRunner, "_bookkeeping_sync", skips_drafting)
    monkeypatch.setattr(Scheduler, "schedule", Scheduler.schedule)  # restored after the test
    patches.wrap_once(Scheduler, "schedule", lambda original: lambda self, *a, **k: original(self, *a, **k))
    table = {(r.owner, r.attr) for r in patches.PATCHES}
    assert sorted(patches.reaches_in_vllm() - table) == [
        ("vllm.v1.core.sched.scheduler:Scheduler", "schedule"),
        ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_bookkeeping_sync")]


def test_rows_are_well_formed():
    """Kinds, ``when`` and the fields each kind needs; one row per (owner, attribute, when); the state
    and per-call rows name their site."""
    seen = set()
    for r in patches.PATCHES:
        assert r.kind in patches.KINDS and r.when in patches.WHEN, r.name
        assert (r.owner, r.attr, r.when) not in seen, r.name
        seen.add((r.owner, r.attr, r.when))
        assert bool(r.site) == (r.kind in ("per_call", "state")), r.name
        assert bool(r.by) == (r.kind not in ("per_call", "state")), r.name
        assert bool(r.key) == (r.kind == "register"), r.name
        assert r.owner.split(".")[0].split(":")[0] == "vllm" and r.replaces, r.name
    assert len(patches.PATCHES) == 45


def test_hooks_run_in_the_tables_order_with_the_arguments_they_name():
    """A ``hooks_after`` wrapper calls each hook with the runner and the row's named arguments, however
    vLLM passed them; a ``hooks_before`` wrapper calls each with the runner before vLLM's method."""
    calls = []

    def original(self, scheduler_output, num_scheduled_tokens=None):
        calls.append(("vllm", scheduler_output, num_scheduled_tokens))
        return 7

    hooks = (lambda runner, out: calls.append(("a", out)), lambda runner, out: calls.append(("b", out)))
    after = patches._hooks_after(hooks, ("scheduler_output",))(original)
    assert after("runner", "S", 3) == 7
    assert after("runner", scheduler_output="T") == 7
    assert calls == [("vllm", "S", 3), ("a", "S"), ("b", "S"), ("vllm", "T", None), ("a", "T"), ("b", "T")]
    calls.clear()
    before = patches._hooks_before((lambda runner: calls.append(("a", runner)),))(lambda self, n: calls.append(n))
    before("runner", 5)
    assert calls == [("a", "runner"), 5]


def test_porting_installs_the_rows_that_fit_and_names_the_rest(monkeypatch):
    """``apply_what_fits`` (``VLLM_HYBRIDSPEC_ANY_VLLM=1`` on another release): a row whose vLLM symbol
    takes other parameters is left out and named with its problem; the intact rows are installed."""
    import dataclasses

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample = next(r for r in patches.PATCHES if r.attr == "_sample")
    bent = dataclasses.replace(sample, params=("self", "logits", "metadata"))
    monkeypatch.setattr(GPUModelRunner, "_sample", patches.original_of(GPUModelRunner._sample))
    monkeypatch.setattr(patches, "PATCHES", (bent, next(r for r in patches.PATCHES if r.attr == "_update_states")))
    left_out = patches.apply_what_fits(("always",))
    assert left_out == [(bent.name, [
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample takes ['self', 'logits', 'spec_decode_metadata'], "
        "the plugin expects ['self', 'logits', 'metadata']"])]
    assert not getattr(GPUModelRunner._sample, "__hspec_wrapped__", False)
    assert patches.is_applied(patches.PATCHES[1])
