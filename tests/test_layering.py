"""The package's lower layers stay below the vLLM glue: ``kernels``, ``drafter`` and ``policy`` import
no vLLM and nothing above them (``engine``, ``tools``, ``bench``, ``train``, ``cli``), anywhere in a
module (function-level imports included). ``drafter`` may use ``kernels``; ``kernels`` and ``policy``
use only themselves. The check walks every module's syntax tree with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_hybridspec"
ALLOWED = {"kernels": {"kernels"}, "drafter": {"drafter", "kernels"}, "policy": {"policy"}}


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in the module at ``path`` inside the package
    directory ``root`` (relative imports resolved against the module's package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    package = parts[:-1]  # a module's package; for __init__.py, the package itself
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
    return found


def violations(root: Path, layer: str) -> list[str]:
    """Imports in the ``layer`` subpackage of the package directory ``root`` that reach vLLM or a layer
    it may not use."""
    bad = []
    for path in sorted((root / layer).rglob("*.py")):
        for line, name in imported_modules(path, root):
            top, _, rest = name.partition(".")
            if top == "vllm":
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {name} (vLLM)")
            elif top == root.name and rest.split(".")[0] not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {name} (above {layer})")
    return bad


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_lower_layers_import_no_vllm_and_nothing_above(layer):
    assert (PACKAGE / layer / "__init__.py").is_file()
    assert violations(PACKAGE, layer) == []


@pytest.mark.parametrize("planted, expected", [
    ("import vllm\n", "imports vllm (vLLM)"),
    ("def f():\n    from vllm.config import SpeculativeConfig\n", "imports vllm.config (vLLM)"),
    ("from vllm_hybridspec.engine.compat import in_process_runner\n", "(above policy)"),
    ("from ..tools import compare\n", "imports vllm_hybridspec.tools (above policy)"),
    ("from .. import cli\n", "imports vllm_hybridspec (above policy)"),
])
def test_the_check_catches_a_planted_import(tmp_path, planted, expected):
    """Negative control: a copy of ``policy`` with one planted import fails the check, naming it."""
    import shutil

    root = tmp_path / "vllm_hybridspec"
    shutil.copytree(PACKAGE / "policy", root / "policy")
    assert violations(root, "policy") == []
    (root / "policy" / "planted.py").write_text(planted)
    found = violations(root, "policy")
    assert len(found) == 1 and "planted.py:" in found[0] and expected in found[0], found
