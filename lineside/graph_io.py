"""The contract between emitted graphs and the runtime: input names and decode-state tensors.

Build records, per flavor, which state tensors a graph carries and how each is updated;
the runtime feeds whichever control inputs the graph declares. Shared by build and runtime.

Control inputs (a graph declares the subset it needs):
  input_ids            int64 [batch, seq]
  position_ids         int64 [batch, seq]              absolute positions of the new tokens
  attention_mask       int64 [batch, past_seq + seq]   1 = attend (the ``append`` KV layout)
  seqlens_k            int32 [batch]                   past + new − 1 per row (GroupQueryAttention)
  total_sequence_length int32 []                       max(past + new) over the batch
  past_lengths         int64 [batch]                   tokens already in the cache per row
  logits_positions     int64 [batch, n_logits]         which of the ``seq`` new positions get logits
Output: ``logits`` float32 [batch, n_logits, vocab].

Symbolic dims in state shapes: ``batch``, ``max_seq`` (the bundle's max_seq_len),
``past_seq`` (the past length fed this step), ``seq`` (new tokens this step).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lineside.strenum import StrEnum

Dim = int | str  # a state shape's dim: a number or a symbolic name (``batch``, ``max_seq``, ...)


class StateUpdate(StrEnum):
    """How a state output relates to its input (written into the manifest as its value)."""

    INPLACE = "inplace"  # output aliases the input buffer (cpu flavor: GroupQueryAttention shares past/present)
    APPEND = "append"  # output holds only the new ``seq`` entries along ``seq_axis``; runtime writes them at past_len
    REPLACE = "replace"  # output is the whole new state (fixed shape); runtime swaps it in
    # Like replace, but each of its slots belongs to one of a sequence's first positions (int4 caches' attention-
    # sink entries), and every step that feeds such a position rewrites its slot — rejected drafts and padding
    # columns included — while a row reads slot p only once p is below its length. So a cached prefix carries it
    # whole and nothing is saved or rewound for it (it does not make a model whole-state).
    PREFIX = "prefix"

    @property
    def fixed(self) -> bool:
        """A fixed-shape state the runtime swaps in whole (replace, prefix), not entries at past_len."""
        return self in (StateUpdate.REPLACE, StateUpdate.PREFIX)


# Manifest dtype of a packed int4 KV state (build --kv-dtype int4): uint8 bytes holding two 4-bit grid values each.
PACKED_INT4 = "uint4x2"
STORAGE_DTYPE = {PACKED_INT4: "uint8"}  # state dtype -> the numpy dtype a backend allocates for it (others: itself)


@dataclass
class StateTensor:
    """One decode-state tensor the runtime owns between steps (KV cache, V4 compressor state, ...)."""

    input: str
    output: str
    shape: list[Dim]
    dtype: str = "float32"
    update: StateUpdate = StateUpdate.INPLACE
    seq_axis: int = 2

    def __post_init__(self) -> None:
        self.update = StateUpdate(self.update)  # ValueError for a kind this lineside does not know

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StateTensor:
        return cls(**d)


def resolve_shape(shape: list[Dim], dims: dict[str, int]) -> tuple[int, ...]:
    """Replace symbolic dims with numbers."""
    return tuple(int(dims[s]) if isinstance(s, str) else int(s) for s in shape)
