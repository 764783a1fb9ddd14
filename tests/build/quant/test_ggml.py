"""GGUF Q4_0/Q4_1/Q8_0 weights carried onto MatMulNBits (cpu) exactly; requantized for trt."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from onnx import numpy_helper

from lineside.build.graph.linear import emit_linear
from lineside.build.quant import q4_1
from lineside.build.quant.ggml import decode_blocks
from lineside.build.quant.spec import QuantSpec
from lineside.build.tensors import GGMLBlocks
from lineside.errors import CheckpointError, LinesideError
from tests.build.quant.conftest import build_one, run_graph

N, K = 64, 576  # 18 blocks of 32; 576 is SmolLM2's hidden size


def make_blocks(rng, ggml_type: str, n: int = N, k: int = K, shift: float = 0.0) -> GGMLBlocks:
    w = (rng.standard_normal((n, k)) * 0.05 + shift).astype(np.float32)
    data = quantize(w, GGMLQuantizationType[ggml_type])
    return GGMLBlocks(ggml_type, (n, k), np.ascontiguousarray(data))


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_decode_matches_gguf(rng, ggml_type):
    blocks = make_blocks(rng, ggml_type)
    np.testing.assert_array_equal(decode_blocks(blocks).dequantize(), blocks.dequantize())


def test_decode_rejects_truncated(rng):
    b = make_blocks(rng, "Q4_1")
    with pytest.raises(CheckpointError):
        decode_blocks(GGMLBlocks("Q4_1", b.shape, b.data[:, :-4]), "blk.0.ffn_up.weight")


@pytest.mark.parametrize("ggml_type,offset,value", [("Q4_0", 0, np.nan), ("Q4_1", 2, np.inf), ("Q8_0", 0, -np.inf)])
def test_non_finite_scales_are_found(rng, ggml_type, offset, value):
    """A float16 d or m of inf/NaN (a corrupt GGUF; llama.cpp's --check-tensors refuses it) was carried: numpy
    RuntimeWarnings at build (NaN cast to uint8 zero points, undefined in C) and NaN outputs at run time; the GGUF
    reader refuses it (tests/build/models/test_gguf_shapes.py) by the block this finds."""
    b = make_blocks(rng, ggml_type)
    data = b.data.copy()
    nbytes = data.shape[1] // (K // 32)
    data[5, 3 * nbytes + offset : 3 * nbytes + offset + 2] = np.array([value], np.float16).view(np.uint8)
    got = GGMLBlocks(ggml_type, b.shape, data).non_finite_scale()
    assert got is not None and got[:3] == (5, 3, "m" if offset else "d") and str(got[3]) == str(float(value))
    assert GGMLBlocks(ggml_type, b.shape, b.data).non_finite_scale() is None


@pytest.mark.parametrize("ggml_type,bits", [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8)])
@pytest.mark.parametrize("scheme", ["w4a16", "w8a16"])
def test_cpu_carry_exact(tmp_path, rng, ggml_type, bits, scheme):
    # a shifted weight makes Q4_1's offsets matter (m far from -8d)
    blocks = make_blocks(rng, ggml_type, shift=0.03)
    bias = rng.standard_normal(N).astype(np.float32)
    spec = QuantSpec(scheme, 128, accuracy_level=0)  # group 128 doesn't divide 576: the carry ignores it
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", blocks, spec, "cpu", bias=bias), K, ["b", "t", N])
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    mnb = [n for n in nodes if n.op_type == "MatMulNBits"]
    if bits == 8:  # accuracy level 0: 8-bit grids become float32 weights (onnxruntime's 8-bit kernel is slow)
        assert not mnb and any(n.op_type == "MatMul" for n in nodes)
    else:
        assert len(mnb) == 1 and len(mnb[0].input) == 6  # bias folded in, no zero points
        attrs = {a.name: a.i for a in mnb[0].attribute}
        assert attrs["bits"] == bits and attrs["block_size"] == 32
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    ref = x @ blocks.dequantize().T + bias
    y = run_graph(path, {"x": x})
    # accuracy level 0: the carried grid reproduces llama.cpp's dequantized weight (float32 rounding only)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_cpu_carry_accuracy_level_4(tmp_path, rng, ggml_type):
    blocks = make_blocks(rng, ggml_type, shift=0.03)
    spec = QuantSpec("w4a16", accuracy_level=4)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", blocks, spec, "cpu"), K, ["t", N], in_shape=["t", K])
    node = next(n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: a.i for a in node.attribute}
    assert attrs["bits"] == (8 if ggml_type == "Q8_0" else 4) and attrs["block_size"] == 32
    # zero points for Q4_1 only (quant/q4_1.py), none for the symmetric grids
    assert attrs["accuracy_level"] == 4 and len(node.input) == (4 if ggml_type == "Q4_1" else 3)
    x = rng.standard_normal((5, K)).astype(np.float32)
    ref = x @ blocks.dequantize().T
    assert np.abs(run_graph(path, {"x": x}) - ref).max() / np.abs(ref).max() < 2e-2


def carried_offsets(path, name: str, k: int = K) -> np.ndarray:
    """The per-block offsets m a built graph applies to Q4_1 layer ``name`` (float64), read back from its
    initializers. Below accuracy level 4: its float32 block offsets ``8d + m`` less ``8d`` (MatMulNBits' default
    zero point 8, d its float32 scales). At level 4 (one MatMulNBits over ``[x, S, .., S]``, quant/q4_1.py):
    ``-z*d`` of the first K/32 blocks plus, per block b, its digit in each block-sum region times that region's
    scale (codes less their zero point)."""
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    scales = inits[f"{name}.scales"].astype(np.float64)
    if f"{name}.block_offset" in inits:
        assert inits[f"{name}.block_offset"].dtype == np.float32
        return inits[f"{name}.block_offset"].astype(np.float64).T - 8 * scales
    packed = inits[f"{name}.qweight"]  # [N, blocks, 16]: value 2i low nibble of byte i
    n, blocks = packed.shape[:2]
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks * 32).astype(np.float64)
    zp = inits[f"{name}.zero_points"].reshape(n, -1)
    zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float64)
    scales = scales.reshape(n, blocks)
    w = (codes - np.repeat(zp, 32, axis=1)) * np.repeat(scales, 32, axis=1)
    nb, width = k // 32, -(-(k // 32) // 32) * 32
    regions = (blocks * 32 - k) // width
    assert k + regions * width == blocks * 32
    return -zp[:, :nb] * scales[:, :nb] + sum(w[:, k + i * width : k + i * width + nb] for i in range(regions))


@pytest.mark.parametrize("shift", [0.0, 0.03, -0.2, 0.2])
@pytest.mark.parametrize("level", [0, 4])
def test_q4_1_offsets_are_the_ggufs(tmp_path, rng, shift, level):
    # below level 4 the offsets the graph applies are the GGUF's float16 m exactly (0 half-ulps); at level 4 within
    # d/32 of it (quant/q4_1.py's bound), where every weight has one sign too (shift 0.2: z clipped, r = m)
    blocks = make_blocks(rng, "Q4_1", shift=shift)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", blocks, QuantSpec(accuracy_level=level), "cpu"),
                     K, ["t", N], in_shape=["t", K])
    m, want = carried_offsets(path, "l"), decode_blocks(blocks).m
    if level < 4:
        np.testing.assert_array_equal(m, want)
    else:
        assert np.all(np.abs(m - want) <= q4_1.MAX_OFFSET_ERROR * decode_blocks(blocks).d)  # quant/q4_1.py's bound


def test_q4_1_blocksum_shared(tmp_path, rng):
    ws = [make_blocks(rng, "Q4_1", shift=0.02) for _ in range(3)]
    spec = QuantSpec(accuracy_level=0)

    def emit(gb, x):
        ys = [emit_linear(gb, x, f"l{i}", w, spec, "cpu") for i, w in enumerate(ws)]
        return gb.op("Sum", ys)

    path = build_one(tmp_path, emit, K, ["b", "t", N])
    assert sum(n.name.startswith("blocksum") for n in onnx.load(str(path), load_external_data=False).graph.node) == 1
    x = rng.standard_normal((1, 4, K)).astype(np.float32)
    ref = x @ sum(w.dequantize() for w in ws).T
    assert np.abs(run_graph(path, {"x": x}) - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("flavor,spec", [("trt", QuantSpec("w4a16", 64)), ("cpu", QuantSpec("fp16"))])
def test_requantized_when_not_carried(tmp_path, rng, flavor, spec):
    blocks = make_blocks(rng, "Q4_1")
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", blocks, spec, flavor), K, ["b", "t", N])
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert "MatMulNBits" not in ops
    x = rng.standard_normal((1, 2, K)).astype(np.float32)
    ref = x @ blocks.dequantize().T
    # the trt grid is a second quantization of the GGUF grid: close, not exact
    tol = 0.15 if flavor == "trt" else 1e-3
    assert np.abs(run_graph(path, {"x": x}) - ref).max() / np.abs(ref).max() < tol


def test_fused_qkv_concat_keeps_the_carry(tmp_path, rng):
    from lineside.build.graph.linear import concat_out_features

    ws = [make_blocks(rng, "Q4_1", n=n, shift=0.02) for n in (64, 32, 32)]
    fused = concat_out_features(ws, "qkv")
    assert isinstance(fused, GGMLBlocks) and fused.shape == (128, K)
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([w.dequantize() for w in ws]))
    spec = QuantSpec(accuracy_level=0)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "qkv", fused, spec, "cpu"), K, ["b", "t", 128])
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    ref = x @ fused.dequantize().T
    assert np.abs(run_graph(path, {"x": x}) - ref).max() / np.abs(ref).max() < 1e-5
    mixed = concat_out_features([ws[0], np.ones((8, K), np.float32)], "mixed")
    assert isinstance(mixed, np.ndarray) and mixed.shape == (72, K)
    with pytest.raises(LinesideError):
        concat_out_features([ws[0], np.ones((8, K + 32), np.float32)], "bad")
