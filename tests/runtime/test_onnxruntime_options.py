"""onnxruntime session settings the backend chooses: intra-op spinning is on (within a run) unless LINESIDE_ORT_SPIN=0 or
spin=False."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.runtime.onnxruntime_backend import SPIN_ENV, OnnxRuntimeBackend


def _spin(be: OnnxRuntimeBackend) -> str:
    return be.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.parametrize("env,arg,want", [(None, None, "1"), ("0", None, "0"), ("0", True, "1"), (None, False, "0")])
def test_spinning(tiny_bundle, monkeypatch, env, arg, want):
    if env is None:
        monkeypatch.delenv(SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(SPIN_ENV, env)
    be = OnnxRuntimeBackend(open_bundle(tiny_bundle), spin=arg)
    assert _spin(be) == want and be.spinning == (want == "1")
    # a spinning pool stops when its run ends: a second session's pool (the prefill graph) must not spin against it
    assert be.session.get_session_options().get_session_config_entry("session.force_spinning_stop") == want


def test_spinning_between_runs_on_request(tiny_bundle, monkeypatch):
    """LINESIDE_ORT_SPIN=keep: threads spin and keep spinning after a run (what the default was, to compare)."""
    monkeypatch.setenv(SPIN_ENV, "keep")
    be = OnnxRuntimeBackend(open_bundle(tiny_bundle))
    assert _spin(be) == "1" and be.spinning
    assert be.session.get_session_options().get_session_config_entry("session.force_spinning_stop") == "0"


def test_a_trt_only_w4a16_bundle_runs_exact_on_onnxruntime(tiny_bundles):
    """onnxruntime fuses the trt graph's fp16 DequantizeLinear+MatMul into MatMulNBits at its own default accuracy
    level 4 unless told otherwise (SmolLM2's trt-only bundle then answered all-zero logits); the backend runs the
    trt flavor at level 0, so its default logits are those of an explicit level 0."""
    from lineside.runtime.generate import compute_logits

    b = open_bundle(tiny_bundles(quant="w4a16", flavors=("trt",), max_seq_len=64, group_size=64))
    ids = [3, 17, 5, 42, 9, 11]
    default = OnnxRuntimeBackend(b)
    level0 = OnnxRuntimeBackend(b, accuracy_level=0)
    level4 = OnnxRuntimeBackend(b, accuracy_level=4)
    got, want, fused4 = (compute_logits(x, ids) for x in (default, level0, level4))
    assert default.accuracy_level == 0
    assert np.abs(got).max() > 0 and np.allclose(got, want, atol=1e-5, rtol=0)
    assert not np.allclose(fused4, want, atol=1e-5, rtol=0)  # what the default was: level 4 differs


def _vm_flags(arr: np.ndarray) -> list[str]:
    """The VmFlags of the mapping holding ``arr``'s first byte (Linux /proc/self/smaps)."""
    addr, flags, inside = arr.ctypes.data, None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
                break
    assert flags is not None, "no mapping holds the array"
    return flags


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_NOHUGEPAGE"), reason="Linux-only madvise flag")
def test_the_kv_arena_is_not_on_huge_pages(tiny_bundle):
    """numpy madvises huge pages for large arrays: the first write into a new slot then faulted in a 2 MB page per
    layer tensor (about 120 MB, 0.1-0.8 s, in the first step reaching that slot on SmolLM2). The arena's large state
    tensors are advised MADV_NOHUGEPAGE (VmFlags "nh"), start zeroed, and take writes; small ones stay np.zeros."""
    from lineside.runtime.onnxruntime_backend import arena_zeros

    big = arena_zeros((4, 3, 2048, 64), np.float32)
    assert "nh" in _vm_flags(big) and big.flags.writeable and not big.any()
    big[3, 2, 2047] = 1.5
    assert big.sum() == 1.5 * 64
    small = arena_zeros((2, 8), np.float16)
    assert small.dtype == np.float16 and small.shape == (2, 8) and not small.any()
    be = OnnxRuntimeBackend(open_bundle(tiny_bundle), num_slots=128)
    large = [a for a in be.arena.values() if a.nbytes >= 1 << 21]
    assert large and all("nh" in _vm_flags(a) for a in large)


def test_a_prefill_graph_this_onnxruntime_cannot_load_leaves_prompts_on_the_4bit_graph(tiny_bundles, monkeypatch,
                                                                                        caplog):
    """The int8 prefill graph only speeds prompts up. Python 3.10's newest onnxruntime (1.23; pyproject allows
    >= 1.20) refuses it at load ('[ShapeInferenceError] Incompatible dimensions' at an o_proj smoothing Mul) while
    it runs the bundle's main graph: generate and serve failed on the whole bundle. Prompts then run on the 4-bit
    graph, as on a CPU whose int8 product saturates, and a warning names why."""
    import logging

    from lineside.runtime import onnxruntime_backend as mod
    from lineside.runtime.backend import StepBatch

    bundle = open_bundle(tiny_bundles(quant="w4a16", group_size=32, max_seq_len=64))
    assert bundle.flavor("cpu").prefill_graph  # built by default at accuracy level 4
    monkeypatch.setenv(mod.PREFILL_ENV, "0")
    want = OnnxRuntimeBackend(bundle, num_slots=1, threads=1).forward(StepBatch.single(0, [1, 2, 3, 4, 5], 0))
    monkeypatch.delenv(mod.PREFILL_ENV)
    monkeypatch.setattr(mod, "host_int8_gemm_exact", lambda: True)  # the graph would be used on this CPU
    real = mod.open_session

    def older_onnxruntime(ort, graph, *args, **kwargs):
        if graph.name == "model.prefill.onnx":
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model failed:Node (x/prefill_smoothed) Op (Mul) "
                               "[ShapeInferenceError] Incompatible dimensions")
        return real(ort, graph, *args, **kwargs)

    monkeypatch.setattr(mod, "open_session", older_onnxruntime)
    with caplog.at_level(logging.WARNING, logger="lineside.runtime"):
        be = OnnxRuntimeBackend(bundle, num_slots=1, threads=1)
    assert be.prefill_session is None
    assert "model.prefill.onnx" in caplog.text and "Incompatible dimensions" in caplog.text
    # onnxruntime 1.22-1.30 refuse the prefill graph of a bundle built before the emitter's fix, and Python 3.10 has
    # no onnxruntime newer than 1.23: "upgrade onnxruntime" alone was advice it could not take
    assert "rebuild the bundle" in caplog.text
    np.testing.assert_array_equal(be.forward(StepBatch.single(0, [1, 2, 3, 4, 5], 0)), want)


