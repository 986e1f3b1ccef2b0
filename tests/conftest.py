"""Every test file's vLLM engine starts are counted and held to its line in ``tests/engine_budget.json``
(``tests/engine_starts.py`` says how): a file over its budget, or one that starts engines without a
line, fails at its last test's teardown."""

from __future__ import annotations

import pytest

from .engine_starts import check_module, install

ENGINE_STARTS = install()


@pytest.fixture(scope="module", autouse=True)
def engine_budget(request):
    yield
    check_module(ENGINE_STARTS, request.node.nodeid)
