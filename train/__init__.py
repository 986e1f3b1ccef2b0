"""Drafter training (importable as ``vllm_hybridspec.train``)."""
