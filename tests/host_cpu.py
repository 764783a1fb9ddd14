"""A marker for tests that run onnxruntime's int8 product (the prefill graph's linears): their bounds hold only on a
CPU where it sums exactly (lineside/runtime/cpu_features.py); elsewhere the runtime never runs that graph."""

from __future__ import annotations

import pytest

from lineside.runtime.cpu_features import host_int8_gemm_exact

needs_exact_int8 = pytest.mark.skipif(
    not host_int8_gemm_exact(),
    reason="this CPU's int8 product saturates (x86 without VNNI): lineside runs prompts on the 4-bit graph here")
