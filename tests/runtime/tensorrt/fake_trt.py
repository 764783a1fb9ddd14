"""CPU stand-ins for tensorrt, cuda-python's runtime and the NVRTC state kernels, for the backend tests.

"Device" memory is host memory (pointers are real addresses), every copy is a real copy, the
"engine" runs the bundle's trt graph with onnxruntime from the tensor addresses it was given, and
stream capture records the operations that a later cudaGraphLaunch replays — so the backend's
addresses, shapes, re-layouts, append kernels and graph replays are all exercised for real.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import types
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tests.runtime.tensorrt.trt_api import StrictModule, load_api, release_for

ORT_TO_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(uint8)": np.uint8,
             "tensor(int32)": np.int32}


class Err(IntEnum):
    """cuda-python's cudaError_t members the fake returns (real names and values)."""

    cudaSuccess = 0
    cudaErrorMemoryAllocation = 2
    cudaErrorECCUncorrectable = 214
    cudaErrorInvalidResourceHandle = 400
    cudaErrorIllegalAddress = 700
    cudaErrorHardwareStackError = 714
    cudaErrorLaunchFailure = 719
    cudaErrorStreamCaptureUnsupported = 900


class Fault(Enum):
    """What ``Device.inject`` makes go wrong, as it does on a GPU."""

    # a kernel of the next engine run faults: the error is sticky, every later CUDA call returns it and TensorRT's
    # execute_async_v3 answers False (the fault itself surfaces asynchronously, at the next synchronising call)
    ILLEGAL_ADDRESS = Err.cudaErrorIllegalAddress
    LAUNCH_FAILURE = Err.cudaErrorLaunchFailure
    ECC_UNCORRECTABLE = Err.cudaErrorECCUncorrectable
    HARDWARE_STACK_ERROR = Err.cudaErrorHardwareStackError
    # execute_async_v3 on more rows than ``above_batch`` answers False, cudaGetLastError cudaErrorMemoryAllocation
    OUT_OF_MEMORY = Err.cudaErrorMemoryAllocation
    # the next ``count`` cudaGraphLaunch calls fail (recoverably) with cudaErrorInvalidResourceHandle
    GRAPH_REPLAY = Err.cudaErrorInvalidResourceHandle


STICKY_FAULTS = (Fault.ILLEGAL_ADDRESS, Fault.LAUNCH_FAILURE, Fault.ECC_UNCORRECTABLE, Fault.HARDWARE_STACK_ERROR)


class Device:
    """Allocations, the current capture, what ran, and the faults injected (``inject``)."""

    def __init__(self, capture_ok: bool = True):
        self.keep: list[np.ndarray] = []
        self.capturing: list | None = None
        self.capture_ok = capture_ok
        self.launched_graphs = 0
        self.eager_engine_runs = 0
        self.free_mem = 1 << 34  # cudaMemGetInfo's free bytes
        self.integrated = False  # cudaDeviceProp.integrated: memory shared with the CPU (a Jetson)
        self.sticky: Err | None = None  # set once a sticky fault happened: the context is lost
        self.last_error = Err.cudaSuccess  # what cudaGetLastError returns (and clears, unless sticky)
        self.pending_fault: Fault | None = None  # a sticky fault waiting for the next engine run
        self.enqueue_fault: Fault | None = None  # ... for the next execute_async_v3 call
        self.oom_above_batch: int | None = None
        self.failing_replays = 0

    def inject(self, fault: Fault, *, above_batch: int = 1, count: int = 1, at_enqueue: bool = False) -> None:
        """The one switch for failures: a sticky fault at the next engine run (``at_enqueue``: reported by the next
        execute_async_v3 itself, which answers False, as when TensorRT finds an earlier kernel's fault), out of
        memory above a batch size, or ``count`` failing graph replays."""
        if fault in STICKY_FAULTS and at_enqueue:
            self.enqueue_fault = fault
        elif fault in STICKY_FAULTS:
            self.pending_fault = fault
        elif fault == Fault.OUT_OF_MEMORY:
            self.oom_above_batch = above_batch
        else:
            self.failing_replays = count

    def alloc(self, n: int) -> int:
        a = np.zeros(max(n, 1) + 256, dtype=np.uint8)
        self.keep.append(a)
        return (a.ctypes.data + 255) // 256 * 256

    def run(self, fn: Any) -> None:
        if self.capturing is not None:
            self.capturing.append(fn)
        else:
            fn()


def read(ptr: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = (ctypes.c_uint8 * n).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape))).reshape(shape).copy()


def write(ptr: int, arr: np.ndarray) -> None:
    arr = np.ascontiguousarray(arr)
    ctypes.memmove(ptr, arr.ctypes.data, arr.nbytes)


