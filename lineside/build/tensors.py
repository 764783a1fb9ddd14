"""Plain tensor types passed from checkpoint readers to quantizers and graph emitters."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# GGML block formats we can carry without re-quantizing: block size and bytes per block.
GGML_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}


@dataclass
class GGMLBlocks:
    """A weight kept in its GGUF block format, so a 4-bit source isn't quantized a second time.

    ``shape`` is the Hugging Face layout ``(out_features, in_features)``; ``data`` is uint8
    ``[out_features, in_features // 32 * bytes_per_block]`` (blocks run along in_features).
    """

    ggml_type: str
    shape: tuple[int, int]
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 [out, in] exactly as llama.cpp would reconstruct it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(self.data, GGMLQuantizationType[self.ggml_type])
        return np.asarray(w, dtype=np.float32).reshape(self.shape)

    def non_finite_scale(self) -> tuple[int, int, str, float] | None:
        """``(row, block, "d" or "m", value)`` of the first float16 scale d or minimum m (Q4_1) that is inf or NaN,
        else None (also for data whose size doesn't fit the type: decoding reports that)."""
        nbytes = GGML_BLOCKS[self.ggml_type][1]
        data = np.asarray(self.data).reshape(self.shape[0], -1)
        if data.dtype != np.uint8 or data.shape[1] % nbytes:
            return None
        blocks = data.reshape(data.shape[0], -1, nbytes)
        for what, start in (("d", 0), ("m", 2))[: 2 if self.ggml_type == "Q4_1" else 1]:
            v = np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]
            bad = np.argwhere(~np.isfinite(v))
            if bad.size:
                r, b = (int(i) for i in bad[0])
                return r, b, what, float(v[r, b])
        return None