@pytest.mark.parametrize("version", ["1.20.1", "1.21.1", "1.19.2+cu118"])
def test_an_onnxruntime_older_than_lineside_needs_is_refused_in_one_line(tiny_bundle, monkeypatch, version):
    """onnxruntime 1.20 and 1.21 (Jetson's NVIDIA wheels are of that era) run no 8-bit MatMulNBits (a w4a16 bundle's
    LM head, every w8a16 linear): loading failed with a C++ assertion and no word of which version works."""
    import onnxruntime as ort

    from lineside.errors import LinesideError

    monkeypatch.setattr(ort, "__version__", version)
    with pytest.raises(LinesideError) as e:
        OnnxRuntimeBackend(open_bundle(tiny_bundle))
    msg = str(e.value)
    assert "\n" not in msg and version in msg and "1.22" in msg and "pip install -U onnxruntime" in msg


@pytest.mark.parametrize("version", ["1.22.0", "1.23.2", "1.32.0", "2.0.0", "1.24.0.dev20260101"])
def test_onnxruntime_1_22_and_newer_are_taken(monkeypatch, version):
    from lineside.runtime.onnxruntime_backend import check_onnxruntime_version

    check_onnxruntime_version(version)


def test_pyproject_asks_for_the_onnxruntime_the_backend_takes():
    """pip must not resolve an onnxruntime the backend then refuses (pyproject said >= 1.20)."""
    import re
    from pathlib import Path

    from lineside.runtime.onnxruntime_backend import MIN_ONNXRUNTIME

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    pins = re.findall(r'^\s*"onnxruntime([^"]*)"', text, re.MULTILINE)  # tomllib is 3.11+
    assert pins == [">={}.{}".format(*MIN_ONNXRUNTIME)], pins
