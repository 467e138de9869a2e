"""Shared pytest setup: run Triton kernels in the CPU interpreter when there is no GPU.

Must run before any test module imports triton (triton.jit picks the interpreter at
decoration time), which is why it lives at conftest import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
