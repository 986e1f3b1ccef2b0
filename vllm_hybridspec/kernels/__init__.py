"""Math and GPU kernels ; no vLLM import here.

Without a GPU, Triton kernels can only run in Triton's interpreter.  This is the one place that
switches it on (before any kernel is decorated), unless the user set ``TRITON_INTERPRET`` already.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
