"""Throughput-aware verification lengths inside vLLM 0.26 (HybridSpec): the per-round selector
(``selector``), the step that verifies only the selected drafts, cut on the device (``cut``), the
batch gate in vLLM's scheduler (``gate``) or, where that cannot reach, a gated step's drafts taken
out of what vLLM schedules (``trimming``), full CUDA graphs for the gated step
(``graphs``), calibration records from a serving engine (``capture``) and switching a running
server's selector (``control``). Its reaches into vLLM are rows of ``engine/patches/table.py``."""
