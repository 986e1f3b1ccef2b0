"""Every reach into vLLM is a row of ``engine/patches/table.py``, and nothing else in the package reaches in.

Three checks, each shown to catch a planted violation:

* in the code (``ast``): outside ``engine/patches/`` nothing calls ``wrap_once`` or vLLM's registries
  (``register_oot``, ``register_model``, ``register_speculator``), ``setattr``s on or assigns to an
  attribute of a name imported from vLLM, the vLLM attributes the table's ``per_call`` and ``state``
  rows write are written only at the row's ``site``, and no other attribute of a vLLM object is written
  (an instance's included: ``runner.foo = ...``). A vLLM object is known by the names the engine gives
  them (:data:`VLLM_OBJECTS`, as a variable or an attribute: ``runner``, ``self.runner``) and as ``self``
  inside a wrapper (a function nested in a maker that takes vLLM's ``original``);
* in the loaded vLLM, after the plugin registered: every module and class attribute that holds the
  plugin's code is a row of the table, and every row that applies here is in place;
* in ``docs/architecture.md``: its table of the vLLM symbols is the table's own (``patches.docs_table``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vllm_hybridspec.engine import patches
from vllm_hybridspec.engine.patches import install, table

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_hybridspec"
REGISTRIES = {"wrap_once", "register_oot", "register_model", "register_speculator"}
# the names the engine's code gives vLLM's objects (parameters, variables, attributes of its own objects)
VLLM_OBJECTS = {"runner", "model_runner", "scheduler", "dispatcher", "cudagraph_dispatcher", "vllm_config",
                "scheduler_output", "input_batch", "sampler", "rejection_sampler", "compilation_config",
                "speculative_config", "model_config", "parallel_config", "cache_config"}


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
    ``engine/patches/table.py`` or at a row's ``site``."""
    written = {r.attr for r in patches.PATCHES if r.kind in ("per_call", "state")}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if rel.parts[:3] == ("vllm_hybridspec", "engine", "patches"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        vllm_names = _vllm_names(tree)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        in_engine = rel.parts[:2] == ("vllm_hybridspec", "engine")
        # the qualified name of the function or class each node sits in, and the nodes inside a wrapper
        scopes: dict[ast.AST, str] = {}
        in_wrapper: set[ast.AST] = set()

        def walk(node, scope, wrapper):
            for child in ast.iter_child_nodes(node):
                inner, inner_wrapper = scope, wrapper
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = f"{scope}.{child.name}" if scope else child.name
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner_wrapper = wrapper or any(a.arg == "original" for a in child.args.args)
                scopes[child] = inner
                if wrapper:
                    in_wrapper.add(child)
                walk(child, inner, inner_wrapper)

        walk(tree, "", False)
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
                for t in (t for target in targets for t in ast.walk(target)):
                    if not (isinstance(t, ast.Attribute) and t.attr == attr) or attr in written:
                        continue
                    holder = t.value
                    named = holder.id if isinstance(holder, ast.Name) else getattr(holder, "attr", None)
                    if named in VLLM_OBJECTS or (named == "self" and node in in_wrapper):
                        found.append(f"{rel}:{line} writes {ast.unparse(t)}, an attribute of a vLLM object no row "
                                     "lists")
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
    ("def plan(runner, scheduler_output):\n    runner.hspec_plan = None\n",
     "writes runner.hspec_plan, an attribute of a vLLM object no row lists"),
    ("class Holder:\n    def keep(self, w):\n        self.runner.input_batch.hspec_w = w\n",
     "writes self.runner.input_batch.hspec_w, an attribute of a vLLM object no row lists"),
    ("def _wrapped(original):\n    def wrapper(self, *args):\n        self.hspec_seen = True\n"
     "        return original(self, *args)\n    return wrapper\n",
     "writes self.hspec_seen, an attribute of a vLLM object no row lists"),
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
        assert r.owner.split(".")[0].split(":")[0] == "vllm" and r.why, r.name
    assert len(patches.PATCHES) == 45


def test_hooks_run_in_the_tables_order_with_the_arguments_they_name():
    """A ``hooks_after`` wrapper calls each hook with the runner and the row's named arguments, however
    vLLM passed them; a ``hooks_before`` wrapper calls each with the runner before vLLM's method."""
    calls = []

    def original(self, scheduler_output, num_scheduled_tokens=None):
        calls.append(("vllm", scheduler_output, num_scheduled_tokens))
        return 7

    hooks = (lambda runner, out: calls.append(("a", out)), lambda runner, out: calls.append(("b", out)))
    after = install._hooks_after(hooks, ("scheduler_output",))(original)
    assert after("runner", "S", 3) == 7
    assert after("runner", scheduler_output="T") == 7
    assert calls == [("vllm", "S", 3), ("a", "S"), ("b", "S"), ("vllm", "T", None), ("a", "T"), ("b", "T")]
    calls.clear()
    before = install._hooks_before((lambda runner: calls.append(("a", runner)),))(lambda self, n: calls.append(n))
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
    monkeypatch.setattr(table, "PATCHES", (bent, next(r for r in patches.PATCHES if r.attr == "_update_states")))
    left_out = patches.apply_what_fits(("always",))
    assert left_out == [(bent.name, [
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample takes ['self', 'logits', 'spec_decode_metadata'], "
        "the plugin expects ['self', 'logits', 'metadata']"])]
    assert not getattr(GPUModelRunner._sample, "__hspec_wrapped__", False)
    assert patches.is_applied(table.PATCHES[1])


DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
BEGIN, END = "<!-- the table of engine/patches/table.py (patches.docs_table) -->", "<!-- end of the table -->"


def docs_table_in(text: str) -> str:
    """The lines between the table's markers in the text of ``docs/architecture.md``."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "docs/architecture.md lost the table's markers"
    return text.split(BEGIN)[1].split(END)[0].strip("\n") + "\n"


def test_the_docs_show_the_table():
    """``docs/architecture.md``'s table of the vLLM symbols is written from the table;
    ``HSPEC_WRITE_DOCS=1`` rewrites it between its markers."""
    import os

    text = DOCS.read_text()
    if os.environ.get("HSPEC_WRITE_DOCS") == "1":
        before, rest = text.split(BEGIN)
        DOCS.write_text(f"{before}{BEGIN}\n{patches.docs_table()}{END}{rest.split(END)[1]}")
    assert docs_table_in(DOCS.read_text()) == patches.docs_table()


def test_the_docs_check_catches_an_edited_row():
    """Negative control: the docs with one row's text changed, or one row left out, fail the check."""
    text = DOCS.read_text()
    row = next(line for line in docs_table_in(text).splitlines() if "`GPUModelRunner._sample`" in line)
    for planted in (text.replace(row, row.replace("its cut", "its end")), text.replace(row + "\n", "")):
        assert planted != text and docs_table_in(planted) != patches.docs_table()
