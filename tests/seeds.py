"""Fresh random inputs for every test run, reproducible from the printed seed."""

from __future__ import annotations

import os


def fresh_seed(what: str) -> int:
    """A new seed every run (vLLM reseeds torch's global generator when an engine starts, so it
    cannot be the source); printed so a failing run can be reproduced: the environment variable
    ``HYBRIDSPEC_TEST_SEED_<WHAT>`` (``what`` upper-cased, non-alphanumerics as ``_``) sets it."""
    name = "HYBRIDSPEC_TEST_SEED_" + "".join(c if c.isalnum() else "_" for c in what.upper())
    seed = int(os.environ[name]) if name in os.environ else int.from_bytes(os.urandom(4), "little") >> 1
    print(f"{what} seed {seed} ({name})")
    return seed
