"""GGUF Q4_1 on a single MatMulNBits: an integer zero point, and what it leaves as extra input blocks.

Q4_1 stores ``w = d*u + m`` per block of 32 (u in 0..15, d and m float16). MatMulNBits computes ``s*(u - z)``
with a 4-bit integer zero point z per block, which costs nothing per token in onnxruntime's int8 kernel (it
folds ``-s*z`` into the per-block sums it reads anyway). With ``z = round(-m/d)`` clipped to 0..15 the rest,
``r = m + z*d`` (``|r| <= d/2`` unless z clipped), multiplies the block's input sum: ``y_o += sum_b r[o,b]*S_b``,
a dot product of the block sums S with r. So it rides in the same MatMulNBits: the input grows by D regions
of block sums, ``x' = [x, S, .., S]`` (each S zero-padded to whole blocks of 32), and each weight row by D
regions of signed 4-bit digits: region i holds ``round(e_i/s)`` of what regions before it left of r (e_0 = r),
with its own scale ``s = max|e_i|/7`` per 32 blocks. D is the fewest (2..MAX_DIGITS) that carries every block's
m to within ``d/32`` (MAX_OFFSET_ERROR grid steps; the GGUF's own rounding of a weight is up to d/2): the demo model
(SmolLM2-135M Q4_1) gets 2 in every layer, its m within 2.8% of d (p99 0.4%, about the int8 rounding level 4 gives
the block sums themselves; 11.7% of blocks beyond half an ulp of m's float16 value, up to 14). 3 digits would hold
every m to half an ulp but cost 6% of decode and 8% of prompt speed at 2 threads for no measurable perplexity
(10.624 against 2 digits' 10.614, the exact carry's 10.630; benchmarks/README.md, "Bundles and carry variants"). benchmarks/q4_1_carry.py measures this against other carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lineside.build.quant.ggml import BLOCK, DecodedBlocks

MIN_DIGITS, MAX_DIGITS = 2, 4
MAX_OFFSET_ERROR = 1 / 32  # the most a carried m may be off, in grid steps d of its block
ZERO_CODE = 8  # MatMulNBits' default zero point: the digit regions' codes are digit + 8


@dataclass(frozen=True)
class Q4_1Carry:
    """One MatMulNBits' operands for a Q4_1 weight ``[N, K]``: ``codes [N, K']`` uint8 0..15, ``scales``
    float32 and ``zero_points`` uint8 ``[N, K'/32]``, with ``K' = K + digits * sum_width(K)``; ``m`` float64
    ``[N, K/32]`` is the offset it applies per block (``-z*d`` plus the digits)."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    digits: int
    m: np.ndarray

    @property
    def k(self) -> int:
        return self.codes.shape[1]


def sum_width(k: int) -> int:
    """Columns of one block-sum region for ``k`` inputs: K/32 sums padded to whole blocks of 32."""
    return -(-(k // BLOCK) // BLOCK) * BLOCK


def half_ulps(m: np.ndarray, carried: np.ndarray) -> np.ndarray:
    """|carried - m| in half-ulps of m's float16 value (<= 1: it rounds back to m, ties aside)."""
    ulp = np.spacing(np.abs(np.asarray(m, np.float32).astype(np.float16))).astype(np.float64)
    return np.abs(np.asarray(carried, np.float64) - m) / (ulp / 2)


def zero_points(d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(z uint8 ``[N, B]`` nearest to ``-m/d`` in 0..15, the residual ``m + z*d`` float64); a block with d = 0
    (equal weights) takes z = 0 (any z gives the same weights there)."""
    m64, d64 = np.asarray(m, np.float64), np.asarray(d, np.float64)
    ratio = np.where(d64 != 0, -m64 / np.where(d64 != 0, d64, 1.0), 0.0)
    z = np.clip(np.rint(ratio), 0, 15).astype(np.uint8)
    return z, m64 + z * d64


def residual_digits(r: np.ndarray, digits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """r ``[N, B]`` -> (codes uint8 ``[N, D*P]``, scales float32 ``[N, D*P/32]``, what they carry float64
    ``[N, B]``), P = sum_width(32*B); each region's digits round what the regions before it left."""
    n, b = r.shape
    p = sum_width(b * BLOCK)
    left = np.zeros((n, p), np.float64)
    left[:, :b] = r
    codes, scales = [], []
    for _ in range(digits):
        g = left.reshape(n, p // BLOCK, BLOCK)
        s = (np.abs(g).max(-1, keepdims=True) / 7).astype(np.float32)
        # all zero: scale 0, not 1 (the int8 kernel's zero-point term cancels only to ~1e-7 of the scale)
        q = np.clip(np.rint(g / np.where(s == 0, 1, s)), -8, 7)
        left -= (q * s.astype(np.float64)).reshape(n, p)
        codes.append((q + ZERO_CODE).astype(np.uint8).reshape(n, p))
        scales.append(s[..., 0])
    carried = r - left[:, :b]
    return np.concatenate(codes, axis=1), np.concatenate(scales, axis=1), carried


def carry_q4_1(dec: DecodedBlocks) -> Q4_1Carry:
    """The fewest digits (MIN_DIGITS..MAX_DIGITS) that land every block's m within MAX_OFFSET_ERROR * d (else the
    most)."""
    assert dec.m is not None, "carry_q4_1 takes Q4_1 blocks"
    n, k = dec.codes.shape
    d = dec.d.astype(np.float64)
    z, r = zero_points(dec.d, dec.m)
    for digits in range(MIN_DIGITS, MAX_DIGITS + 1):
        codes, scales, carried = residual_digits(r, digits)
        m = carried - z * d
        if np.all(np.abs(m - dec.m) <= MAX_OFFSET_ERROR * d):
            break
    zp = np.concatenate([z, np.full((n, scales.shape[1]), ZERO_CODE, np.uint8)], axis=1)
    return Q4_1Carry(np.concatenate([dec.codes, codes], axis=1),
                     np.ascontiguousarray(np.concatenate([dec.d, scales], axis=1), dtype=np.float32), zp, digits, m)


def pack_zero_points(z: np.ndarray) -> np.ndarray:
    """MatMulNBits' 4-bit zero points: ``[N, blocks]`` -> uint8 ``[N * ceil(blocks/2)]``, block 2i in the low
    nibble of byte i (an odd count pads each row's last byte)."""
    z = np.asarray(z, np.uint8)
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
    return np.ascontiguousarray((z[:, 0::2] & 0x0F) | (z[:, 1::2] << 4)).reshape(-1)
