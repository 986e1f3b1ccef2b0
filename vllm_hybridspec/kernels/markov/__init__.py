"""The H-Spec drafter's heads with the DSpark Markov head: a float64 torch reference (``naive``) and
a Triton kernel reading the vocabulary once per draft position (``heads``)."""

from .heads import markov_heads
from .naive import DraftHeads, markov_heads_reference, top2_margins

__all__ = ["DraftHeads", "markov_heads", "markov_heads_reference", "top2_margins"]