def make_cudart(dev: Device, name: str = "Fake GPU", sm: tuple[int, int] = (8, 7)) -> types.ModuleType:
    m = types.ModuleType("cuda.bindings.runtime")
    ok = Err.cudaSuccess
    m.cudaStreamNonBlocking = 1
    m.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2,
                                             cudaMemcpyDeviceToDevice=3)
    m.cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=1)
    m.cudaGetDeviceCount = lambda: (ok, 1)
    m.cudaGetDeviceProperties = lambda d: (ok, types.SimpleNamespace(name=name.encode(), major=sm[0], minor=sm[1],
                                                                     totalGlobalMem=1 << 34,
                                                                     integrated=int(dev.integrated)))
    m.cudaRuntimeGetVersion = lambda: (ok, 12060)
    m.cudaDriverGetVersion = lambda: (ok, 12060)
    m.cudaSetDevice = lambda d: (ok,)
    m.cudaFree = lambda p: (ok,)
    m.cudaFreeHost = lambda p: (ok,)
    m.cudaMalloc = lambda n: (ok, dev.alloc(n))
    m.cudaMallocHost = lambda n: (ok, dev.alloc(n))
    m.cudaStreamCreateWithFlags = lambda f: (ok, 7)
    m.cudaStreamSynchronize = lambda s: (ok,)
    m.cudaStreamDestroy = lambda s: (ok,)

    def memcpy(dst, src, n, kind, stream):
        dev.run(lambda: ctypes.memmove(int(dst), int(src), int(n)))
        return (ok,)

    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        def go():
            for r in range(height):
                ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        dev.run(go)
        return (ok,)

    def memset(ptr, v, n, stream):
        dev.run(lambda: ctypes.memset(int(ptr), v, int(n)))
        return (ok,)

    def begin(stream, mode):
        if not dev.capture_ok:
            return (Err.cudaErrorStreamCaptureUnsupported,)
        dev.capturing = []
        return (ok,)

    def end(stream):
        ops, dev.capturing = dev.capturing, None
        return (ok, ops)

    def launch_graph(gexec, stream):
        if dev.failing_replays:
            dev.failing_replays -= 1
            return (Err.cudaErrorInvalidResourceHandle,)
        dev.launched_graphs += 1
        for fn in gexec:
            fn()
        return (ok,)

    m.cudaMemcpyAsync = memcpy
    m.cudaMemcpy2DAsync = memcpy2d
    m.cudaMemsetAsync = memset
    m.cudaStreamBeginCapture = begin
    m.cudaStreamEndCapture = end
    def last_error():
        err = dev.last_error
        if dev.sticky is None:
            dev.last_error = ok
        return (err,)

    m.cudaGraphInstantiate = lambda g, flags: (ok, list(g))
    m.cudaGraphLaunch = launch_graph
    m.cudaGraphDestroy = lambda g: (ok,)
    m.cudaGraphExecDestroy = lambda g: (ok,)
    m.cudaMemGetInfo = lambda: (ok, dev.free_mem, 1 << 34)
    m.cudaGetLastError = last_error
    # a lost context: every call returns the sticky error (with None for the values it would have returned)
    for fname, values in ((n, RETURNS.get(n, 0)) for n in dir(m) if n.startswith("cuda") and callable(getattr(m, n))):
        setattr(m, fname, _sticky_wrapped(dev, getattr(m, fname), values))
    return m


RETURNS = {"cudaGetDeviceCount": 1, "cudaGetDeviceProperties": 1, "cudaRuntimeGetVersion": 1,
           "cudaDriverGetVersion": 1, "cudaMalloc": 1, "cudaMallocHost": 1, "cudaStreamCreateWithFlags": 1,
           "cudaStreamEndCapture": 1, "cudaGraphInstantiate": 1, "cudaMemGetInfo": 2}


def _sticky_wrapped(dev: Device, fn: Any, values: int) -> Any:
    @functools.wraps(fn)  # the signature stays the real call's (test_cuda_real checks the arities)
    def call(*args: Any) -> Any:
        if dev.sticky is not None and fn.__name__ != "last_error":
            return (dev.sticky, *([None] * values))
        return fn(*args)
    return call


