"""The H-Spec drafter (importable as ``vllm_hybridspec.drafter``), usable without vLLM."""
