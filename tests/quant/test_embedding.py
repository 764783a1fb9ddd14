"""emit_embedding: float tables, int8 codes + block scales, GGUF Q8_0/Q4_0/Q4_1 tables carried exactly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from tests.quant.conftest import build_one, run_graph
from tests.quant.test_ggml import make_blocks
from trtedge.build.graph.embedding import emit_embedding
from trtedge.build.quant.spec import QuantSpec

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
    if scheme.startswith("w"):
        model = onnx.load(str(path), load_external_data=False)
        table = next(t for t in model.graph.initializer if t.name.endswith(".qweight"))
        assert table.data_type == TensorProto.INT8 and list(table.dims) == [V, H]
        # w4a16 and w8a16 both keep 8-bit codes per 64 block: error bound scale/2 = amax/254
        amax = np.abs(w[ids].reshape(2, 5, H // 64, 64)).max(-1, keepdims=True)
        assert np.all(np.abs(y - ref).reshape(2, 5, H // 64, 64) <= amax / 254 * (1 + 1e-5))


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_ggml_carried_exactly(tmp_path, rng, ggml_type, flavor):
    blocks = make_blocks(rng, ggml_type, n=V, k=H, shift=0.02)
    ids = rng.integers(0, V, size=(3, 4))
    _, y = run_embedding(tmp_path, blocks, QuantSpec("w4a16"), flavor, ids)
    np.testing.assert_array_equal(y, blocks.dequantize()[ids])


def test_rank1_ids_and_per_row_scales(tmp_path, rng):
    h = 40  # no power-of-two block >= 16 divides it: one scale per row
    w = rng.standard_normal((V, h)).astype(np.float32)
    ids = np.array([0, 7, 299, 7])
    path = build_one(tmp_path, lambda gb, x: emit_embedding(gb, x, w, QuantSpec("w8a16"), "cpu"), None, ["n", h],
                     in_type=TensorProto.INT64, in_shape=["n"])
    y = run_graph(path, {"x": ids})
    amax = np.abs(w[ids]).max(-1, keepdims=True)
    assert y.shape == (4, h) and np.all(np.abs(y - w[ids]) <= amax / 254 * (1 + 1e-5))
