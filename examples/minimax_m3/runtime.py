"""XLA settings the served step wants, applied before JAX starts a backend.

``--xla_gpu_enable_triton_gemm=false``: the step scans over stacked layer weights; XLA's Triton
GEMM fusions copy each layer's weight slice out of the stack first (``memcpy128`` in a trace,
e.g. 2 × 14 µs per dense-MLP layer at decode sizes), while cuBLAS reads the slice in place. On
one H200 rank of M3 at TP 8 this took decode 4 × 2048 from 12.49 to 10.85 ms for all 60 layers
and left prefill within 1.5 % (BENCHMARKS.md §1). Only GPU backends read the flag.
"""

from __future__ import annotations

import os

TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def apply_xla_flags() -> str:
    """Adds ``--xla_gpu_enable_triton_gemm=false`` to ``XLA_FLAGS`` unless the user set that
    flag; call before JAX starts a backend. Returns the resulting ``XLA_FLAGS``."""
    flags = os.environ.get("XLA_FLAGS", "")
    if TRITON_GEMM not in flags:
        flags = f"{flags} --{TRITON_GEMM}=false".strip()
        os.environ["XLA_FLAGS"] = flags
    return flags
