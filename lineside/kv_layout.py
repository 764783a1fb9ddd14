"""How each ``--kv-dtype`` stores one cached head vector: bits per value and the bytes of its scale.

The one place the builder's KV emitters, the memory planner and the runtime's KV gauges agree on. Quantized
caches keep one fp16 scale per (token, KV head) next to the values (build/quant/kv.py says why); int4 packs
two values per byte (low nibble first). ``fp16`` is the float cache: 2 bytes in the trt flavor's fp16
builds (4 in its fp32 reference and in the cpu flavor, whose cache is float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KvVectorLayout:
    """Bytes of one stored head vector of ``n`` values: packed values, then the scale beside them."""

    name: str
    value_bits: int
    scale_bytes: int  # one scale per head vector (0: an unscaled float cache)

    def value_bytes(self, n: int) -> int:
        return math.ceil(n * self.value_bits / 8)

    def vector_bytes(self, n: int) -> int:
        return self.value_bytes(n) + self.scale_bytes


FP16_SCALE = 2
KV_LAYOUTS: dict[str, KvVectorLayout] = {
    "fp16": KvVectorLayout("fp16", 16, 0),
    "int8": KvVectorLayout("int8", 8, FP16_SCALE),
    "fp8": KvVectorLayout("fp8", 8, FP16_SCALE),
    "int4": KvVectorLayout("int4", 4, FP16_SCALE),  # uint8 [.., head_dim / 2]: two values per byte
}
