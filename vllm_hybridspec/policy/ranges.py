"""The physical range of every quantity the project's files hold (policy, cost, records, ``compare``,
``evaluate``, ``bench`` and ``headline`` results), one constant per quantity; ``docs/inputs.md`` ("Ranges
of the numbers in files") lists them with the fields that use them, and the readers check them on reading.

A value outside its range is a unit or typing slip (seconds for milliseconds, a count for a share), not a
measurement, and is refused in one line before anything uses it.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field

# a measured time in milliseconds: one kernel launch at least, less than a minute for one decode step or round
MIN_MS, MAX_MS = 1e-3, 60_000.0
# a wall time in seconds (an engine start, a request, a benchmark level): at most a day
MAX_S = 86_400.0
# requests in one step: vLLM's scheduler runs at most this many sequences at once on one engine
MAX_BATCH = 65_536
# a verification length w (draft tokens plus the bonus token), and so a draft length D = W - 1 below it
MAX_LENGTH = 1_024
# experts one token is routed to in one MoE layer, and the MoE layers of a model
MAX_EXPERTS_PER_TOKEN, MAX_LAYERS = 1_024, 512
# new (layer, expert) pairs one draft token can add: its top-k in every layer
MAX_NEW_EXPERTS = MAX_EXPERTS_PER_TOKEN * MAX_LAYERS
# tokens: an output budget, a KV cache's capacity, a count of tokens over a whole run
MAX_TOKENS = 10**10
# decode steps, rounds, requests or prompts counted in one run
MAX_COUNT = 10**9
# a top-2 log-probability gap (nats): float32 logits give at most about 200 between two tokens
MAX_NATS = 1_000.0
# tokens per millisecond of one request (rho) or of a whole batch: every verified token accepted in the
# shortest round
MAX_RATE = MAX_LENGTH / MIN_MS
MAX_BATCH_RATE = MAX_BATCH * MAX_RATE
# speculation's throughput over plain decoding's: at most every verified token of a round accepted
MAX_SPEEDUP = float(MAX_LENGTH)
# a weight of the acceptance model's logistic regression: beyond it every probability saturates
MAX_COEF = 1e4
# the cost curve's quadratic coefficients (ms, ms per token, ms per token squared)
MAX_QUADRATIC = MAX_MS

Ms = Annotated[float, Field(ge=0, le=MAX_MS)]
Seconds = Annotated[float, Field(ge=0, le=MAX_S)]
BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH)]
Length = Annotated[int, Field(ge=1, le=MAX_LENGTH)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]

_CANONICAL = re.compile(r"[1-9][0-9]*")


def _canonical(what: str):
    def check(key):
        """A map's key (text in JSON) as the positive integer it must be written as: ``"4"``, not ``"04"``,
        ``"+4"``, ``" 4"`` or ``"4.0"``, so that one batch size or length has one key."""
        text = key if isinstance(key, str) else str(key)
        if isinstance(key, bool) or not isinstance(key, (str, int)) or not _CANONICAL.fullmatch(text):
            raise ValueError(f"key {key!r} is not a {what} written as a positive integer (1, 2, 3, ...)")
        return int(text)

    return check


# keys of per-batch-size and per-length maps
BatchKey = Annotated[int, BeforeValidator(_canonical("batch size")), Field(ge=1, le=MAX_BATCH)]
LengthKey = Annotated[int, BeforeValidator(_canonical("verification length")), Field(ge=1, le=MAX_LENGTH)]


def _batch_text(key: str) -> str:
    if _canonical("batch size")(key) > MAX_BATCH:
        raise ValueError(f"key {key!r} is above {MAX_BATCH:,}, the largest batch size this build reads")
    return key


# the key of a per-batch-size map kept as text (a result file's, looked up as str(batch))
BatchText = Annotated[str, AfterValidator(_batch_text)]
