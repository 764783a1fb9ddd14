"""RTN quantizer: per-element error bound, Frobenius error, chunking, packing round trips, sizes."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.build.quant import rtn
from lineside.build.quant.pack import pack_int4_kn, pack_matmulnbits, unpack_int4
from lineside.build.quant.rtn import dequantize_rtn, quantize_rtn
from lineside.build.quant.size import kept_high_precision_note, quantized_bytes
from lineside.build.quant.spec import QuantSpec
from lineside.errors import LinesideError


@pytest.mark.parametrize("bits,group,bound", [(4, 128, 0.15), (4, 64, 0.14), (4, 32, 0.13), (8, None, 0.012)])
def test_error_bounds(rng, bits, group, bound):
    w = rng.standard_normal((96, 768)).astype(np.float32) * 0.05
    w[3, 7] = 2.0  # an outlier only hurts its own group
    codes, scales = quantize_rtn(w, bits, group)
    lo, hi = (-8, 7) if bits == 4 else (-127, 127)
    assert codes.dtype == np.int8 and codes.min() >= lo and codes.max() <= hi
    gs = group or w.shape[1]
    assert scales.shape == (96, 768 // gs)
    deq = dequantize_rtn(codes, scales, group)
    err = np.abs(deq - w).reshape(96, -1, gs)
    ratio = w.reshape(96, -1, gs) / scales[..., None]
    inside = (ratio >= lo - 0.5) & (ratio <= hi + 0.5)  # not clipped: nearest code, within half a step
    assert np.all(err[inside] <= (np.broadcast_to(scales[..., None], err.shape)[inside] / 2) * (1 + 1e-6))
    amax = np.abs(w.reshape(96, -1, gs)).max(-1)
    if bits == 8:
        np.testing.assert_allclose(scales, amax / 127, rtol=1e-6)
    else:
        # The searched scale never does worse per group than the plain amax/7 grid.
        s7 = (amax / 7)[..., None]
        g = w.reshape(96, -1, gs)
        plain = ((np.clip(np.rint(g / s7), -7, 7) * s7 - g) ** 2).sum(-1)
        assert np.all((err**2).sum(-1) <= plain * (1 + 1e-5) + 1e-12)
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert rel < bound


def test_fp16_scales_and_zero_groups(rng):
    w = rng.standard_normal((8, 128)).astype(np.float32)
    w[2] = 0
    codes, scales = quantize_rtn(w, 4, 64, np.float16)
    assert scales.dtype == np.float16
    assert np.all(codes[2] == 0) and np.all(scales[2] == 1)
    err = np.abs(dequantize_rtn(codes, scales, 64) - w).reshape(8, 2, 64)
    s32 = np.broadcast_to(scales.astype(np.float32)[..., None], err.shape)
    ratio = w.reshape(8, 2, 64) / s32
    inside = (ratio >= -8.5) & (ratio <= 7.5)
    assert np.all(err[inside] <= s32[inside] / 2 * (1 + 1e-3))


def test_non_finite_is_one_line_error():
    w = np.ones((2, 64), np.float32)
    w[1, 3] = np.nan
    with pytest.raises(LinesideError) as e:
        quantize_rtn(w, 4, 64)
    assert "\n" not in str(e.value)


def test_chunking_matches_whole(rng, monkeypatch):
    w = rng.standard_normal((37, 256)).astype(np.float32)
    whole = quantize_rtn(w, 4, 64)
    monkeypatch.setattr(rtn, "CHUNK_ELEMENTS", 700)  # 2 rows per chunk
    assert len(rtn.row_chunks(37, 256, rtn.CHUNK_ELEMENTS)) == 19
    chunked = quantize_rtn(w, 4, 64)
    np.testing.assert_array_equal(whole[0], chunked[0])
    np.testing.assert_array_equal(whole[1], chunked[1])


def test_packing(rng):
    codes = rng.integers(-8, 8, size=(6, 64)).astype(np.int8)
    raw = pack_int4_kn(codes)
    assert len(raw) == 6 * 64 // 2
    np.testing.assert_array_equal(unpack_int4(raw, codes.size).reshape(64, 6), codes.T)
    u = (codes + 8).astype(np.uint8)
    b = pack_matmulnbits(u, 4, 32)
    assert b.shape == (6, 2, 16)
    assert b[0, 0, 0] == (u[0, 0] | (u[0, 1] << 4))
    assert pack_matmulnbits(u, 8, 32).shape == (6, 2, 32)


def test_quantized_bytes_and_note():
    assert quantized_bytes((1536, 576), QuantSpec("fp32")) == 1536 * 576 * 4
    assert quantized_bytes((1536, 576), QuantSpec("fp16")) == 1536 * 576 * 2
    assert quantized_bytes((1536, 576), QuantSpec("w4a16", 64)) == 1536 * 576 // 2 + 1536 * 9 * 2
    assert quantized_bytes((1536, 576), QuantSpec("w4a16", 64), flavor="cpu") == 1536 * 576 // 2 + 1536 * 9 * 4
    assert quantized_bytes((4, 1536, 576), QuantSpec("w8a16")) == 4 * (1536 * 576 + 1536 * 2)
    note = kept_high_precision_note()
    assert any("LM head" in n["tensors"] for n in note) and all(n["why"] for n in note)


@pytest.mark.parametrize(
    "spec,k,flavor,needle",
    [
        (QuantSpec("w4a16", 128), 577, "cpu", "group size 128 does not divide in_features 577"),
        (QuantSpec("w4a16", 128), 96, "trt", "does not divide in_features 96"),
        (QuantSpec("w4a16", 128), 96, "trt", "or build --flavors cpu"),  # the cpu flavor takes a ragged block
        (QuantSpec("w4a16", 32), 576, "trt", "not supported by TensorRT"),
        (QuantSpec("w4a16", 48), 576, None, "power of two"),
        (QuantSpec("int3"), 576, None, "unknown quantization scheme"),
        (QuantSpec(method="smoothquant"), 576, None, "unknown quantization method"),
        (QuantSpec(accuracy_level=7), 576, None, "accuracy level"),
    ],
)
def test_validate_errors(spec, k, flavor, needle):
    with pytest.raises(LinesideError) as e:
        spec.validate(k, "model.layers.0.mlp.up_proj", flavor)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_validate_accepts():
    """Valid layers pass (validate returns None) and the trt block each layer gets is the one expected."""
    assert QuantSpec("w4a16", 64).validate(576, "x", "trt") is None
    assert QuantSpec("w4a16", 128).validate(1536, "x", "trt") is None
    assert QuantSpec("w4a16", 128).validate(576, "x", "trt") is None  # falls back to blocks of 64
    assert QuantSpec("w4a16", 32).validate(576, "x", "cpu") is None
    assert QuantSpec("w4a16", 128).validate(576, "x", "cpu") is None  # ragged last group on cpu
    assert QuantSpec("w8a16", 128).validate(576, "x", "trt") is None  # per-channel: group size unused
    assert QuantSpec("w4a16", 128).trt_group(1536) == 128
    assert QuantSpec("w4a16", 128).trt_group(576) == 64
