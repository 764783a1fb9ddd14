"""The KV-append kernels and CUDA Graph capture/replay on a real GPU — needs cuda-python + NVRTC, not TensorRT.

So a GPU machine without TensorRT still checks the CUDA half of the TensorRT backend: NVRTC's SASS loads,
the kernels write what numpy says, and a captured launch replays with positions changed in device memory.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _ready():
    try:
        from lineside.runtime.tensorrt.env import probe_gpu
        from lineside.runtime.tensorrt.kernels import StateKernels

        gpu = probe_gpu()
        return gpu, StateKernels(gpu.sm), None
    except Exception as e:  # no cuda-python, driver, GPU or NVRTC: skip with the one-line reason
        return None, None, str(e)


GPU, KERNELS, WHY = _ready()
if WHY:
    pytest.skip(f"needs a GPU, cuda-python and NVRTC: {WHY}", allow_module_level=True)

from lineside.runtime.tensorrt.env import check, import_cudart  # noqa: E402
from lineside.runtime.tensorrt.graphs import GraphCache  # noqa: E402

cr = import_cudart()


class DeviceArrays:
    """cudaMalloc'd copies of numpy arrays on one non-blocking stream."""

    def __init__(self):
        self.stream = check(cr, cr.cudaStreamCreateWithFlags(cr.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self.ptrs: list[int] = []

    def upload(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        p = int(check(cr, cr.cudaMalloc(max(a.nbytes, 1)), "cudaMalloc"))
        self.ptrs.append(p)
        self.set(p, a)
        return p

    def set(self, p: int, a: np.ndarray) -> None:
        # On the kernels' own stream, then waited for: a cudaMemcpy from pageable memory may still be in flight when
        # it returns, and the legacy stream it runs on does not order a non-blocking stream's launches after it.
        a = np.ascontiguousarray(a)
        check(cr, cr.cudaMemcpyAsync(p, a.ctypes.data, a.nbytes, cr.cudaMemcpyKind.cudaMemcpyHostToDevice,
                                     self.stream), "cudaMemcpyAsync")
        self.sync()

    def get(self, p: int, like: np.ndarray) -> np.ndarray:
        self.sync()
        out = np.empty_like(like)
        check(cr, cr.cudaMemcpy(out.ctypes.data, p, out.nbytes, cr.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
        return out

    def sync(self) -> None:
        check(cr, cr.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        for p in self.ptrs:
            cr.cudaFree(p)
        cr.cudaStreamDestroy(self.stream)


@pytest.fixture
def dev():
    d = DeviceArrays()
    yield d
    d.close()


def _expected_append(base, src, pos, nnew):
    out = base.copy()
    for b in range(src.shape[0]):
        if pos[b] >= 0:
            out[b, :, pos[b]:pos[b] + nnew[b]] = src[b, :, :nnew[b]]
    return out


def test_append_and_copy_kernels_match_numpy(dev):
    rng = np.random.default_rng(0)
    rows, outer, seq, pitch, inner = 3, 4, 5, 32, 128  # inner: one fp16 head of 64
    src = rng.integers(0, 255, (rows, outer, seq, inner), dtype=np.uint8)
    base = rng.integers(0, 255, (rows, outer, pitch, inner), dtype=np.uint8)
    pos, nnew = np.array([0, 20, -1], np.int64), np.array([5, 3, 5], np.int64)
    s, d, p, n = dev.upload(src), dev.upload(base), dev.upload(pos), dev.upload(nnew)
    KERNELS.append_rows(dev.stream, s, d, p, n, rows, outer, seq, pitch, inner)
    assert np.array_equal(dev.get(d, base), _expected_append(base, src, pos, nnew))

    row_src, row_dst = rng.integers(0, 255, (3, 96), dtype=np.uint8), rng.integers(0, 255, (3, 96), dtype=np.uint8)
    rs, rd = dev.upload(row_src), dev.upload(row_dst)
    KERNELS.copy_rows(dev.stream, rs, rd, p, 3, 96)
    want = row_dst.copy()
    want[:2] = row_src[:2]
    assert np.array_equal(dev.get(rd, row_dst), want)


def test_captured_append_replays_with_new_positions(dev):
    rng = np.random.default_rng(1)
    rows, outer, seq, pitch, inner = 2, 2, 1, 16, 64  # a decode step
    src = rng.integers(0, 255, (rows, outer, seq, inner), dtype=np.uint8)
    base = np.zeros((rows, outer, pitch, inner), np.uint8)
    pos, nnew = np.array([3, 7], np.int64), np.ones(rows, np.int64)
    s, d, p, n = dev.upload(src), dev.upload(base), dev.upload(pos), dev.upload(nnew)
    graphs = GraphCache(cr, dev.stream)
    step = lambda: KERNELS.append_rows(dev.stream, s, d, p, n, rows, outer, seq, pitch, inner)  # noqa: E731
    assert graphs.run((rows, pitch), step) == "captured" and not graphs.failed, graphs.failed
    want = _expected_append(base, src, pos, nnew)
    assert np.array_equal(dev.get(d, base), want)  # the eager run wrote once; the capture did not run
    pos2 = np.array([4, 8], np.int64)
    dev.set(p, pos2)
    assert graphs.run((rows, pitch), step) == "replay"
    assert np.array_equal(dev.get(d, base), _expected_append(want, src, pos2, nnew))
    graphs.drop()
