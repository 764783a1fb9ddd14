"""GPTQ (Frantar et al. 2022): INT4 weights chosen column by column to cancel the output error.

For a linear ``y = x Wᵀ`` with input Hessian ``H = 2 XᵀX / n``, each column is rounded in turn and its
rounding error is spread over the not-yet-quantized columns through the upper Cholesky factor of
``H⁻¹`` (lazy updates in blocks). The result is the same format as RTN — symmetric INT4 codes in
[-8, 7], zero point 0, one scale per group of inputs — so every emitter and TensorRT take it unchanged.
Scales are chosen when a group starts, with RTN's MSE scale search on the error-updated weights.
"""

from __future__ import annotations

import numpy as np

from lineside.build.quant.rtn import dequantize_rtn, quantize_rtn
from lineside.errors import LinesideError

# Dampening, as a fraction of mean(diag H). The paper's 0.01 assumes ~10^5 calibration tokens; with the
# ~10^3 of a short text it overfits (SmolLM2-135M g128, pydoc perplexity: RTN 16.25, 0.01 → 16.30,
# 0.1 → 15.10 on the old ~1,100-token shipped text; 14.78 vs 14.70 on 4096 tokens), so 0.1.
PERCDAMP = 0.1
BLOCK = 128
ROW_CHUNK_ELEMENTS = 1 << 23  # rows are independent in GPTQ: bound the float32 working copy (~32 MB)


def hessian(x: np.ndarray) -> np.ndarray:
    """``2 XᵀX / n`` (float64) of activations ``x [..., in]``: GPTQ's proxy for the layer's output loss."""
    x = np.asarray(x)
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    if x.shape[0] == 0:
        raise LinesideError("GPTQ got no calibration activations; give --calib a non-empty text file")
    return 2.0 * (x.T @ x) / x.shape[0]


def _inverse_cholesky(h: np.ndarray, percdamp: float) -> np.ndarray:
    """Upper Cholesky factor of ``(H + λI)⁻¹``, λ = percdamp·mean(diag H), dead columns given H = 1."""
    h = np.array(h, dtype=np.float64)
    diag = np.diag(h).copy()
    dead = diag <= 0
    # A column the calibration never excites keeps its weight (it may be live on other text): with
    # H[d, d] = 1 and the rest of its row zero, it is plainly rounded and passes on no error.
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    damp = percdamp * float(np.mean(np.diag(h)))
    for _ in range(6):
        try:
            # Cholesky of the reversed matrix gives H = R Rᵀ with R upper, so H⁻¹ = UᵀU for U = R⁻¹ (upper).
            r = np.linalg.cholesky((h + damp * np.eye(h.shape[0]))[::-1, ::-1])[::-1, ::-1]
            return np.triu(np.linalg.inv(r))
        except np.linalg.LinAlgError:
            damp = max(damp * 10, 1e-8)  # badly conditioned (few samples): dampen harder
    raise LinesideError("GPTQ: the calibration Hessian is not positive definite even dampened; use --method rtn")


def gptq_quantize(weight: np.ndarray, h: np.ndarray, group_size: int, bits: int = 4,
                  scale_dtype: type = np.float32, percdamp: float = PERCDAMP, block_size: int = BLOCK,
                  act_order: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ of ``weight [out, in]`` given its input Hessian ``h [in, in]``: ``(codes int8, scales)`` as quantize_rtn.

    Codes are in [-8, 7] ``[out, in]``, scales ``[out, ceil(in / group_size)]`` in ``scale_dtype`` (a
    ragged last group is shorter). ``act_order`` visits columns by decreasing ``H[j, j]``; its groups
    stay the static column ranges, their scales then taken from the unmodified weight up front.
    """
    if bits != 4:
        raise ValueError(f"GPTQ here writes INT4 grids only, not {bits}-bit")
    w = np.asarray(weight)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    rows, cols = w.shape
    if np.shape(h) != (cols, cols):
        raise LinesideError(f"GPTQ Hessian of shape {np.shape(h)} doesn't match weight {w.shape}; "
                           "collect it at this layer's input")
    if not np.isfinite(h).all():
        raise LinesideError("GPTQ calibration activations hold NaN or infinite values; check the checkpoint")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, not {group_size}")
    n_groups = -(-cols // group_size)
    # Blocks hold whole groups, so a group's scale is searched on weights carrying every earlier update.
    block = -(-max(block_size, group_size) // group_size) * group_size
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(cols)
    hinv = _inverse_cholesky(np.asarray(h)[np.ix_(perm, perm)], percdamp).astype(np.float32)
    codes = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty((rows, n_groups), dtype=np.dtype(scale_dtype))
    step = max(1, ROW_CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        c, s = _gptq_rows(np.asarray(w[r0:r1], dtype=np.float32), hinv, perm, group_size, block, scale_dtype,
                          act_order)
        codes[r0:r1], scales[r0:r1] = c, s
    return codes, scales


def _gptq_rows(w: np.ndarray, hinv: np.ndarray, perm: np.ndarray, gs: int, block: int, scale_dtype: type,
               act_order: bool) -> tuple[np.ndarray, np.ndarray]:
    """The GPTQ sweep over a chunk of rows (``hinv`` and the columns in ``perm`` order)."""
    rows, cols = w.shape
    group_of = perm // gs  # static groups: a column's group is its original position // gs
    scales = np.empty((rows, -(-cols // gs)), dtype=np.dtype(scale_dtype))
    if act_order:  # visiting order mixes groups: every scale comes from the unmodified weight
        _, scales[:] = quantize_rtn(w, 4, gs, scale_dtype)
    w = np.ascontiguousarray(w[:, perm])
    q = np.empty((rows, cols), dtype=np.int8)
    for i1 in range(0, cols, block):
        i2 = min(cols, i1 + block)
        w1 = w[:, i1:i2].copy()
        err = np.empty_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            if not act_order and j % gs == 0:
                _, s = quantize_rtn(w1[:, i:i + gs], 4, None, scale_dtype)  # one group: per-row MSE scale
                scales[:, j // gs] = s[:, 0]
            s32 = scales[:, group_of[j]].astype(np.float32)
            col = w1[:, i]
            qc = np.clip(np.rint(col / s32), -8, 7)
            q[:, j] = qc
            e = (col - qc * s32) / h1[i, i]
            w1[:, i + 1:] -= np.outer(e, h1[i, i + 1:])
            err[:, i] = e
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    codes = np.empty_like(q)
    codes[:, perm] = q
    return codes, scales


def gptq_fake_quantize(weight: np.ndarray, h: np.ndarray, group_size: int, scale_dtype: type = np.float32,
                       act_order: bool = False) -> np.ndarray:
    """The float32 weight a GPTQ-quantized graph multiplies by (``dequantize(gptq_quantize(...))``)."""
    codes, scales = gptq_quantize(weight, h, group_size, scale_dtype=scale_dtype, act_order=act_order)
    return dequantize_rtn(codes, scales, group_size)