class FakeKernels:
    """The two CUDA kernels of trt_kernels.SOURCE, in numpy, with the same arguments."""

    def __init__(self, dev: Device):
        self.dev = dev

    def _launched(self) -> None:
        """cuLaunchKernel into a lost context returns its sticky error, which StateKernels reports as it would."""
        if self.dev.sticky is not None:
            from lineside.runtime.tensorrt.kernels import _ok
            _ok((self.dev.sticky,), "cuLaunchKernel")

    def append_rows(self, stream, src, dst, pos, nnew, rows, outer, seq, pitch, inner_bytes):
        self._launched()

        def go():
            if self.dev.sticky is not None:
                return
            p, n = read(pos, np.int64, (rows,)), read(nnew, np.int64, (rows,))
            for b in range(rows):
                if p[b] < 0:
                    continue
                for o in range(outer):
                    k = int(min(n[b], seq))
                    if k > 0:
                        ctypes.memmove(dst + ((b * outer + o) * pitch + int(p[b])) * inner_bytes,
                                       src + ((b * outer + o) * seq) * inner_bytes, k * inner_bytes)
        self.dev.run(go)

    def copy_rows(self, stream, src, dst, pos, rows, row_bytes):
        self._launched()

        def go():
            if self.dev.sticky is not None:
                return
            p = read(pos, np.int64, (rows,))
            for b in range(rows):
                if p[b] >= 0:
                    ctypes.memmove(dst + b * row_bytes, src + b * row_bytes, row_bytes)
        self.dev.run(go)


class _Ctx:
    def __init__(self, eng: _Engine, strategy: int):
        self.eng, self.addr, self.shape, self.profile = eng, {}, {}, None
        self.strategy, self.memory = strategy, None

    def set_device_memory(self, memory, size):
        assert self.strategy == 2 and size >= self.eng.device_memory_size_v2  # USER_MANAGED, big enough
        self.memory = (int(memory), int(size))

    def set_optimization_profile_async(self, i, stream):
        assert isinstance(stream, int)
        self.profile = i
        return True

    def set_tensor_address(self, name, addr):
        self.addr[name] = int(addr)
        return True

    def set_input_shape(self, name, shape):
        mn, _, mx = self.eng.profiles[self.profile][name]
        if not all(a <= s <= b for a, s, b in zip(mn, shape, mx, strict=True)):
            return False  # TensorRT logs the profile's bounds and answers False
        self.shape[name] = tuple(int(s) for s in shape)
        return True

    def execute_async_v3(self, stream):
        assert isinstance(stream, int)
        assert self.strategy != 2 or self.memory is not None, "USER_MANAGED context run without device memory"
        addr, shape = dict(self.addr), dict(self.shape)
        dev = self.eng.dev
        if dev.enqueue_fault is not None:
            dev.sticky = dev.last_error = dev.enqueue_fault.value
            dev.enqueue_fault = None
        if dev.sticky is not None:  # TensorRT checks the stream first: the error of an earlier fault
            return False
        if dev.oom_above_batch is not None and shape["input_ids"][0] > dev.oom_above_batch:
            dev.last_error = Err.cudaErrorMemoryAllocation
            return False

        def go():
            if dev.sticky is not None:
                return
            if dev.pending_fault is not None:  # the kernel faults: nothing written, the context is lost
                dev.sticky, dev.last_error = dev.pending_fault.value, dev.pending_fault.value
                dev.pending_fault = None
                return
            sess = self.eng.sess
            feed = {i.name: read(addr[i.name], ORT_TO_NP[i.type], shape[i.name]) for i in sess.get_inputs()}
            outs = sess.run(None, feed)
            for o, v in zip(sess.get_outputs(), outs, strict=True):
                write(addr[o.name], v.astype(ORT_TO_NP[o.type]))
            self.eng.dev.eager_engine_runs += self.eng.dev.capturing is None
        self.eng.dev.run(go)
        return True


class _Engine:
    def __init__(self, dev: Device, graph: Path, profiles: list[dict[str, Any]]):
        self.dev = dev
        self.sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        self.names = [t.name for t in self.sess.get_inputs()] + [t.name for t in self.sess.get_outputs()]
        self.profiles = profiles
        self.num_io_tensors = len(self.names)

    def get_tensor_name(self, i):
        return self.names[i]

    @property
    def device_memory_size_v2(self):
        return 4096

    def create_execution_context(self, strategy=0):
        return _Ctx(self, strategy)


def _callback(fn: Any, *args: Any, failed: Any = None) -> Any:
    """A progress-monitor callback as TensorRT's pybind trampoline (PyProgressMonitor, python/src/infer/pyCore.cpp)
    makes it: an exception from the Python override — KeyboardInterrupt included — is printed and swallowed there;
    step_complete then answers False, which cancels the build."""
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 - what the C++ catch (...) does
        print(f"[ERROR] Exception caught in {fn.__name__}(): {e!r}", file=sys.stderr)
        return failed


