"""emit_linear: every scheme x flavor in a one-layer graph, run by onnxruntime, vs numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from lineside.build.graph.linear import emit_linear, emit_lm_head
from lineside.build.quant.pack import unpack_int4
from lineside.build.quant.size import quantized_bytes
from lineside.build.quant.spec import QuantSpec
from lineside.errors import LinesideError
from tests.build.quant.conftest import build_one, run_graph

N, K = 96, 256


def ref_dequant(w: np.ndarray, scheme: str, group: int, scale_dtype=np.float32) -> np.ndarray:
    """The weight each scheme stands for: int8 re-stated independently (amax/127, round half to even);
    int4 is the quantizer's own grid (its search is tested in test_rtn.py)."""
    if scheme == "fp32":
        return w
    if scheme == "fp16":
        return w.astype(np.float16).astype(np.float32)
    if scheme == "w4a16":
        from lineside.build.quant.rtn import fake_quantize

        return fake_quantize(w, 4, group, scale_dtype)
    qmax, gs = (7, group) if scheme == "w4a16" else (127, w.shape[1])
    g = w.reshape(w.shape[0], -1, gs)
    s = (np.abs(g).max(-1, keepdims=True) / qmax).astype(scale_dtype).astype(np.float32)
    return (np.clip(np.rint(g / s), -qmax, qmax) * s).reshape(w.shape)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


CASES = [
    ("fp32", "cpu", 1e-6), ("fp16", "cpu", 1e-6), ("w8a16", "cpu", 1e-5), ("w4a16", "cpu", 1e-5),
    ("fp32", "trt", 1e-6), ("fp16", "trt", 1e-6), ("w8a16", "trt", 3e-3), ("w4a16", "trt", 3e-3),
]


@pytest.mark.parametrize("scheme,flavor,tol", CASES)
@pytest.mark.parametrize("group", [64, 128])
def test_scheme_flavor(tmp_path, rng, scheme, flavor, tol, group):
    if group == 128 and scheme in ("fp32", "fp16"):
        pytest.skip("group size unused")
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    b = rng.standard_normal(N).astype(np.float32)
    spec = QuantSpec(scheme, group, accuracy_level=0)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "layer", w, spec, flavor, bias=b), K, ["b", "t", N])
    x = rng.standard_normal((2, 5, K)).astype(np.float32)
    y = run_graph(path, {"x": x})
    sdt = np.float16 if flavor == "trt" else np.float32
    ref = x @ ref_dequant(w, scheme, group, sdt).T + b
    assert y.shape == (2, 5, N)
    assert rel_err(y, ref) < tol  # trt: fp16 activations and weights
    if scheme.startswith("w"):
        assert rel_err(y, x @ w.T + b) > 10 * tol or scheme == "w8a16"  # it really is quantized


@pytest.mark.parametrize("scheme,bits", [("w4a16", 4), ("w8a16", 8)])
def test_cpu_accuracy_level_4(tmp_path, rng, scheme, bits):
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    spec = QuantSpec(scheme, 64, accuracy_level=4)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", w, spec, "cpu"), K, ["b", "t", N])
    node = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits")
    assert {a.name: a.i for a in node.attribute}["bits"] == bits
    x = rng.standard_normal((1, 7, K)).astype(np.float32)
    assert rel_err(run_graph(path, {"x": x}), x @ ref_dequant(w, scheme, 64).T) < 2e-2


def test_cpu_w8_below_accuracy_4_is_float(tmp_path, rng):
    w = rng.standard_normal((N, K)).astype(np.float32)
    spec = QuantSpec("w8a16", accuracy_level=0)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", w, spec, "cpu"), K, ["b", "t", N])
    model = onnx.load(str(path))
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Identity"]
    wt = numpy_helper.to_array(model.graph.initializer[0])
    assert wt.dtype == np.float32 and wt.shape == (K, N)
    np.testing.assert_allclose(wt.T, ref_dequant(w, "w8a16", 0), rtol=1e-6)
    assert quantized_bytes((N, K), spec, flavor="cpu") == wt.nbytes


