"""Round-to-nearest symmetric integer quantization per group (vectorized, chunked by rows).

Symmetric with zero point 0: ``w ≈ scale * q``, ``q`` in [-(2^(b-1)-1), 2^(b-1)-1]
(±7 for int4, ±127 for int8), ``scale = max|w| / qmax`` per group of ``group_size``
consecutive input features, so ``|w - scale*q| <= scale/2`` for every element.
"""

from __future__ import annotations

import numpy as np

from trtedge.errors import TrtedgeError

CHUNK_ELEMENTS = 1 << 22  # ~16 MB of float32 per chunk keeps temporaries bounded for any matrix


def qmax(bits: int) -> int:
    """Largest code of a symmetric signed ``bits``-bit grid (7 for int4, 127 for int8)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    return (1 << (bits - 1)) - 1


def row_chunks(rows: int, cols: int, max_elements: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """Row ranges so each chunk holds at most ``max_elements`` values (at least one row)."""
    step = max(1, max_elements // max(1, cols))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _quantize_chunk(w: np.ndarray, bits: int, group_size: int, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = w.shape
    g = w.reshape(rows, cols // group_size, group_size)
    amax = np.abs(g).max(axis=-1)
    if not np.isfinite(amax).all():
        raise TrtedgeError("a weight holds NaN or infinite values; the checkpoint is corrupt")
    m = qmax(bits)
    scale = (amax / np.float32(m)).astype(scale_dtype)
    # A group that is all zero (or whose scale underflows the scale dtype) gets scale 1 and codes 0.
    scale = np.where(scale > 0, scale, np.asarray(1, dtype=scale_dtype))
    if not np.isfinite(scale).all():
        raise TrtedgeError(
            f"a weight is too large for {np.dtype(scale_dtype).name} scales; quantize with float32 scales (trt_dtype fp32)"
        )
    q = np.rint(g / scale.astype(np.float32)[..., None])
    np.clip(q, -m, m, out=q)
    return q.astype(np.int8).reshape(rows, cols), scale


def quantize_rtn(
    w: np.ndarray, bits: int, group_size: int | None, scale_dtype: type = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float ``w [out, in]`` to int8-held codes ``[out, in]`` and scales ``[out, in/group]``.

    ``group_size=None`` means one scale per row (per output channel). Scales are rounded to
    ``scale_dtype`` before the codes are computed, so the stored pair reconstructs ``w``.
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    rows, cols = w.shape
    gs = cols if group_size is None else group_size
    if cols % gs:
        raise ValueError(f"group size {gs} does not divide {cols}")
    sdt = np.dtype(scale_dtype)
    codes = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty((rows, cols // gs), dtype=sdt)
    for r0, r1 in row_chunks(rows, cols):
        codes[r0:r1], scales[r0:r1] = _quantize_chunk(np.asarray(w[r0:r1], dtype=np.float32), bits, gs, sdt)
    return codes, scales


def dequantize_rtn(codes: np.ndarray, scales: np.ndarray, group_size: int | None = None) -> np.ndarray:
    """float32 ``[out, in]`` from codes and per-group scales (the inverse of ``quantize_rtn``)."""
    rows, cols = codes.shape
    gs = cols if group_size is None else group_size
    g = codes.reshape(rows, cols // gs, gs).astype(np.float32) * scales.astype(np.float32)[..., None]
    return g.reshape(rows, cols)


def fake_quantize(w: np.ndarray, bits: int, group_size: int | None, scale_dtype: type = np.float32) -> np.ndarray:
    """``dequantize(quantize(w))``: the weight the quantized graph actually multiplies by."""
    codes, scales = quantize_rtn(w, bits, group_size, scale_dtype)
    return dequantize_rtn(codes, scales, group_size)
