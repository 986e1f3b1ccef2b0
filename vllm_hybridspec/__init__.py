"""vllm-hybridspec: fast speculative decoding for hybrid Gated-DeltaNet + MoE models in vLLM.

Layers, lowest first: ``vllm_hybridspec.kernels`` (math and Triton kernels),
``vllm_hybridspec.policy`` (verification-length policy), ``vllm_hybridspec.drafter`` (the H-Spec
model), ``vllm_hybridspec.train``; the vLLM glue sits on top.  Lower layers never import higher ones.
"""

__version__ = "0.1.0"
