"""Which CUDA errors leave the context unusable (sticky), and the one line a lost context is reported with.

CUDA documents these as leaving "the process in an inconsistent state": every later CUDA call returns the same
error until the process ends, so a step failing on one must fail the engine (``BackendLost``) rather than be
retried. Any other error (out of memory on a larger batch, a bad launch argument) fails only its step.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from lineside.runtime.engine_health import BackendLost


class StickyError(IntEnum):
    """cuda-python's ``cudaError_t`` names and values of the sticky errors; the driver API's ``CUresult`` uses the
    same numbers (CUDA_ERROR_ILLEGAL_ADDRESS = 700, ...), so a kernel launch's error is classified alike."""

    cudaErrorCudartUnloading = 4  # the driver is shutting down
    cudaErrorECCUncorrectable = 214
    cudaErrorNvlinkUncorrectable = 220
    cudaErrorIllegalAddress = 700
    cudaErrorLaunchTimeout = 702
    cudaErrorContextIsDestroyed = 709
    cudaErrorAssert = 710
    cudaErrorHardwareStackError = 714
    cudaErrorIllegalInstruction = 715
    cudaErrorMisalignedAddress = 716
    cudaErrorInvalidAddressSpace = 717
    cudaErrorInvalidPc = 718
    cudaErrorLaunchFailure = 719
    cudaErrorExternalDevice = 911


def sticky(err: Any) -> StickyError | None:
    """The sticky error ``err`` (a cudaError_t / CUresult, or its int) is, or None for a recoverable one."""
    try:
        return StickyError(int(err))
    except (TypeError, ValueError):
        return None


def lost(err: StickyError, where: str) -> BackendLost:
    """The one-line ``BackendLost`` for a sticky error seen in ``where`` (a CUDA call, or TensorRT's execute)."""
    return BackendLost(f"the GPU's CUDA context is lost ({err.name} in {where}); every later CUDA call fails the same "
                       "way until the process restarts: restart the server (a supervisor does it), and if it comes "
                       "back check the GPU (nvidia-smi -q / dmesg; tegrastats on Jetson)")
