"""StateKernels loads its module into a CUDA context it makes current itself.

``cuModuleLoadData`` loads into the *current* context and fails with CUDA_ERROR_INVALID_CONTEXT when there is
none; device queries (cudaGetDeviceCount/Properties, what probe_gpu calls) create none. tests/gpu builds the
kernels right after probe_gpu(), so without this the GPU kernel tests skipped on every GPU. The fakes below keep
the real APIs' context rule: only a runtime call that needs a context (cudaFree(0), cudaSetDevice, cudaMalloc)
makes the primary context current.
"""

from __future__ import annotations

import sys
import types
from enum import IntEnum

import pytest

from lineside.runtime.tensorrt import kernels as trt_kernels


class CUresult(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_CONTEXT = 201


class cudaError_t(IntEnum):  # noqa: N801 - cuda-python's name
    cudaSuccess = 0


def _fakes(monkeypatch) -> dict[str, object]:
    state: dict[str, object] = {"ctx": None, "loaded_in": None}
    ok = cudaError_t.cudaSuccess

    def make_current():
        state["ctx"] = state["ctx"] or "primary-0"

    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaGetDeviceCount = lambda: (ok, 1)  # device queries: no context
    rt.cudaGetDeviceProperties = lambda d: (ok, types.SimpleNamespace(name=b"Fake H100", major=9, minor=0,
                                                                      totalGlobalMem=1 << 36))
    rt.cudaRuntimeGetVersion = lambda: (ok, 12060)
    rt.cudaDriverGetVersion = lambda: (ok, 12060)
    rt.cudaSetDevice = lambda d: (make_current(), (ok,))[1]
    rt.cudaFree = lambda p: (make_current(), (ok,))[1]

    drv = types.ModuleType("cuda.bindings.driver")
    drv.CUstream = int

    def load(image):
        if state["ctx"] is None:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        state["loaded_in"] = state["ctx"]
        return CUresult.CUDA_SUCCESS, "module"

    drv.cuModuleLoadData = load
    drv.cuModuleGetFunction = lambda module, name: (CUresult.CUDA_SUCCESS, (module, name))
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda.bindings, bindings.runtime, bindings.driver = bindings, rt, drv
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", rt),
                      ("cuda.bindings.driver", drv)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(trt_kernels, "compile_state_kernels", lambda sm: (b"\x7fELF-cubin", "sm_90"))
    return state


def test_kernels_load_right_after_probe_gpu(monkeypatch):
    """What tests/gpu/test_cuda_kernels_gpu.py does first: probe the GPU, then build the kernels."""
    from lineside.runtime.tensorrt.env import probe_gpu

    state = _fakes(monkeypatch)
    gpu = probe_gpu()
    assert state["ctx"] is None  # the probe made no context
    k = trt_kernels.StateKernels(gpu.sm)
    assert state["loaded_in"] == "primary-0" and k.append == ("module", b"append_rows")


def test_kernels_keep_the_context_the_caller_made_current(monkeypatch):
    state = _fakes(monkeypatch)
    state["ctx"] = "the backend's"  # TensorRTBackend: cudaSetDevice(device) + cudaFree(0) before the kernels
    trt_kernels.StateKernels("9.0")
    assert state["loaded_in"] == "the backend's"


def test_a_failing_context_is_one_line(monkeypatch):
    from lineside.errors import BackendUnavailable

    _fakes(monkeypatch)

    class Err(IntEnum):
        cudaErrorDevicesUnavailable = 46

    sys.modules["cuda.bindings.runtime"].cudaFree = lambda p: (Err.cudaErrorDevicesUnavailable,)
    with pytest.raises(BackendUnavailable) as e:
        trt_kernels.StateKernels("9.0")
    assert "cudaErrorDevicesUnavailable" in str(e.value) and "\n" not in str(e.value)
