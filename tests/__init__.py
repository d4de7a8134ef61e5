"""Hearth's tests.

The kernel tests run Triton kernels on CPU tensors through Triton's interpreter, which must be
switched on before any module defining a kernel is imported (Triton reads it then). This package
is imported first whichever way pytest starts (pytest-django imports `tests.settings` before any
conftest), so it is set here. It changes nothing else: without HEARTH_KERNELS=triton, CPU tensors
still run the PyTorch references.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
