"""The H-Spec drafter's heads with the DSpark Markov head: a float64 torch reference and the float32
torch ops the engine runs off CUDA (``naive``), and Triton kernels reading the vocabulary once per
draft position, or once for every position through candidate previous tokens (``heads``)."""

from .heads import candidate_tokens, markov_heads
from .naive import DraftHeads, markov_heads_reference, markov_heads_torch, top2_margins

__all__ = ["DraftHeads", "candidate_tokens", "markov_heads", "markov_heads_reference", "markov_heads_torch",
           "top2_margins"]
