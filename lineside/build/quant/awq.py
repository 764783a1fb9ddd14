"""Activation-aware weight quantization (AWQ): per-input-channel scales searched on calibration data.

``W x = (W diag(s)) (x / s)``: scaling up the input channels that carry large activations before
rounding shrinks their relative rounding error. ``s = mean|x|^alpha`` (normalised), with alpha
picked from a grid to minimise ``||W x - Q(W diag(s)) (x / s)||`` on the calibration samples.
alpha = 0 is plain RTN, so the searched error is never above RTN's on those samples.
"""

from __future__ import annotations

import numpy as np

from lineside.build.quant.rtn import dequantize_rtn, quantize_rtn, row_chunks
from lineside.errors import LinesideError

N_GRID = 20


def _output_error(w: np.ndarray, x: np.ndarray, s: np.ndarray, bits: int, group_size: int | None) -> float:
    """Squared Frobenius norm of ``x W^T - (x/s) Q(W diag(s))^T``, computed in row chunks of W."""
    err = 0.0
    for r0, r1 in row_chunks(w.shape[0], w.shape[1]):
        wc = w[r0:r1]
        codes, scales = quantize_rtn(wc * s, bits, group_size)
        w_eff = dequantize_rtn(codes, scales, group_size) / s  # what the graph multiplies x by
        d = x @ (wc - w_eff).T
        err += float(np.einsum("ij,ij->", d, d, dtype=np.float64))
    return err


def _weight_mean(w: np.ndarray, group_size: int | None) -> np.ndarray:
    """Mean over output rows of |w| relative to its group's max: how much each input channel matters to W."""
    rows, cols = w.shape
    gs = cols if group_size is None or cols % group_size else group_size
    g = np.abs(w).reshape(rows, cols // gs, gs)
    rel = g / (g.max(-1, keepdims=True) + 1e-6)
    return rel.reshape(rows, cols).mean(0).astype(np.float32)


def awq_search(
    weight: np.ndarray, x_samples: np.ndarray, group_size: int | None, bits: int = 4, n_grid: int = N_GRID
) -> tuple[np.ndarray, float, float]:
    """Search AWQ input scales for ``weight [out, in]`` on ``x_samples [..., in]`` (group_size None: per channel).

    Returns ``(scale [in] float32, err_rtn, err_awq)``, errors relative to ``||x W^T||_F``.
    Quantize ``weight * scale`` and feed the layer ``x / scale`` (``emit_linear(awq_scale=scale)``).
    """
    w = np.asarray(weight, dtype=np.float32)
    x = np.asarray(x_samples, dtype=np.float32)
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise LinesideError(
            f"AWQ calibration activations of shape {x.shape} don't match weight {w.shape} "
            "(need [..., in_features]); collect activations at this layer's input"
        )
    x = x.reshape(-1, w.shape[1])
    if x.shape[0] == 0:
        raise LinesideError("AWQ got no calibration activations; give --calib a non-empty text file")
    ref = 0.0
    for r0, r1 in row_chunks(w.shape[0], w.shape[1]):
        y = x @ w[r0:r1].T
        ref += float(np.einsum("ij,ij->", y, y, dtype=np.float64))
    ref = max(ref, 1e-30)
    x_mean = np.abs(x).mean(axis=0)
    x_mean = np.maximum(x_mean, 1e-4 * max(float(x_mean.max()), 1e-30))
    ones = np.ones(w.shape[1], dtype=np.float32)
    err_rtn = _output_error(w, x, ones, bits, group_size)
    best_err, best_s = err_rtn, ones
    w_mean = _weight_mean(w, group_size)
    for alpha in np.linspace(0.0, 1.0, n_grid):
        # Two families, as AutoAWQ: activations alone, and activations over weights ("duo scaling").
        for s in (x_mean ** np.float32(alpha), x_mean ** np.float32(alpha) / (w_mean ** np.float32(1 - alpha) + 1e-4)):
            if alpha == 0 and s is not None and np.allclose(s, 1):
                continue
            s = np.maximum(s, 1e-4)
            s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
            err = _output_error(w, x, s, bits, group_size)
            if err < best_err:
                best_err, best_s = err, s
    return best_s, float(np.sqrt(err_rtn / ref)), float(np.sqrt(best_err / ref))
