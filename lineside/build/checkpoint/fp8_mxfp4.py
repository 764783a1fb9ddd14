"""Dequantize DeepSeek's shipped low-precision weights on read: FP8 e4m3 with 128×128 block scales
(ue8m0 power-of-two or float) and MXFP4 (two e2m1 values per byte, one ue8m0 scale per 32 inputs).

Everything returns float32 in the weight's logical ``[..., out, in]`` layout, so the quantizers
downstream never see the source format.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from lineside.errors import CheckpointError

# e2m1 code → value; code = sign(bit 3) | exponent/mantissa (bits 0-2). Low nibble holds the first value.
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
MXFP4_BLOCK = 32
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


def scale_to_f32(scale: np.ndarray, name: str) -> np.ndarray:
    """Block scales as float32: ue8m0 (float8_e8m0fnu or raw uint8 exponents, 2**(e-127)) or float."""
    dt = scale.dtype
    if dt == np.dtype(ml_dtypes.float8_e8m0fnu):
        return np.asarray(scale, dtype=np.float32)
    if dt == np.uint8:
        e = scale.astype(np.float32)
        out = np.exp2(e - 127.0).astype(np.float32)
        return np.where(scale == 255, np.float32(np.nan), out)
    if dt in FLOAT_DTYPES:
        return np.asarray(scale, dtype=np.float32)
    raise CheckpointError(f"tensor {name!r}: block scale dtype {dt} is not supported (expected ue8m0 or float)")


def dequant_fp8_blocks(w: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
    """FP8 (or INT8) weight [..., out, in] × per-block scale [..., ceil(out/bo), ceil(in/bi)] (128×128 for DeepSeek;
    [out, 1] is per channel, a single value per tensor)."""
    if w.ndim < 2:
        raise CheckpointError(f"tensor {name!r}: FP8 weight must be at least 2-D, got shape {list(w.shape)}")
    s = scale_to_f32(scale, name)
    out, inn = w.shape[-2:]
    if s.ndim == 0 or s.size == 1:
        return np.asarray(w, dtype=np.float32) * s.reshape(())
    if s.ndim < 2 or s.shape[:-2] != w.shape[:-2]:
        raise CheckpointError(f"tensor {name!r}: scale shape {list(s.shape)} does not tile weight {list(w.shape)}")
    so, si = s.shape[-2:]
    bo, bi = -(-out // so), -(-inn // si)
    if -(-out // bo) != so or -(-inn // bi) != si:
        raise CheckpointError(f"tensor {name!r}: scale shape {list(s.shape)} does not tile weight {list(w.shape)}")
    full = np.repeat(np.repeat(s, bo, axis=-2), bi, axis=-1)[..., :out, :inn]
    return np.asarray(w, dtype=np.float32) * full


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """uint8/int8 [..., n] of two e2m1 codes per byte (low nibble first) → float32 [..., 2n]."""
    u8 = np.ascontiguousarray(packed).view(np.uint8)
    vals = np.stack([FP4_E2M1[u8 & 0xF], FP4_E2M1[u8 >> 4]], axis=-1)
    return vals.reshape(*u8.shape[:-1], 2 * u8.shape[-1])


def dequant_mxfp4(packed: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
    """MXFP4 weight: packed [..., out, in/2] bytes and scale [..., out, in/32] → float32 [..., out, in]."""
    vals = unpack_fp4(packed)
    s = scale_to_f32(scale, name)
    inn = vals.shape[-1]
    if s.shape[:-1] != vals.shape[:-1] or s.shape[-1] * MXFP4_BLOCK != inn:
        raise CheckpointError(
            f"tensor {name!r}: MXFP4 scale shape {list(s.shape)} does not match packed weight {list(packed.shape)} "
            f"(expected [..., out, in/{MXFP4_BLOCK}])"
        )
    return (vals.reshape(*s.shape, MXFP4_BLOCK) * s[..., None]).reshape(vals.shape)


def dequantize(raw: np.ndarray, scale: np.ndarray | None, name: str) -> np.ndarray:
    """float32 from any shipped dtype: float (scale ignored if absent), FP8 + block scale, MXFP4 + scale."""
    dt = raw.dtype
    if dt in FLOAT_DTYPES:
        return np.asarray(raw, dtype=np.float32)
    if dt in FP8_DTYPES:
        if scale is None:
            raise CheckpointError(f"tensor {name!r} is FP8 but has no block-scale companion (.scale / .weight_scale_inv)")
        return dequant_fp8_blocks(raw, scale, name)
    if dt in (np.dtype(np.int8), np.dtype(np.uint8)) and scale is not None:
        return dequant_mxfp4(raw, scale, name)
    raise CheckpointError(
        f"tensor {name!r} has source dtype {dt}, which lineside cannot read "
        "(supported: fp32/fp16/bf16, FP8 e4m3 with block scales, MXFP4 with ue8m0 scales)"
    )


# ---- writers (used by tests and tools to make FP8 / MXFP4 copies of a float checkpoint) -----------------

def quantize_fp8_blocks(w: np.ndarray, block: int = 128, ue8m0: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """float [..., out, in] → (float8_e4m3fn weight, scale [..., ceil(out/b), ceil(in/b)]) as DeepSeek ships."""
    w = np.asarray(w, dtype=np.float32)
    out, inn = w.shape[-2:]
    so, si = -(-out // block), -(-inn // block)
    pad = np.zeros((*w.shape[:-2], so * block, si * block), dtype=np.float32)
    pad[..., :out, :inn] = w
    tiles = pad.reshape(*w.shape[:-2], so, block, si, block)
    amax = np.abs(tiles).max(axis=(-3, -1))
    s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    if ue8m0:
        s = np.exp2(np.ceil(np.log2(s))).astype(np.float32)
    full = np.repeat(np.repeat(s, block, axis=-2), block, axis=-1)[..., :out, :inn]
    q = np.clip(w / full, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q, (s.astype(ml_dtypes.float8_e8m0fnu) if ue8m0 else s)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., out, in] → (int8 packed [..., out, in/2], float8_e8m0fnu scale [..., out, in/32])."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % MXFP4_BLOCK:
        raise CheckpointError(f"MXFP4 needs in_features divisible by {MXFP4_BLOCK}, got {w.shape[-1]}")
    blocks = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    s = np.exp2(np.ceil(np.log2(np.where(amax > 0, amax / 6.0, 1.0)))).astype(np.float32)
    x = blocks / s[..., None]
    mags = FP4_E2M1[:8]
    code = np.abs(np.abs(x)[..., None] - mags).argmin(axis=-1).astype(np.uint8)
    code |= np.where(x < 0, 8, 0).astype(np.uint8)
    code = code.reshape(w.shape)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, s.astype(ml_dtypes.float8_e8m0fnu)
