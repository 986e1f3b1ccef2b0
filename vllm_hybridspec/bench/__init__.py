"""Closed-loop serving benchmark (`hybridspec bench`) and its report (`hybridspec report`).

Data flows forward: ``prompts`` -> ``server`` (optional managed `vllm serve`) -> ``loadgen`` (C clients
streaming completions, ``client``; server counters from ``metrics``) -> a result JSON -> ``report``.
"""

from vllm_hybridspec.bench.loadgen import BenchAborted, run_bench
from vllm_hybridspec.bench.prompts import load_prompts
from vllm_hybridspec.bench.report import write_report

__all__ = ["BenchAborted", "load_prompts", "run_bench", "write_report"]
