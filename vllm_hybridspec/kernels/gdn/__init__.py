"""Gated DeltaNet verification: torch references (``naive``) and Triton kernels (``verify``,
``commit``, and ``fused``: the commit of the previous round fused into the next verification),
following the HybridSpec paper's parallel verification and one-launch commit."""

from .commit import StatePointers, gdn_commit
from .fused import gdn_commit_verify
from .naive import (
    CompactFactors,
    chunk_verify,
    commit_verify,
    commit_verify_,
    gdn_gating,
    l2norm,
    reconstruct_state,
    recurrent_gated_delta_rule,
)
from .verify import MAX_VERIFY_LEN, VerifyFactors, gdn_verify

__all__ = [
    "CompactFactors", "MAX_VERIFY_LEN", "StatePointers", "VerifyFactors", "chunk_verify",
    "commit_verify", "commit_verify_", "gdn_commit", "gdn_commit_verify", "gdn_gating", "gdn_verify", "l2norm",
    "reconstruct_state", "recurrent_gated_delta_rule",
]
