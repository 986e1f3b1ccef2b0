"""Math and GPU kernels (importable as ``vllm_hybridspec.kernels``); no vLLM import here."""
