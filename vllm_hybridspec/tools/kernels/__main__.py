"""``python -m vllm_hybridspec.tools.kernels COMMAND ...``: ``hybridspec kernels COMMAND ...`` without
importing the rest of the command line."""

from .cli import kernels_app

kernels_app(prog_name="python -m vllm_hybridspec.tools.kernels")
