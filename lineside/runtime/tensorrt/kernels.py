"""Two tiny CUDA kernels (compiled with NVRTC at load) that write a step's new state into the arena.

``append_rows``: the graph's ``present_*`` output [Bb, outer, S, inner] → arena [slots, outer, P, inner] at
each row's past length (rows with write_pos < 0 are padding and skipped). ``copy_rows``: a replace
state's output row → its arena row. Both read positions from device memory, so they can be captured
in the decode CUDA Graph and replayed with new positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lineside.errors import BackendUnavailable
from lineside.runtime.tensorrt.cuda_errors import lost, sticky
from lineside.runtime.tensorrt.env import check, import_cudart, import_driver, import_nvrtc

SOURCE = r"""
extern "C" __global__ void append_rows(const unsigned char* src, unsigned char* dst, const long long* pos,
                                       const long long* nnew, long long rows, long long outer, long long S,
                                       long long P, long long inner_bytes)
{
    long long total = rows * outer * S * inner_bytes;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long c = i % inner_bytes;
        long long t = i / inner_bytes;
        long long s = t % S; t /= S;
        long long o = t % outer;
        long long b = t / outer;
        long long p = pos[b];
        if (p < 0 || s >= nnew[b]) continue;
        dst[((b * outer + o) * P + p + s) * inner_bytes + c] = src[i];
    }
}

extern "C" __global__ void copy_rows(const unsigned char* src, unsigned char* dst, const long long* pos,
                                     long long rows, long long row_bytes)
{
    long long total = rows * row_bytes;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        if (pos[i / row_bytes] < 0) continue;
        dst[i] = src[i];
    }
}
"""

THREADS = 256


def _ok(res: Any, what: str) -> Any:
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        gone = sticky(err)  # a launch into a context a fault already broke: the engine has failed
        if gone is not None:
            raise lost(gone, what)
        raise BackendUnavailable(f"{what} failed ({getattr(err, 'name', err)}); the TensorRT backend cannot start")
    return res[1] if isinstance(res, tuple) and len(res) == 2 else (res[1:] if isinstance(res, tuple) else None)


def grid_for(total: int, threads: int = THREADS, max_blocks: int = 4096) -> int:
    return max(1, min(max_blocks, -(-total // threads)))


def compile_state_kernels(sm: str) -> tuple[bytes, str]:
    """SOURCE compiled by NVRTC for compute capability ``sm`` ("8.7"): returns (image, target).

    SASS (a cubin for ``sm_87``) when NVRTC knows the GPU, so the driver never has to JIT PTX newer than
    itself (an NVRTC wheel newer than the driver is common); PTX for the newest architecture NVRTC knows
    otherwise, which the driver JIT-compiles for a GPU newer than this NVRTC.
    """
    try:
        return _compile(sm)
    except BackendUnavailable:
        raise
    except Exception as e:  # e.g. libnvrtc.so missing: cuda-python loads it on first use
        raise BackendUnavailable(f"cannot compile the KV-append kernels with NVRTC ({_first_line(e)}); "
                                 "install the CUDA runtime's NVRTC (JetPack, or pip nvidia-cuda-nvrtc-cu12) "
                                 "or use --backend onnxruntime") from None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:120]


def _compile(sm: str) -> tuple[bytes, str]:
    nvrtc = import_nvrtc()
    arch = int(sm.replace(".", ""))
    known = [int(a) for a in _ok(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]
    if arch in known:
        target, cubin = f"sm_{arch}", True
    else:
        older = [a for a in known if a <= arch]
        if not older:
            raise BackendUnavailable(f"this NVRTC cannot compile for SM {sm} (it knows {min(known)}–{max(known)}); "
                                     "install a CUDA runtime that supports this GPU or use --backend onnxruntime")
        target, cubin = f"compute_{max(older)}", False
    prog = _ok(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"lineside_state.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={target}".encode()]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(res[0]) != 0:
            size = _ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise BackendUnavailable(f"NVRTC could not compile the state kernels for {target}: "
                                     f"{log.decode(errors='replace').strip()[:200]}")
        get_size, get = (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if cubin else \
                        (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        size = _ok(get_size(prog), "nvrtcGet" + ("CUBIN" if cubin else "PTX") + "Size")
        image = b" " * size
        _ok(get(prog, image), "nvrtcGet" + ("CUBIN" if cubin else "PTX"))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return (image if cubin else image.rstrip(b"\0") + b"\0"), target


class StateKernels:
    """Compiled ``append_rows`` / ``copy_rows`` for one device."""

    def __init__(self, sm: str):
        try:
            self._build(sm)
        except BackendUnavailable:
            raise
        except Exception as e:  # e.g. the driver library missing: cuda-python loads it on first use
            raise BackendUnavailable(f"cannot load the KV-append kernels into the CUDA driver ({_first_line(e)}); "
                                     "check the NVIDIA driver (nvidia-smi / JetPack) or use --backend onnxruntime") \
                from None

    def _build(self, sm: str) -> None:
        self.cu = import_driver()
        image, self.target = compile_state_kernels(sm)
        # cuModuleLoadData loads into the current context and fails (CUDA_ERROR_INVALID_CONTEXT) without one;
        # device queries such as probe_gpu's create none. cudaFree(0) makes the current device's primary context
        # (the one the runtime and TensorRT use) current on this thread, as any runtime call needing one does.
        cudart = import_cudart()
        check(cudart, cudart.cudaFree(0), "cudaFree(0)")
        self._image = np.frombuffer(image, dtype=np.uint8).copy()  # the driver reads it by address
        self.module = _ok(self.cu.cuModuleLoadData(self._image.ctypes.data), "cuModuleLoadData")
        self.append = _ok(self.cu.cuModuleGetFunction(self.module, b"append_rows"), "cuModuleGetFunction")
        self.copy = _ok(self.cu.cuModuleGetFunction(self.module, b"copy_rows"), "cuModuleGetFunction")

    def _launch(self, fn: Any, total: int, stream: Any, args: list[np.ndarray]) -> None:
        ptrs = np.array([a.ctypes.data for a in args], dtype=np.uint64)
        hstream = self.cu.CUstream(int(stream)) if not isinstance(stream, self.cu.CUstream) else stream
        _ok(self.cu.cuLaunchKernel(fn, grid_for(total), 1, 1, THREADS, 1, 1, 0, hstream, ptrs.ctypes.data, 0),
            "cuLaunchKernel")
        self._keep = (args, ptrs)  # argument memory must outlive the launch (and the capture)

    def append_rows(self, stream: Any, src: int, dst: int, pos: int, nnew: int, rows: int, outer: int, seq: int,
                    pitch: int, inner_bytes: int) -> list[np.ndarray]:
        args = [np.array([v], dtype=np.uint64) for v in (src, dst, pos, nnew)] + \
               [np.array([v], dtype=np.int64) for v in (rows, outer, seq, pitch, inner_bytes)]
        self._launch(self.append, rows * outer * seq * inner_bytes, stream, args)
        return args

    def copy_rows(self, stream: Any, src: int, dst: int, pos: int, rows: int, row_bytes: int) -> list[np.ndarray]:
        args = [np.array([v], dtype=np.uint64) for v in (src, dst, pos)] + \
               [np.array([v], dtype=np.int64) for v in (rows, row_bytes)]
        self._launch(self.copy, rows * row_bytes, stream, args)
        return args
