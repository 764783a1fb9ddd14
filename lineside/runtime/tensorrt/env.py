"""Lazy imports of TensorRT and cuda-python, and the one-line messages when they (or a GPU) are missing."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from lineside.errors import BackendUnavailable
from lineside.runtime.tensorrt.cuda_errors import lost, sticky

NO_TENSORRT = (
    "TensorRT is not installed (import tensorrt failed: {err}); on Jetson install JetPack's python3-libnvinfer, "
    "elsewhere `pip install lineside[tensorrt]`, or use --backend onnxruntime"
)
NO_CUDA_PYTHON = (
    "cuda-python is not installed (import cuda.bindings failed: {err}); `pip install 'cuda-python>=12.6'` "
    "or use --backend onnxruntime"
)
NO_DRIVER = (
    "the NVIDIA driver is missing or too old for this CUDA runtime (cudaErrorInsufficientDriver); "
    "install/update the driver (JetPack on Jetson) or use --backend onnxruntime"
)
NO_GPU = "no CUDA GPU found ({err}); run on a machine with an NVIDIA GPU or use --backend onnxruntime"


def import_tensorrt() -> ModuleType:
    """``import tensorrt`` or raise BackendUnavailable with one line saying how to get it."""
    try:
        return importlib.import_module("tensorrt")
    except Exception as e:  # ImportError, or OSError from a missing libnvinfer
        raise BackendUnavailable(NO_TENSORRT.format(err=_short(e))) from None


def _import_cuda(new: str, old: str) -> ModuleType:
    """cuda-python's module ``new`` (``cuda.bindings.*``, ≥ 12.6), else its older name ``old``."""
    try:
        return importlib.import_module(new)
    except Exception as e:
        try:
            return importlib.import_module(old)
        except Exception:
            raise BackendUnavailable(NO_CUDA_PYTHON.format(err=_short(e))) from None


def import_cudart() -> ModuleType:
    """The CUDA runtime API (``cuda.bindings.runtime``, formerly ``cuda.cudart``)."""
    return _import_cuda("cuda.bindings.runtime", "cuda.cudart")


def import_nvrtc() -> ModuleType:
    """NVRTC, the runtime CUDA C compiler (``cuda.bindings.nvrtc``, formerly ``cuda.nvrtc``)."""
    return _import_cuda("cuda.bindings.nvrtc", "cuda.nvrtc")


def import_driver() -> ModuleType:
    """The CUDA driver API (``cuda.bindings.driver``, formerly ``cuda.cuda``)."""
    return _import_cuda("cuda.bindings.driver", "cuda.cuda")


def _short(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:120] or type(e).__name__


def err_name(cudart: Any, err: Any) -> str:
    return getattr(err, "name", str(err))


def check(cudart: Any, result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(err, values...)`` tuple; raise one line naming the call on error (``BackendLost``
    for a sticky error, cuda_errors.py)."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        gone = sticky(err)
        if gone is not None:  # the context is unusable: the engine fails (BackendLost), a supervisor restarts
            raise lost(gone, what)
        name = err_name(cudart, err)
        if "InsufficientDriver" in name:
            raise BackendUnavailable(NO_DRIVER)
        if "NoDevice" in name:
            raise BackendUnavailable(NO_GPU.format(err=name))
        raise BackendUnavailable(f"CUDA call {what} failed with {name}; check the GPU with nvidia-smi / tegrastats")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


@dataclass
class GpuInfo:
    name: str
    sm: str  # compute capability "8.7"
    cuda_runtime: str  # "12.6"
    driver: str  # CUDA version the driver supports, "12.6"
    total_mem: int
    integrated: bool = False  # memory shared with the CPU (Jetson): cudaMemGetInfo's "free" leaves out page cache


def _ver(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


DRIVER_OLDER_THAN_CUDA_PYTHON = (
    "the NVIDIA driver supports CUDA {drv} but this cuda-python is built for CUDA {rt}; install the cuda-python "
    "of the driver's CUDA major (`pip install 'cuda-python>={major}.0,<{next_major}'`), update the driver, or use "
    "--backend onnxruntime"
)


def _driver_message(cudart: Any) -> str:
    """Why cudaErrorInsufficientDriver: no driver at all, or a driver older than cuda-python's CUDA major
    (an unpinned `pip install cuda-python` on a CUDA 12 machine pulls the CUDA 13 build)."""
    try:
        drv = int(check(cudart, cudart.cudaDriverGetVersion(), "cudaDriverGetVersion") or 0)
        rt = int(check(cudart, cudart.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion") or 0)
    except Exception:  # noqa: BLE001 - the versions only refine the message
        return NO_DRIVER
    if drv and rt and drv // 1000 < rt // 1000:
        major = drv // 1000
        return DRIVER_OLDER_THAN_CUDA_PYTHON.format(drv=_ver(drv), rt=_ver(rt), major=major, next_major=major + 1)
    return NO_DRIVER


def probe_gpu(device: int = 0) -> GpuInfo:
    """Name, SM, CUDA runtime/driver versions of GPU ``device``; one clear line if there is none."""
    cudart = import_cudart()
    try:
        n = check(cudart, cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
    except BackendUnavailable as e:
        if str(e) == NO_DRIVER:
            raise BackendUnavailable(_driver_message(cudart)) from None
        raise
    if not n:
        raise BackendUnavailable(NO_GPU.format(err="cudaGetDeviceCount returned 0"))
    props = check(cudart, cudart.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    rt = check(cudart, cudart.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
    drv = check(cudart, cudart.cudaDriverGetVersion(), "cudaDriverGetVersion")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return GpuInfo(name=name.strip("\x00").strip(), sm=f"{props.major}.{props.minor}", cuda_runtime=_ver(int(rt)),
                   driver=_ver(int(drv)), total_mem=int(props.totalGlobalMem),
                   integrated=bool(getattr(props, "integrated", 0)))


    return None


def tensorrt_version() -> str:
    return str(import_tensorrt().__version__)
