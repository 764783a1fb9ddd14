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
