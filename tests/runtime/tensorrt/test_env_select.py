"""One-line messages when TensorRT / cuda-python / a GPU / a driver are missing, and --backend selection."""

from __future__ import annotations

import sys
import types
from enum import IntEnum

import pytest

from lineside.errors import BackendUnavailable, LinesideError
from lineside.runtime import select
from lineside.runtime.tensorrt import env as trt_env


class Err(IntEnum):
    cudaSuccess = 0
    cudaErrorNoDevice = 100
    cudaErrorInsufficientDriver = 35


def _fake_cuda(monkeypatch, count_result):
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaGetDeviceCount = lambda: count_result
    cuda.bindings = bindings
    bindings.runtime = rt
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", rt)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_missing_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(BackendUnavailable) as e:
        trt_env.import_tensorrt()
    msg = str(e.value)
    assert msg.startswith("TensorRT is not installed") and "--backend onnxruntime" in msg and "\n" not in msg


def test_missing_cuda_python(monkeypatch):
    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailable, match="^cuda-python is not installed"):
        trt_env.import_cudart()


def test_insufficient_driver(monkeypatch):
    _fake_cuda(monkeypatch, (Err.cudaErrorInsufficientDriver, 0))
    with pytest.raises(BackendUnavailable) as e:
        trt_env.probe_gpu()
    assert "cudaErrorInsufficientDriver" in str(e.value) and "driver" in str(e.value)


def test_driver_older_than_cuda_python(monkeypatch):
    """A CUDA 12.8 driver under cuda-python built for CUDA 13: say which cuda-python to install instead."""
    _fake_cuda(monkeypatch, (Err.cudaErrorInsufficientDriver, 0))
    rt = sys.modules["cuda.bindings.runtime"]
    rt.cudaDriverGetVersion = lambda: (Err.cudaSuccess, 12080)
    rt.cudaRuntimeGetVersion = lambda: (Err.cudaSuccess, 13000)
    with pytest.raises(BackendUnavailable) as e:
        trt_env.probe_gpu()
    msg = str(e.value)
    assert msg.startswith("the NVIDIA driver supports CUDA 12.8 but this cuda-python is built for CUDA 13.0")
    assert "pip install 'cuda-python>=12.0,<13'" in msg and "\n" not in msg
    rt.cudaDriverGetVersion = lambda: (Err.cudaSuccess, 0)  # no driver at all: the plain message
    with pytest.raises(BackendUnavailable, match="^the NVIDIA driver is missing or too old"):
        trt_env.probe_gpu()


def test_no_gpu(monkeypatch):
    _fake_cuda(monkeypatch, (Err.cudaErrorNoDevice, 0))
    with pytest.raises(BackendUnavailable, match="^no CUDA GPU found"):
        trt_env.probe_gpu()
    _fake_cuda(monkeypatch, (Err.cudaSuccess, 0))
    with pytest.raises(BackendUnavailable, match="^no CUDA GPU found"):
        trt_env.probe_gpu()


def test_auto_falls_back_to_onnxruntime_and_says_why(trt_bundle, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    _fake_cuda(monkeypatch, (Err.cudaErrorInsufficientDriver, 0))
    dec = select.decide_backend(trt_bundle("fp16"), "auto")
    assert dec.backend == "onnxruntime" and "cudaErrorInsufficientDriver" in dec.reason
    assert dec.message.startswith("backend: onnxruntime (TensorRT not used:")
    with pytest.raises(BackendUnavailable, match="InsufficientDriver"):
        select.decide_backend(trt_bundle("fp16"), "tensorrt")
    assert select.decide_backend(trt_bundle("fp16"), "onnxruntime").backend == "onnxruntime"
    with pytest.raises(LinesideError, match="not one of"):
        select.decide_backend(trt_bundle("fp16"), "cuda")


def test_auto_picks_tensorrt_when_engine_matches(trt_bundle, monkeypatch, tmp_path):
    from lineside.runtime.tensorrt import key as keymod

    b = trt_bundle("fp16")
    here = keymod.MachineKey("Orin", "8.7", "10.3.0", "12.6")
    monkeypatch.setattr(keymod, "machine_key", lambda: here)
    dec = select.decide_backend(b, "auto")
    assert dec.backend == "onnxruntime" and "no TensorRT engine" in dec.reason
    from tests.build.tensorrt.test_key_profiles import _fake_engine

    fl = b.flavor("trt")
    d = _fake_engine(b.path, here, b.manifest.files[fl.graph].sha256)
    try:
        dec = select.decide_backend(b, "auto")
        assert dec.backend == "tensorrt" and here.key in dec.reason
    finally:
        import shutil

        shutil.rmtree(d.parent)


def test_choose_backend_onnxruntime(trt_bundle):
    said = []
    be = select.choose_backend(trt_bundle("fp16"), "onnxruntime", num_slots=2, say=said.append)
    assert be.name == "onnxruntime" and be.num_slots == 2
    assert said == ["backend: onnxruntime (asked for with --backend onnxruntime)"]
    be.close()


def test_nvrtc_failure_is_one_line(monkeypatch):
    from lineside.runtime.tensorrt import kernels as trt_kernels

    def boom():
        raise RuntimeError("Failed to dlopen libnvrtc.so.12\nmore")

    monkeypatch.setattr(trt_kernels, "import_nvrtc", boom)
    with pytest.raises(BackendUnavailable, match="^cannot compile the KV-append kernels with NVRTC .*libnvrtc"):
        trt_kernels.StateKernels("8.7")


def test_cli_engine_without_tensorrt(trt_bundle, monkeypatch, capsys):
    from lineside.cli import main

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(SystemExit) as e:
        main(["engine", str(trt_bundle("fp16").path)])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: TensorRT is not installed")
    # `lineside engine` has no --backend: the way round is to serve without an engine, named as a command
    assert "use --backend" not in err[0] and "`lineside serve " in err[0] and "--backend onnxruntime`" in err[0], err
