"""The package's import graph has no circle, and no import runs back up a layer: the package's parts and
``engine``'s parts each stand in the order :data:`PACKAGE_LAYERS` and :data:`ENGINE_LAYERS` give, bottom
first, and a part imports only parts on lower layers (and itself). Every import counts, wherever it stands
in a module: function-level ones and those under ``TYPE_CHECKING`` included. ``tests/test_layering.py``
adds what the lowest layers may not import at all (vLLM)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_layering import PACKAGE

# bottom first; a part on a layer imports only parts on lower layers
PACKAGE_LAYERS = [{"kernels", "policy"}, {"drafter"}, {"engine"}, {"bench"}, {"tools"}, {"train"}, {"cli"}]
ENGINE_LAYERS = [{"compat", "options", "runner_state"}, {"cpu", "length"}, {"gdn"}, {"drafting"}, {"replay"},
                 {"config"}, {"patches"}, {"plugin"}]


def module_graph(root: Path) -> dict[str, set[str]]:
    """``module -> the package's modules it imports`` for every module of the package directory ``root``;
    ``from p import m`` of a submodule ``m`` counts as an import of ``p.m``, of a name as one of ``p``
    (a package's ``__init__``)."""
    modules = {".".join([root.name, *p.relative_to(root).with_suffix("").parts]).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def arrows_back_up(graph: dict[str, set[str]], prefix: str, layers: list[set[str]]) -> list[str]:
    """``a -> b`` for every import between the parts under ``prefix`` (``"vllm_hybridspec."``) that does not
    run down ``layers``; a part missing from ``layers`` is named too."""
    floor = {part: i for i, layer in enumerate(layers) for part in layer}
    bad = []
    for a, imported in sorted(graph.items()):
        if not a.startswith(prefix):
            continue
        part_a = a.removeprefix(prefix).split(".")[0]
        for b in sorted(imported):
            if not b.startswith(prefix):
                continue
            part_b = b.removeprefix(prefix).split(".")[0]
            if part_a == part_b or not part_a or not part_b:
                continue
            if part_a not in floor or part_b not in floor:
                bad.append(f"{a} -> {b} (a part with no layer: {part_a if part_a not in floor else part_b})")
            elif floor[part_b] >= floor[part_a]:
                bad.append(f"{a} -> {b} ({part_a} may not import {part_b})")
    return bad


def test_no_circle():
    assert circles(module_graph(PACKAGE)) == []


@pytest.mark.parametrize("prefix, layers", [("vllm_hybridspec.", PACKAGE_LAYERS),
                                            ("vllm_hybridspec.engine.", ENGINE_LAYERS)])
def test_no_import_runs_back_up(prefix, layers):
    assert arrows_back_up(module_graph(PACKAGE), prefix, layers) == []


def test_the_checks_catch_a_planted_circle_and_arrow(tmp_path):
    """Negative controls on copies of ``engine``: an import from ``length`` up to ``drafting``; a type-only
    import and a function-level one that close a circle."""
    import shutil

    root = tmp_path / "vllm_hybridspec"
    shutil.copytree(PACKAGE / "engine", root / "engine")
    assert circles(module_graph(root)) == []
    assert arrows_back_up(module_graph(root), "vllm_hybridspec.engine.", ENGINE_LAYERS) == []
    (root / "engine" / "length" / "planted.py").write_text("from ..drafting.proposer import HSpecProposer\n")
    assert arrows_back_up(module_graph(root), "vllm_hybridspec.engine.", ENGINE_LAYERS) == [
        "vllm_hybridspec.engine.length.planted -> vllm_hybridspec.engine.drafting.proposer "
        "(length may not import drafting)"]
    (root / "engine" / "length" / "planted.py").unlink()
    cut, selector = root / "engine" / "length" / "cut.py", root / "engine" / "length" / "selector.py"
    cut.write_text(cut.read_text() + "\nif TYPE_CHECKING:\n    from .selector import LengthSelector\n")
    selector.write_text(selector.read_text() + "\ndef f():\n    from vllm_hybridspec.engine.length import cut\n")
    assert circles(module_graph(root)) == [["vllm_hybridspec.engine.length.cut",
                                            "vllm_hybridspec.engine.length.selector"]]