def make_tensorrt(dev: Device, version: str = "10.3.0") -> StrictModule:
    """Builder + runtime: the 'engine' is a JSON record of the graph path and the profiles it was built with."""
    import json

    m = types.ModuleType("tensorrt")
    m.__version__ = version
    m.fail = None  # "parse" | "build" | "plan-version" | "plan-gpu" | "plan-corrupt": make that step fail

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class IProgressMonitor:
        def __init__(self):
            pass

    class ILogger:  # lineside subclasses it (a real class, as in TensorRT's bindings); severities as TensorRT's
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        def __init__(self):
            pass

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, mn, op, mx):
            assert all(a <= b <= c for a, b, c in zip(mn, op, mx, strict=True)), (name, mn, op, mx)
            self.shapes[name] = (tuple(mn), tuple(op), tuple(mx))

    class Cache:
        def __init__(self, data):
            self.data = data

        def serialize(self):
            return self.data or b"timing"

    class Config:
        def __init__(self):
            self.flags, self.profiles, self.pool, self.progress_monitor = set(), [], {}, None
            self.builder_optimization_level = 3

        def set_flag(self, f):
            self.flags.add(f)

        def set_memory_pool_limit(self, kind, n):
            self.pool[kind] = n

        def create_timing_cache(self, data):
            return Cache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

        def add_optimization_profile(self, p):
            self.profiles.append(p)
            return len(self.profiles) - 1

    class Network:
        graph = None

    class ParserError:
        def desc(self):
            return "Assertion failed: unsupported INT8 Gather input"

        def node_name(self):
            return "embed_tokens/gather_codes"

        def node_operator(self):
            return "Gather"

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.num_errors = network, 0

        def parse_from_file(self, path):
            self.network.graph = path
            if m.fail == "parse":
                self.num_errors = 2
                return False
            return True

        def get_error(self, i):
            return ParserError()

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return Network()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            if m.fail == "build":
                return None
            mon = config.progress_monitor
            _callback(mon.phase_start, "Building engine", None, 2)
            for step in range(2):
                if not _callback(mon.step_complete, "Building engine", step, failed=False):
                    return None  # cancelled: TensorRT builds no engine (phase_finish may or may not come)
            _callback(mon.phase_finish, "Building engine")
            rec = {"graph": network.graph, "profiles": [{k: [list(x) for x in v] for k, v in p.shapes.items()}
                                                        for p in config.profiles],
                   "fp16": "FP16" in config.flags}
            return json.dumps(rec).encode()

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data):
            # m.fail: "plan-version" / "plan-gpu" (a plan from another TensorRT / GPU), "plan-corrupt": TensorRT logs
            # its reason and answers None (the messages are TensorRT 10's)
            reason = {"plan-version": "The engine plan file is not compatible with this version of TensorRT, "
                                      "expecting library version 10.3.0.30 got 10.0.1.6, please rebuild.",
                      "plan-gpu": "The engine plan file is generated on an incompatible device, expecting compute "
                                  "8.7 got compute 8.9, please rebuild.",
                      "plan-corrupt": "IRuntime::deserializeCudaEngine: Error Code 1: Serialization (Serialization "
                                      "assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)"}.get(m.fail)
            if reason is not None:
                self.logger.log(m.ILogger.ERROR, reason)
                return None
            rec = json.loads(bytes(data))
            return _Engine(dev, Path(rec["graph"]), rec["profiles"])

    m.ILogger = ILogger
    m.Logger, m.IProgressMonitor, m.Builder, m.OnnxParser, m.Runtime = Logger, IProgressMonitor, Builder, OnnxParser, Runtime
    m.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)
    m.BuilderFlag = types.SimpleNamespace(FP16="FP16")
    m.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    m.ExecutionContextAllocationStrategy = types.SimpleNamespace(STATIC=0, ON_PROFILE_CHANGE=1, USER_MANAGED=2)
    # lineside sees the fake through the real API of the release it claims to be (tests/runtime/tensorrt/trt_api.py);
    # IProgressMonitor stays a real class because lineside subclasses it.
    return StrictModule(m, load_api(release_for(version)), passthrough=("IProgressMonitor", "ILogger", "fail"))


def install(monkeypatch: Any, capture_ok: bool = True, gpu: str = "Fake GPU", trt_version: str = "10.3.0") -> Device:
    """Put the fakes where lineside's lazy imports find them."""
    import sys

    import lineside.runtime.tensorrt.backend as tb

    dev = Device(capture_ok)
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    rt = make_cudart(dev, gpu)
    cuda.bindings, bindings.runtime = bindings, rt
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", rt),
                      ("tensorrt", make_tensorrt(dev, trt_version))):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(tb, "StateKernels", lambda sm: FakeKernels(dev))
    return dev
