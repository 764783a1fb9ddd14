"""Where each slot's state lives on the TensorRT backend, and what one step feeds the engine (pure numpy).

TensorRT 10.3 takes only contiguous inputs and has no in-place KV layer, so the KV arena of each
layer is laid out exactly as the graph input ``past_key.i [batch, kv_heads, P, head_dim]`` wants:
the ``B`` slots of a step sit in physical rows ``0..B-1`` and ``P`` (the row pitch) is the current
length bucket. A step then feeds the arena itself (no copy); the graph returns only the new K/V,
which the runtime writes at each row's past length. Rows are swapped when the batch changes and
the pitch is re-laid out when the longest slot crosses a bucket: both rare, neither per token.
These swaps are the only slot moves on this backend (it says ``needs_contiguous_slots = False``, so
the scheduler never moves a sequence to another slot for it).
The device executor (backend.py) and the CPU test's numpy executor apply the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lineside.errors import LinesideError
from lineside.runtime.tensorrt.graphs import pick_bucket


@dataclass
class Swap:
    row_a: int
    row_b: int


@dataclass
class Relayout:
    old_pitch: int
    new_pitch: int


@dataclass
class StepInputs:
    """Host arrays for one engine call; rows ``rows..batch_bucket-1`` are padding (never written back)."""

    rows: int
    batch_bucket: int
    past_seq: int
    seq: int
    input_ids: np.ndarray  # int64 [Bb, S]
    position_ids: np.ndarray  # int64 [Bb, S]
    attention_mask: np.ndarray  # int64 [Bb, P + S]
    logits_positions: np.ndarray  # int64 [Bb, K]
    write_pos: np.ndarray  # int64 [Bb]: past length per row, -1 = do not write this row back
    new_lengths: np.ndarray  # int64 [Bb]
    past_lengths: np.ndarray  # int64 [Bb] (graphs that take past_lengths instead of a mask)

    @property
    def is_decode(self) -> bool:
        return self.seq == 1

    @property
    def key(self) -> tuple[int, int]:
        return (self.batch_bucket, self.past_seq)


@dataclass
class ArenaLayout:
    """Logical slot ↔ physical row map, cached lengths, and the current pitch (length bucket)."""

    num_slots: int
    max_seq: int
    length_buckets: list[int]
    batch_buckets: list[int]
    pitch: int = 0
    lengths: np.ndarray = field(init=False)
    phys_of: list[int] = field(init=False)
    slot_at: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = np.zeros(self.num_slots, dtype=np.int64)
        self.phys_of = list(range(self.num_slots))
        self.slot_at = list(range(self.num_slots))
        self.pitch = self.pitch or self.length_buckets[0]

    # ---- slot bookkeeping --------------------------------------------------------------
    def reset(self, slot: int) -> None:
        self.check_slot(slot)
        self.lengths[slot] = 0

    def copied(self, src: int, dst: int, length: int) -> tuple[int, int]:
        """Record a prefix copy; returns the physical (src, dst) rows to copy."""
        self.check_slot(src)
        self.check_slot(dst)
        if not 0 <= length <= self.lengths[src]:
            raise LinesideError(f"copy_slot: slot {src} holds {self.lengths[src]} tokens, cannot copy {length}")
        self.lengths[dst] = length
        return self.phys_of[src], self.phys_of[dst]

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise LinesideError(f"slot {slot} is out of range (this backend has {self.num_slots} slots)")

    # ---- planning ----------------------------------------------------------------------
    def required_pitch(self, slots: list[int], totals: np.ndarray) -> int:
        """Smallest bucket holding every slot after this step (slots outside the batch keep their data)."""
        lengths = self.lengths.copy()
        lengths[slots] = totals
        need = int(lengths.max(initial=1))
        if need > self.max_seq:
            raise LinesideError(f"sequence would reach {need} tokens, over this bundle's max_seq_len {self.max_seq}")
        return pick_bucket(max(need, 1), self.length_buckets)

    def plan_moves(self, slots: list[int], totals: np.ndarray) -> list[Swap | Relayout]:
        """Moves that put ``slots`` in rows 0..B-1 at a pitch that fits; updates the bookkeeping."""
        if len(set(slots)) != len(slots):
            raise LinesideError(f"a step names a slot twice: {slots}")
        for s in slots:
            self.check_slot(s)
        moves: list[Swap | Relayout] = []
        need = self.required_pitch(slots, totals)
        if need > self.pitch or need * 2 <= self.pitch:
            moves.append(Relayout(self.pitch, need))
            self.pitch = need
        for i, s in enumerate(slots):
            r = self.phys_of[s]
            if r != i:
                other = self.slot_at[i]
                moves.append(Swap(i, r))
                self.slot_at[i], self.slot_at[r] = s, other
                self.phys_of[s], self.phys_of[other] = i, r
        return moves

    def step_inputs(self, input_ids: np.ndarray, past: np.ndarray, new: np.ndarray,
                    logits_positions: np.ndarray) -> StepInputs:
        """Engine inputs for rows already placed at 0..B-1 (``plan_moves`` first)."""
        b, s = input_ids.shape
        bb = pick_bucket(b, self.batch_buckets)
        p = self.pitch
        k = logits_positions.shape[1]
        ids = np.zeros((bb, s), dtype=np.int64)
        ids[:b] = input_ids
        pos = np.zeros((bb, s), dtype=np.int64)
        pos[:b] = np.minimum(past[:, None] + np.arange(s, dtype=np.int64)[None, :], self.max_seq - 1)
        mask = np.zeros((bb, p + s), dtype=np.int64)
        cols = np.arange(p + s)[None, :]
        mask[:b] = (cols < past[:, None]) | ((cols >= p) & (cols < p + new[:, None]))
        mask[b:, p] = 1  # padding rows attend to one position so their softmax stays finite
        mask[:b][new == 0, p] = 1
        lp = np.zeros((bb, k), dtype=np.int64)
        lp[:b] = logits_positions
        write = np.full(bb, -1, dtype=np.int64)
        write[:b] = np.where(new > 0, past, -1)
        nl = np.zeros(bb, dtype=np.int64)
        nl[:b] = new
        pl = np.zeros(bb, dtype=np.int64)
        pl[:b] = past
        return StepInputs(b, bb, p, s, ids, pos, mask, lp, write, nl, pl)

    def commit(self, slots: list[int], totals: np.ndarray) -> None:
        self.lengths[slots] = totals


@dataclass
class Chunk:
    offset: int
    input_ids: np.ndarray  # [B, w]
    new_lengths: np.ndarray  # [B]
    logits_positions: np.ndarray  # [B, Kc] local to the chunk
    source: np.ndarray  # [B, Kc]: which of the step's K logits each column is (-1 = filler)


def chunks(input_ids: np.ndarray, new_lengths: np.ndarray, logits_positions: np.ndarray,
           max_chunk: int) -> list[Chunk]:
    """Split a step into chunks of ≤ max_chunk tokens, each asking only for the logits that fall inside it."""
    b, s = input_ids.shape
    out = []
    for off in range(0, max(s, 1), max_chunk):
        w = min(max_chunk, s - off)
        nl = np.clip(new_lengths - off, 0, w)
        inside = (logits_positions >= off) & (logits_positions < off + w)
        kc = max(1, int(inside.sum(axis=1).max(initial=0)))
        lp = np.zeros((b, kc), dtype=np.int64)
        src = np.full((b, kc), -1, dtype=np.int64)
        for r in range(b):
            idx = np.nonzero(inside[r])[0]
            lp[r, :len(idx)] = logits_positions[r, idx] - off
            src[r, :len(idx)] = idx
        out.append(Chunk(off, input_ids[:, off:off + w], nl, lp, src))
    return out


def gather_chunk_logits(parts: list[tuple[Chunk, np.ndarray]], k: int) -> np.ndarray:
    """Assemble logits [B, K, V] from (chunk, its logits [B, Kc, V]) pairs."""
    first = parts[0][1]
    res = np.zeros((first.shape[0], k, first.shape[2]), dtype=np.float32)
    for ch, lg in parts:
        rows, cols = np.nonzero(ch.source >= 0)
        res[rows, ch.source[rows, cols]] = lg[rows, cols]
    return res