def test_trt_graph_is_tensorrt_int4(tmp_path, rng):
    """INT4 DequantizeLinear, axis 0 on [K, N], block 64/128, no zero point; bytes as quantized_bytes says."""
    w = rng.standard_normal((N, K)).astype(np.float32)
    for gs in (64, 128):
        spec = QuantSpec("w4a16", gs)
        path = build_one(tmp_path, lambda gb, x, spec=spec: emit_linear(gb, x, "l", w, spec, "trt"), K,
                         ["b", "t", N], name=f"m{gs}")
        model = onnx.load(str(path))
        assert model.ir_version >= 10 and any(o.domain in ("", "ai.onnx") and o.version == 21 for o in model.opset_import)
        inits = {t.name: t for t in model.graph.initializer}
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        assert len(dq) == 1 and not any(n.op_type == "MatMulNBits" for n in model.graph.node)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq[0].attribute}
        assert attrs == {"axis": 0, "block_size": gs}
        q, s = inits[dq[0].input[0]], inits[dq[0].input[1]]
        assert len(dq[0].input) == 2 or numpy_helper.to_array(inits[dq[0].input[2]]).max() == 0
        assert q.data_type == TensorProto.INT4 and list(q.dims) == [K, N]
        assert s.data_type == TensorProto.FLOAT16 and list(s.dims) == [K // gs, N]
        codes = unpack_int4(q.raw_data, K * N).reshape(K, N)
        assert codes.min() >= -8 and codes.max() <= 7
        deq = (codes.reshape(K // gs, gs, N) * numpy_helper.to_array(s).astype(np.float32)[:, None]).reshape(K, N)
        np.testing.assert_allclose(deq.T, ref_dequant(w, "w4a16", gs, np.float16), atol=1e-6)
        assert quantized_bytes((N, K), spec) == len(q.raw_data) + len(s.raw_data)


def test_trt_fp32_scales(tmp_path, rng):
    w = rng.standard_normal((N, K)).astype(np.float32)
    spec = QuantSpec("w4a16", 128, trt_dtype="fp32")
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", w, spec, "trt"), K, ["b", "t", N])
    model = onnx.load(str(path))
    assert not any(n.op_type == "Cast" for n in model.graph.node)
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    assert rel_err(run_graph(path, {"x": x}), x @ ref_dequant(w, "w4a16", 128).T) < 1e-5
    # onnxruntime's own default (QDQ fused to MatMulNBits at accuracy level 4) still runs it
    assert rel_err(run_graph(path, {"x": x}, qdq_accuracy=4), x @ ref_dequant(w, "w4a16", 128).T) < 2e-2


def test_rank2_input_and_shared_cast(tmp_path, rng):
    ws = [rng.standard_normal((N, K)).astype(np.float32) for _ in range(2)]
    spec = QuantSpec("w4a16", 64)

    def emit(gb, x):
        a = emit_linear(gb, x, "a", ws[0], spec, "trt")
        b = emit_linear(gb, x, "b", ws[1], spec, "trt")
        return gb.op("Add", [a, b])

    path = build_one(tmp_path, emit, None, ["t", N], in_shape=["t", K])
    assert sum(n.op_type == "Cast" and n.input[0] == "x" for n in onnx.load(str(path)).graph.node) == 1
    x = rng.standard_normal((4, K)).astype(np.float32)
    ref = x @ (ref_dequant(ws[0], "w4a16", 64, np.float16) + ref_dequant(ws[1], "w4a16", 64, np.float16)).T
    assert rel_err(run_graph(path, {"x": x}), ref) < 3e-3


def test_w8a16_cpu_without_power_of_two_block(tmp_path, rng):
    k = 72  # no power-of-two block >= 16 divides it: per-channel DequantizeLinear instead of MatMulNBits
    w = rng.standard_normal((N, k)).astype(np.float32)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", w, QuantSpec("w8a16"), "cpu"), k, ["b", "t", N])
    x = rng.standard_normal((1, 2, k)).astype(np.float32)
    assert rel_err(run_graph(path, {"x": x}), x @ ref_dequant(w, "w8a16", 0).T) < 1e-5


def test_lm_head_stays_8bit(tmp_path, rng):
    w = rng.standard_normal((N, K)).astype(np.float32)
    path = build_one(tmp_path, lambda gb, x: emit_lm_head(gb, x, w, QuantSpec("w4a16", 64), "cpu"),
                     K, ["b", "t", N])
    node = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits")
    assert next(a.i for a in node.attribute if a.name == "bits") == 8


@pytest.mark.parametrize("flavor,k", [("cpu", 577), ("trt", 96)])
def test_group_not_dividing_is_one_line(tmp_path, rng, flavor, k):
    """cpu takes a ragged last group of an even K (test_ragged_last_group_cpu); trt needs a block of 64 or 128
    that tiles K (test_trt_group_falls_back_to_64)."""
    from lineside.build.graph.builder import GraphBuilder

    gb = GraphBuilder(tmp_path / "m.onnx")
    w = rng.standard_normal((N, k)).astype(np.float32)
    with pytest.raises(LinesideError) as e:
        emit_linear(gb, "x", "model.layers.3.self_attn.q_proj", w, QuantSpec("w4a16", 128), flavor)
    msg = str(e.value)
    assert "\n" not in msg and "q_proj" in msg and str(k) in msg and ("--group-size" in msg or "--quant" in msg)


def test_bad_inputs_are_one_line(tmp_path, rng):
    from lineside.build.graph.builder import GraphBuilder

    gb = GraphBuilder(tmp_path / "m.onnx")
    w = rng.standard_normal((N, K)).astype(np.float32)
    for kwargs, needle in (
        ({"flavor": "tensorrt"}, "unknown graph flavor"),
        ({"bias": np.zeros(3)}, "bias of l has 3 values"),
        ({"awq_scale": np.zeros(K)}, "AWQ scale of l"),
    ):
        args = {"flavor": "cpu", **kwargs}
        with pytest.raises(LinesideError) as e:
            emit_linear(gb, "x", "l", w, QuantSpec("w4a16", 64), **args)
        assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(LinesideError):
        emit_linear(gb, "x", "l", w[0], QuantSpec("w4a16", 64), "cpu")


@pytest.mark.parametrize("scheme", ["fp32", "fp16", "w8a16", "w4a16"])
@pytest.mark.parametrize("trt_dtype", ["fp16", "fp32"])
def test_trt_graph_passes_tensorrt_op_check(tmp_path, rng, scheme, trt_dtype):
    from lineside.build.tensorrt.check import check_onnx_file

    w = rng.standard_normal((N, K)).astype(np.float32)
    spec = QuantSpec(scheme, 128, trt_dtype=trt_dtype)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", w, spec, "trt", bias=np.ones(N, np.float32),
                                                         awq_scale=np.full(K, 2.0, np.float32)), K, ["b", "t", N])
    for version in ("10.3", "10.15"):
        report = check_onnx_file(path, version)
        assert report.ok, report.offenders


def test_ragged_last_group_cpu(tmp_path, rng):
    """576 inputs in groups of 128 (SmolLM2): MatMulNBits reads a zero-padded last block; trt refuses."""
    from lineside.build.quant.rtn import fake_quantize

    w = rng.standard_normal((48, 576)).astype(np.float32)
    x = rng.standard_normal((2, 576)).astype(np.float32)
    spec = QuantSpec("w4a16", 128, accuracy_level=0)
    path = build_one(tmp_path, lambda gb, xx: emit_linear(gb, xx, "l", w, spec, "cpu"), 576, [2, 48],
                     in_shape=[2, 576])
    y = run_graph(path, {"x": x})
    assert rel_err(y, x @ fake_quantize(w, 4, 128).T) < 1e-5


def test_trt_group_falls_back_to_64(tmp_path, rng):
    """576 inputs at group 128 on the trt flavor: that layer's DequantizeLinear uses blocks of 64."""
    import onnx

    from lineside.build.quant.rtn import fake_quantize

    w = rng.standard_normal((48, 576)).astype(np.float32)
    x = rng.standard_normal((2, 576)).astype(np.float32)
    spec = QuantSpec("w4a16", 128, trt_dtype="fp32")
    spec.validate(576, "l", "trt")
    path = build_one(tmp_path, lambda gb, xx: emit_linear(gb, xx, "l", w, spec, "trt"), 576, [2, 48],
                     in_shape=[2, 576])
    dq = [n for n in onnx.load(str(path)).graph.node if n.op_type == "DequantizeLinear"]
    assert [a.i for n in dq for a in n.attribute if a.name == "block_size"] == [64]
    assert rel_err(run_graph(path, {"x": x}), x @ fake_quantize(w, 4, 64).T) < 1e-5


@pytest.mark.parametrize("trt_dtype", ["fp16", "fp32"])
def test_trt_int4_odd_outputs_padded_to_even(tmp_path, rng, trt_dtype):
    """TensorRT refuses INT4 with an odd last dimension: 33 outputs become a [K, 34] weight, sliced back."""
    from lineside.build.quant.rtn import fake_quantize
    from lineside.build.tensorrt.check import check_onnx_file

    w = rng.standard_normal((33, 128)).astype(np.float32)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    spec = QuantSpec("w4a16", 64, trt_dtype=trt_dtype)
    path = build_one(tmp_path, lambda gb, xx: emit_linear(gb, xx, "l", w, spec, "trt"), 128, [3, 33],
                     in_shape=[3, 128])
    model = onnx.load(str(path))
    [qw] = [t for t in model.graph.initializer if t.data_type == TensorProto.INT4]
    assert list(qw.dims) == [128, 34]
    sdt = np.float16 if trt_dtype == "fp16" else np.float32
    y = run_graph(path, {"x": x})
    assert y.shape == (3, 33) and rel_err(y, x @ fake_quantize(w, 4, 64, sdt).T) < 3e-3
    assert check_onnx_file(path, "10.3").ok
