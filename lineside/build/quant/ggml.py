"""Decode GGUF Q4_0 / Q4_1 / Q8_0 blocks into integer codes and per-block scales, bit-exactly.

Q4_0: ``w = d * (u - 8)``; Q4_1: ``w = d * u + m``; Q8_0: ``w = d * q``; 32 values per block,
``d`` and ``m`` float16. In a Q4 block byte ``j`` holds value ``j`` (low nibble) and ``j + 16``
(high nibble) — not the consecutive-pairs order of MatMulNBits or ONNX INT4, so codes are repacked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lineside.build.tensors import GGML_BLOCKS, GGMLBlocks
from lineside.errors import CheckpointError

CARRIED = ("Q4_0", "Q4_1", "Q8_0")
BLOCK = 32


@dataclass
class DecodedBlocks:
    """``codes [out, in]``: uint8 0..15 for Q4_0/Q4_1, int8 for Q8_0; ``d``/``m`` float32 ``[out, in/32]``."""

    ggml_type: str
    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]``, the same arithmetic (and rounding) as gguf's dequantize."""
        out, k = self.codes.shape
        q = self.codes.reshape(out, k // BLOCK, BLOCK).astype(np.float32)
        if self.ggml_type == "Q4_0":
            q -= 8
        w = self.d[..., None] * q
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(out, k)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def decode_blocks(w: GGMLBlocks, name: str = "weight") -> DecodedBlocks:
    """Split a Q4_0/Q4_1/Q8_0 ``GGMLBlocks`` into codes and scales (CheckpointError if malformed)."""
    if w.ggml_type not in CARRIED:
        raise CheckpointError(f"{name}: GGML type {w.ggml_type} can't be carried; only {', '.join(CARRIED)}")
    out, k = (int(v) for v in w.shape)
    bs, nbytes = GGML_BLOCKS[w.ggml_type]
    nblk = k // bs
    data = np.asarray(w.data)
    if k % bs or data.dtype != np.uint8 or data.size != out * nblk * nbytes:
        raise CheckpointError(
            f"{name}: {w.ggml_type} data of {data.size} bytes doesn't fit shape {w.shape}; the GGUF is truncated or corrupt"
        )
    blocks = data.reshape(out, nblk, nbytes)
    d = _f16(blocks, 0)
    if w.ggml_type == "Q8_0":
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, k)
        return DecodedBlocks("Q8_0", codes, d)
    qs = blocks[..., -16:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out, k)
    m = _f16(blocks, 2) if w.ggml_type == "Q4_1" else None
    return DecodedBlocks(w.ggml_type, codes, d, m)
