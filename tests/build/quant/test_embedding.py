"""emit_embedding: float tables, int8 codes + block scales, GGUF Q8_0/Q4_0/Q4_1 tables carried exactly."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from lineside.build.graph.builder import GraphBuilder
from lineside.build.graph.embedding import embedding_reference, emit_embedding
from lineside.build.graph.linear import emit_lm_head
from lineside.build.quant.spec import QuantSpec
from lineside.build.tensorrt.check import check_onnx_file
from tests.build.quant.conftest import build_one, run_graph
from tests.build.quant.test_ggml import make_blocks

V, H = 300, 576


def run_embedding(tmp_path, weight, spec, flavor, ids):
    dims = [f"d{i}" for i in range(ids.ndim)]
    path = build_one(tmp_path, lambda gb, x: emit_embedding(gb, x, weight, spec, flavor), None, [*dims, H],
                     in_type=TensorProto.INT64, in_shape=dims)
    return path, run_graph(path, {"x": ids})


@pytest.mark.parametrize("flavor", ["cpu", "trt"])
@pytest.mark.parametrize("scheme,tol", [("fp32", 0), ("fp16", 1e-3), ("w8a16", 1e-2), ("w4a16", 1e-2)])
def test_float_source(tmp_path, rng, flavor, scheme, tol):
    w = rng.standard_normal((V, H)).astype(np.float32)
    ids = rng.integers(0, V, size=(2, 5))
    path, y = run_embedding(tmp_path, w, QuantSpec(scheme, 64), flavor, ids)
    ref = w[ids]
    assert y.shape == (2, 5, H)
    assert np.abs(y - ref).max() <= tol * np.abs(ref).max()
    if scheme.startswith("w") and flavor == "cpu":
        model = onnx.load(str(path), load_external_data=False)
        table = next(t for t in model.graph.initializer if t.name.endswith(".qweight"))
        # w4a16 and w8a16 both keep 8-bit codes, MatMulNBits layout, per-row scale (the w8a16 grid, shareable
        # with the head): error bound scale/2 = amax/254
        assert table.data_type == TensorProto.UINT8 and list(table.dims) == [V, H // 64, 64]
        amax = np.abs(w[ids]).max(-1, keepdims=True)
        assert np.all(np.abs(y - ref) <= amax / 254 * (1 + 1e-5))
    if flavor == "trt" and scheme != "fp32":  # TensorRT 10.3 Gathers no INT8: a float16 table
        model = onnx.load(str(path), load_external_data=False)
        assert [t.data_type for t in model.graph.initializer if t.name.endswith(".weight")] == [TensorProto.FLOAT16]
        assert check_onnx_file(path, "10.3").ok


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_ggml_tables(tmp_path, rng, ggml_type, flavor):
    blocks = make_blocks(rng, ggml_type, n=V, k=H, shift=0.02)
    ids = rng.integers(0, V, size=(3, 4))
    _, y = run_embedding(tmp_path, blocks, QuantSpec("w4a16"), flavor, ids)
    ref = blocks.dequantize()[ids]
    if flavor == "cpu":  # carried exactly
        np.testing.assert_array_equal(y, ref)
    else:  # float16 table
        np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("source", ["Q8_0", "float"])
@pytest.mark.parametrize("head_first", [False, True])
def test_tied_embedding_shares_lm_head_table(tmp_path, rng, source, head_first):
    w = make_blocks(rng, "Q8_0", n=V, k=H) if source == "Q8_0" else rng.standard_normal((V, H)).astype(np.float32)
    spec = QuantSpec("w4a16", 64)  # accuracy level 4; the head stays 8-bit
    gb = GraphBuilder(tmp_path / "tied.onnx")
    ids = gb.input("ids", TensorProto.INT64, ["b", "t"])
    x = gb.input("x", TensorProto.FLOAT, ["b", "t", H])
    if head_first:
        logits = emit_lm_head(gb, x, w, spec, "cpu")
        emb = emit_embedding(gb, ids, w, spec, "cpu")
    else:
        emb = emit_embedding(gb, ids, w, spec, "cpu")
        logits = emit_lm_head(gb, x, w, spec, "cpu")
    gb.op("Identity", [emb], outputs=["emb"])
    gb.op("Identity", [logits], outputs=["logits"])
    gb.output("emb", TensorProto.FLOAT, ["b", "t", H])
    gb.output("logits", TensorProto.FLOAT, ["b", "t", V])
    path = gb.save()
    model = onnx.load(str(path), load_external_data=False)
    big = [t for t in model.graph.initializer if t.dims and t.dims[0] == V]
    assert len(big) == 2  # one uint8 table + one scale table, read by both Gather and MatMulNBits
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    idv = rng.integers(0, V, size=(1, 5))
    xv = rng.standard_normal((1, 2, H)).astype(np.float32)
    e, lg = sess.run(["emb", "logits"], {"ids": idv, "x": xv})
    if source == "Q8_0":
        full = w.dequantize()
        np.testing.assert_array_equal(e, full[idv])
    else:
        s = np.abs(w).max(-1, keepdims=True) / 127
        full = np.clip(np.rint(w / s), -127, 127) * s
        e_ref = full[idv]
        np.testing.assert_allclose(e, e_ref, rtol=1e-6, atol=1e-7)
    ref = xv @ full.T
    assert np.abs(lg - ref).max() / np.abs(ref).max() < 2e-2


def test_rank1_ids_and_per_row_scales(tmp_path, rng):
    h = 40  # no power-of-two block >= 16 divides it: one scale per row
    w = rng.standard_normal((V, h)).astype(np.float32)
    ids = np.array([0, 7, 299, 7])
    path = build_one(tmp_path, lambda gb, x: emit_embedding(gb, x, w, QuantSpec("w8a16"), "cpu"), None, ["n", h],
                     in_type=TensorProto.INT64, in_shape=["n"])
    y = run_graph(path, {"x": ids})
    amax = np.abs(w[ids]).max(-1, keepdims=True)
    assert y.shape == (4, h) and np.all(np.abs(y - w[ids]) <= amax / 254 * (1 + 1e-5))


@pytest.mark.parametrize("source", ["float", "Q8_0", "Q4_1", "float40"])
@pytest.mark.parametrize("scheme", ["fp32", "fp16", "w8a16", "w4a16"])
@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_embedding_reference_is_exact(tmp_path, rng, source, scheme, flavor):
    if source == "float40":
        w, h = rng.standard_normal((V, 40)).astype(np.float32), 40
    elif source == "float":
        w, h = rng.standard_normal((V, H)).astype(np.float32), H
    else:
        w, h = make_blocks(rng, source, n=V, k=H, shift=0.02), H
    ids = rng.integers(0, V, size=(2, 3))
    path = build_one(tmp_path, lambda gb, x: emit_embedding(gb, x, w, QuantSpec(scheme, 64), flavor), None,
                     ["b", "t", h], in_type=TensorProto.INT64, in_shape=["b", "t"])
    np.testing.assert_array_equal(run_graph(path, {"x": ids}), embedding_reference(w, QuantSpec(scheme, 64), flavor)[ids])
