"""Closed-loop serving benchmark (`hybridspec bench`), its report (`hybridspec report`) and a soak test
of one server (`hybridspec soak`).

Data flows forward: ``prompts`` -> ``server`` (optional managed `vllm serve`) -> ``loadgen`` (C clients
streaming completions, ``client``; server counters from ``metrics``) -> a result JSON -> ``schema``
(checked on load) -> ``report``. ``soak`` runs the same closed loop for a set time, then checks the
server: no failed request, the KV cache drained, the greedy outputs of a probe set unchanged.
"""

from vllm_hybridspec.bench.loadgen import BenchAborted, run_bench
from vllm_hybridspec.bench.prompts import load_prompts
from vllm_hybridspec.bench.report import write_report
from vllm_hybridspec.bench.soak import run_soak

__all__ = ["BenchAborted", "load_prompts", "run_bench", "run_soak", "write_report"]
