"""Pack integer codes into the byte layouts the two graph flavors read."""

from __future__ import annotations

import numpy as np


def pack_matmulnbits(u: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """MatMulNBits ``B``: unsigned codes ``u [N, K]`` → uint8 ``[N, K/block, block*bits/8]``.

    4 bits: value ``2i`` in the low nibble of byte ``i``, ``2i+1`` in the high nibble.
    """
    n, k = u.shape
    u = np.asarray(u, dtype=np.uint8)
    if bits == 8:
        return np.ascontiguousarray(u).reshape(n, k // block_size, block_size)
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    pairs = u.reshape(n, k // 2, 2)
    packed = (pairs[..., 0] & 0x0F) | (pairs[..., 1] << 4)
    return packed.reshape(n, k // block_size, block_size // 2)


def pack_int4_kn(codes: np.ndarray) -> bytes:
    """ONNX INT4 raw data of ``codes.T``: signed codes ``[N, K]`` → packed bytes of a ``[K, N]`` tensor.

    Row-major order, two values per byte, the first in the low nibble (an odd count pads the last byte).
    """
    flat = np.ascontiguousarray(np.asarray(codes, dtype=np.int8).T).reshape(-1).view(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return ((flat[0::2] & 0x0F) | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_int4(raw: bytes, count: int) -> np.ndarray:
    """Signed int8 values from ONNX INT4 raw bytes (used by tests and graph inspection)."""
    b = np.frombuffer(raw, dtype=np.uint8)
    v = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(-1)[:count].astype(np.int8)
    return np.where(v > 7, v - 16, v).astype(np.int8)
