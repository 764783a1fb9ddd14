"""lineside's CUDA side against the real cuda-python and NVRTC, which install and run without a GPU.

- every cuda-python call in lineside/runtime has the real function's arity, and the fake runtime the
  backend tests use only has real names with real arities;
- on a machine without a driver the real runtime gives our one-line message;
- NVRTC compiles the KV-append kernels to SASS for Xavier/Orin/H100/B200-class GPUs, and PTX past them;
- the kernels' CUDA C, compiled as C++ with a tiny shim and run over the launch grid, writes exactly
  what the numpy stand-in (FakeKernels) writes, grid-stride loop included.
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lineside.errors import BackendUnavailable
from lineside.runtime.tensorrt import kernels as trt_kernels
from tests.runtime.tensorrt import fake_trt

RUNTIME = Path(trt_kernels.__file__).parent
cudart = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python is not installed (dev extra)")
cudrv = pytest.importorskip("cuda.bindings.driver")
nvrtc_mod = pytest.importorskip("cuda.bindings.nvrtc")
MODULES = {"cuda": cudart, "cu": cudrv, "nvrtc": nvrtc_mod}


def _cuda_calls() -> list[tuple[str, str, int, str]]:
    """(module, function, positional args, where) for each ``<x>.cuda*(...)``/``cu*``/``nvrtc*`` call."""
    out = []
    for path in sorted(RUNTIME.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                for prefix, mod in (("nvrtc", "nvrtc"), ("cuda", "cuda"), ("cu", "cu")):
                    if name.startswith(prefix) and name[len(prefix):][:1].isupper():
                        out.append((mod, name, len(node.args), f"{path.name}:{node.lineno}"))
                        break
    return out


def test_every_cuda_call_matches_the_real_signature():
    calls = _cuda_calls()
    assert len(calls) >= 30  # the scan sees the backend, graphs, env and kernels
    for mod, name, nargs, where in calls:
        if name in ("cudaStreamCaptureMode", "cudaMemcpyKind", "CUstream"):
            continue
        fn = getattr(MODULES[mod], name, None)
        assert fn is not None, f"{where}: cuda-python has no {name}"
        params = inspect.signature(fn).parameters.values()
        required = sum(p.default is inspect.Parameter.empty for p in params)
        assert required <= nargs <= len(params), f"{where}: {name} takes {len(params)} arguments, called with {nargs}"


def test_fake_runtime_has_only_real_names_and_arities():
    fake = fake_trt.make_cudart(fake_trt.Device())
    for name, value in vars(fake).items():
        if name.startswith("__"):
            continue
        real = getattr(cudart, name, None)
        assert real is not None, f"the fake cudart has {name}, cuda-python does not"
        if callable(value):
            assert len(inspect.signature(value).parameters) == len(inspect.signature(real).parameters), name
        elif hasattr(value, "__dict__"):  # enum stand-ins
            for member in vars(value):
                assert int(getattr(real, member)) == getattr(value, member), (name, member)
        else:
            assert int(real) == value, name


def test_fake_and_sticky_error_codes_are_cuda_pythons():
    """The fake's errors and the sticky set (cuda_errors.py) are cudaError_t members with the same values, and the
    driver API numbers its sticky errors alike (a kernel launch's CUresult is classified by the same table)."""
    from cuda.bindings import driver

    from lineside.runtime.tensorrt.cuda_errors import StickyError, sticky

    for member in [*fake_trt.Err, *StickyError]:
        assert int(getattr(cudart.cudaError_t, member.name)) == int(member), member.name
    assert sticky(driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS) == StickyError.cudaErrorIllegalAddress
    assert sticky(driver.CUresult.CUDA_ERROR_LAUNCH_FAILED) == StickyError.cudaErrorLaunchFailure
    assert sticky(driver.CUresult.CUDA_ERROR_ECC_UNCORRECTABLE) == StickyError.cudaErrorECCUncorrectable
    assert sticky(cudart.cudaError_t.cudaErrorMemoryAllocation) is None
    assert sticky(cudart.cudaError_t.cudaErrorLaunchOutOfResources) is None


def test_real_runtime_without_driver_is_one_line():
    err = cudart.cudaGetDeviceCount()[0]
    if int(err) == 0:
        pytest.skip("this machine has a CUDA driver")
    from lineside.runtime.tensorrt.env import probe_gpu

    with pytest.raises(BackendUnavailable) as e:
        probe_gpu()
    msg = str(e.value)
    assert "\n" not in msg and "--backend onnxruntime" in msg
    assert msg.startswith(("the NVIDIA driver is missing", "no CUDA GPU found"))


def _nvrtc_or_skip():
    try:
        return nvrtc_mod.nvrtcVersion()
    except Exception as e:  # libnvrtc.so not found
        pytest.skip(f"NVRTC library not available: {e}")


@pytest.mark.parametrize("sm", ["7.2", "8.7", "9.0", "10.0"])
def test_nvrtc_compiles_state_kernels_to_sass(sm):
    _nvrtc_or_skip()
    image, target = trt_kernels.compile_state_kernels(sm)
    assert target == "sm_" + sm.replace(".", "") and image[:4] == b"\x7fELF"
    assert b"append_rows" in image and b"copy_rows" in image


def test_nvrtc_gives_ptx_for_a_gpu_newer_than_itself():
    _nvrtc_or_skip()
    image, target = trt_kernels.compile_state_kernels("99.9")
    assert target.startswith("compute_") and image.endswith(b"\0")
    assert b".entry append_rows" in image and b".entry copy_rows" in image
    with pytest.raises(BackendUnavailable, match="cannot compile for SM 1.0"):
        trt_kernels.compile_state_kernels("1.0")


SHIM = r"""
struct lineside_uint3 { unsigned int x, y, z; };
static lineside_uint3 blockIdx, blockDim, threadIdx, gridDim;
#define __global__
%s
extern "C" void run_append(const unsigned char* src, unsigned char* dst, const long long* pos, const long long* nnew,
                           long long rows, long long outer, long long S, long long P, long long inner,
                           unsigned grid, unsigned threads) {
    gridDim.x = grid; blockDim.x = threads;
    for (unsigned b = 0; b < grid; ++b) for (unsigned t = 0; t < threads; ++t) {
        blockIdx.x = b; threadIdx.x = t; append_rows(src, dst, pos, nnew, rows, outer, S, P, inner);
    }
}
extern "C" void run_copy(const unsigned char* src, unsigned char* dst, const long long* pos, long long rows,
                         long long row_bytes, unsigned grid, unsigned threads) {
    gridDim.x = grid; blockDim.x = threads;
    for (unsigned b = 0; b < grid; ++b) for (unsigned t = 0; t < threads; ++t) {
        blockIdx.x = b; threadIdx.x = t; copy_rows(src, dst, pos, rows, row_bytes);
    }
}
"""


@pytest.fixture(scope="module")
def kernels_on_cpu(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("kern")
    (d / "k.cpp").write_text(SHIM % trt_kernels.SOURCE)
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp")], check=True)
    lib = ctypes.CDLL(str(d / "k.so"))
    p, ll, u = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_uint
    lib.run_append.argtypes = [p, p, p, p, ll, ll, ll, ll, ll, u, u]
    lib.run_copy.argtypes = [p, p, p, ll, ll, u, u]
    return lib


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


@pytest.mark.parametrize("rows,outer,seq,pitch,inner,grid", [
    (3, 2, 5, 16, 8, None),   # grid from grid_for: one thread per byte
    (4, 3, 7, 20, 6, 2),      # 2 blocks of 256 threads: the grid-stride loop covers the rest
    (1, 1, 1, 4, 2, None),    # one decode token
])
def test_append_kernel_source_matches_fake(kernels_on_cpu, rows, outer, seq, pitch, inner, grid):
    rng = np.random.default_rng(rows * 100 + seq)
    src = rng.integers(0, 255, (rows, outer, seq, inner), dtype=np.uint8)
    pos = np.array([0, pitch - seq, -1, 3][:rows], dtype=np.int64)
    nnew = np.array([seq, seq, seq, max(1, seq - 2)][:rows], dtype=np.int64)
    base = rng.integers(0, 255, (rows, outer, pitch, inner), dtype=np.uint8)
    got, want = base.copy(), base.copy()
    total = rows * outer * seq * inner
    kernels_on_cpu.run_append(_ptr(src), _ptr(got), _ptr(pos), _ptr(nnew), rows, outer, seq, pitch, inner,
                              grid or trt_kernels.grid_for(total), trt_kernels.THREADS)
    fake_trt.FakeKernels(fake_trt.Device()).append_rows(None, _ptr(src), _ptr(want), _ptr(pos), _ptr(nnew), rows,
                                                         outer, seq, pitch, inner)
    assert np.array_equal(got, want)
    for b in range(rows):  # and both equal the plain definition
        if pos[b] >= 0:
            k = nnew[b]
            assert np.array_equal(got[b, :, pos[b]:pos[b] + k], src[b, :, :k])
    assert np.array_equal(got[2], base[2]) if rows > 2 else True  # padding rows untouched


def test_copy_kernel_source_matches_fake(kernels_on_cpu):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, (5, 24), dtype=np.uint8)
    pos = np.array([0, -1, 7, -1, 2], dtype=np.int64)
    base = rng.integers(0, 255, (5, 24), dtype=np.uint8)
    got, want = base.copy(), base.copy()
    kernels_on_cpu.run_copy(_ptr(src), _ptr(got), _ptr(pos), 5, 24, 1, 32)
    fake_trt.FakeKernels(fake_trt.Device()).copy_rows(None, _ptr(src), _ptr(want), _ptr(pos), 5, 24)
    assert np.array_equal(got, want)
    assert np.array_equal(got[[0, 2, 4]], src[[0, 2, 4]]) and np.array_equal(got[[1, 3]], base[[1, 3]])
