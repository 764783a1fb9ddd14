"""Round-to-nearest symmetric integer quantization per group (vectorized, chunked by rows).

Symmetric with zero point 0: ``w ≈ scale * q``. int8 uses ``q`` in [-127, 127] with
``scale = max|w| / 127``. int4 uses the whole signed grid [-8, 7] and picks, per group, the scale
with the least squared error among ``max|w| / d`` for d in [6.5, 8.5] (each refined by least
squares): plain ``max|w| / 7`` wastes a level and rounds every weight on a coarse grid, which
costs a small model most of its quality. Still round-to-nearest given the scale, zero point 0.
"""

from __future__ import annotations

import numpy as np

from lineside.errors import LinesideError

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
        raise LinesideError("a weight holds NaN or infinite values; the checkpoint is corrupt")
    m = qmax(bits)
    if bits == 4:
        scale = _mse_scale4(g, amax).astype(scale_dtype)
    else:
        scale = (amax / np.float32(m)).astype(scale_dtype)
    # A group that is all zero (or whose scale underflows the scale dtype) gets scale 1 and codes 0.
    scale = np.where(scale > 0, scale, np.asarray(1, dtype=scale_dtype))
    if not np.isfinite(scale).all():
        raise LinesideError(
            f"a weight is too large for {np.dtype(scale_dtype).name} scales; quantize with float32 scales (trt_dtype fp32)"
        )
    q = np.rint(g / scale.astype(np.float32)[..., None])
    np.clip(q, -m - 1 if bits == 4 else -m, m, out=q)
    return q.astype(np.int8).reshape(rows, cols), scale


INT4_DIVISORS = np.linspace(6.5, 8.5, 17, dtype=np.float32)


def _mse_scale4(g: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """Per-group int4 scale minimising ||w - s q||² over candidates amax/d (q on [-8, 7])."""
    safe = np.where(amax > 0, amax, np.float32(1))
    best_err = np.full(amax.shape, np.inf, dtype=np.float32)
    best = safe / np.float32(7)
    w2 = np.einsum("rgk,rgk->rg", g, g)
    for d in INT4_DIVISORS:
        s = safe / d
        q = np.clip(np.rint(g / s[..., None]), -8, 7)
        wq = np.einsum("rgk,rgk->rg", g, q)
        qq = np.maximum(np.einsum("rgk,rgk->rg", q, q), np.float32(1e-12))
        s_ls = np.where(wq > 0, wq / qq, s)  # least-squares scale for these codes
        err = w2 - np.where(wq > 0, wq * wq / qq, 0)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, s_ls, best)
    return np.where(amax > 0, best, 0).astype(np.float32)


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
        # A ragged last group (e.g. 576 inputs in groups of 128, as MatMulNBits allows): pad with zeros.
        codes, scales = quantize_rtn(_pad_cols(w, gs), bits, gs, scale_dtype)
        return np.ascontiguousarray(codes[:, :cols]), scales
    sdt = np.dtype(scale_dtype)
    codes = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty((rows, cols // gs), dtype=sdt)
    for r0, r1 in row_chunks(rows, cols):
        codes[r0:r1], scales[r0:r1] = _quantize_chunk(np.asarray(w[r0:r1], dtype=np.float32), bits, gs, sdt)
    return codes, scales


def _pad_cols(w: np.ndarray, gs: int) -> np.ndarray:
    rows, cols = w.shape
    out = np.zeros((rows, -(-cols // gs) * gs), dtype=w.dtype)
    out[:, :cols] = w
    return out


def dequantize_rtn(codes: np.ndarray, scales: np.ndarray, group_size: int | None = None) -> np.ndarray:
    """float32 ``[out, in]`` from codes and per-group scales (the inverse of ``quantize_rtn``)."""
    rows, cols = codes.shape
    gs = cols if group_size is None else group_size
    if cols % gs:
        return dequantize_rtn(_pad_cols(codes, gs), scales, gs)[:, :cols]
    g = codes.reshape(rows, cols // gs, gs).astype(np.float32) * scales.astype(np.float32)[..., None]
    return g.reshape(rows, cols)


def fake_quantize(w: np.ndarray, bits: int, group_size: int | None, scale_dtype: type = np.float32) -> np.ndarray:
    """``dequantize(quantize(w))``: the weight the quantized graph actually multiplies by."""
    codes, scales = quantize_rtn(w, bits, group_size, scale_dtype)
    return dequantize_rtn(codes, scales, group_size)
