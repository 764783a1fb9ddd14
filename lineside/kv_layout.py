"""How each ``--kv-dtype`` stores one cached head vector: bits per value and the fp16 scales beside them.

What the memory planner and the runtime's KV gauges count, matching the builder's KV formats
(build/quant/kv.py FORMATS; tests/jetson/test_planner.py ties the two and both to the emitted state shapes):
int8 keeps one fp16 scale per (token, KV head); int4 packs two values per byte and keeps an fp16 scale and an
fp16 minimum per (token, KV head, 16 channels) (asymmetric grid), and in dense models each sequence's first
4 entries once more in fp16 (the attention sinks). ``fp16`` is the float cache: 2 bytes in the trt flavor's fp16 builds (4 in its
fp32 reference and in the cpu flavor, whose cache is float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP16_SCALE = 2


@dataclass(frozen=True)
class KvVectorLayout:
    """Bytes of one stored head vector of ``n`` values: packed values, then its scales."""

    name: str
    value_bits: int
    scale_bytes: int = 0  # bytes of one scale (0: an unscaled float cache)
    scale_group: int = 0  # values per scale (0: one scale for the whole head vector)
    per_group: int = 1  # fp16 numbers per scale group (2: scale and minimum of an asymmetric grid)
    sink: int = 0  # dense models: a sequence's first K and V head vectors also kept in fp16 (quant/kv.py SINK)

    def sink_bytes(self, n: int) -> int:
        """Bytes per (sequence, layer, KV head, K or V) beside the per-token entries: the fp16 first entries."""
        return FP16_SCALE * n * self.sink

    def value_bytes(self, n: int) -> int:
        return math.ceil(n * self.value_bits / 8)

    def scales(self, n: int) -> int:
        """fp16 numbers beside a head vector: per_group per scale group (one group when it spans the vector, as
        the builder does)."""
        if not self.scale_bytes:
            return 0
        groups = 1 if not self.scale_group or self.scale_group >= n else math.ceil(n / self.scale_group)
        return groups * self.per_group

    def vector_bytes(self, n: int) -> int:
        return self.value_bytes(n) + self.scales(n) * self.scale_bytes


KV_LAYOUTS: dict[str, KvVectorLayout] = {
    "fp16": KvVectorLayout("fp16", 16),
    "int8": KvVectorLayout("int8", 8, FP16_SCALE),
    "fp8": KvVectorLayout("fp8", 8, FP16_SCALE),
    # uint8 [.., head_dim / 2] + fp16 (scale, minimum) pairs [.., 2 * head_dim / 16]: head_dim 64 -> 48 bytes (0.375x)
    "int4": KvVectorLayout("int4", 4, FP16_SCALE, scale_group=16, per_group=2, sink=4),
}
