"""What a backend's state arena holds, read from its real buffers: the ``/metrics`` KV gauges.

Capacity is the bytes of every state buffer allocated for ``num_slots`` sequences of ``max_seq_len``
positions; per token is capacity over those positions (exact for dense caches, whose buffers are
slots x positions x bytes per position; DeepSeek-V4's window and compressed state averaged over the context),
less the entries a sequence holds once whatever its length (int4's 4 fp16 first entries: update ``prefix``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FLOAT_LABELS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class KvArenaBytes:
    """The arena's dtype label (fp32 | fp16 | int8 | int4 | fp8), its bytes and the positions they hold."""

    dtype: str
    capacity_bytes: int
    capacity_tokens: int  # num_slots x max_seq_len
    sequence_bytes: int = 0  # of the capacity: what every slot holds once, not per position

    @property
    def bytes_per_token(self) -> float:
        return (self.capacity_bytes - self.sequence_bytes) / max(1, self.capacity_tokens)


def kv_label(quantization: Mapping[str, Any] | None, value_dtypes: Iterable[np.dtype | str]) -> str:
    """The manifest's quantized KV dtype (``quantization.kv_cache.dtype``), else the float dtype the arena holds
    (the cpu flavor and the trt fp32 reference keep float32 whatever ``--kv-dtype fp16`` says)."""
    kv = (quantization or {}).get("kv_cache") if isinstance(quantization, Mapping) else None
    name = kv.get("dtype") if isinstance(kv, Mapping) else None
    if isinstance(name, str) and name not in ("fp16", "fp32"):
        return name
    floats = sorted({np.dtype(d).name for d in value_dtypes if np.dtype(d).kind == "f"},
                    key=lambda n: -np.dtype(n).itemsize)
    return FLOAT_LABELS.get(floats[0], floats[0]) if floats else "unknown"


def arena_bytes(label: str, nbytes: Iterable[int], *, num_slots: int, max_seq_len: int,
                sequence_bytes: int = 0) -> KvArenaBytes:
    """A backend's KV arena as the gauges read it: its buffers' bytes over the token positions they hold
    (``sequence_bytes``: those of the buffers held once per slot, included in the capacity)."""
    return KvArenaBytes(label, int(sum(nbytes)), int(num_slots) * int(max_seq_len), int(sequence_bytes))
