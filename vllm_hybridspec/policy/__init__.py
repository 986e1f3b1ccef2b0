"""Throughput-aware verification length (HybridSpec): pure torch, no vLLM import."""
