"""Where the TensorRT backend keeps slots' whole-state rows while a speculative verification step runs.

A verification step advances whole-state tensors (StateUpdate.REPLACE: DeepSeek-V4's window, compressor
state, compressed entries) over every token it feeds, rejected drafts too; the row is put back from this copy.
One row per slot and state, planned here as pure data; the backend allocates it once, when speculation is
first asked for (a backend that never speculates holds none of it), and copies device to device on its stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lineside.errors import LinesideError
from lineside.graph_io import StateUpdate
from lineside.runtime.tensorrt.buffers import ALIGN, StateLayout


@dataclass
class SavePlan:
    """Offsets of each whole-state tensor's ``num_slots`` saved rows inside one allocation of ``total`` bytes;
    ``epoch`` per slot tells a current copy from a stale one (saved again since)."""

    num_slots: int
    layouts: list[StateLayout]
    offsets: dict[str, int] = field(default_factory=dict)
    total: int = 0
    epoch: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for lay in self.layouts:
            self.offsets[lay.state.input] = self.total
            self.total += -(-self.num_slots * lay.row_bytes(0) // ALIGN) * ALIGN
        self.epoch = [0] * self.num_slots

    def row(self, base: int, lay: StateLayout, slot: int) -> int:
        """Device address of ``slot``'s saved row of ``lay`` (rows are indexed by slot, not by arena row)."""
        return base + self.offsets[lay.state.input] + slot * lay.row_bytes(0)

    def saved(self, slot: int) -> int:
        """Record a new save of ``slot``; returns its epoch (the handle ``check`` takes back)."""
        self.epoch[slot] += 1
        return self.epoch[slot]

    def check(self, slot: int, epoch: int | None) -> None:
        if epoch is None or epoch != self.epoch[slot]:
            raise LinesideError(f"restore_rows: slot {slot} has no current saved state (never saved, or saved "
                                "again since); save_rows must come right before the step it undoes")


def plan_saves(layouts: list[StateLayout], num_slots: int) -> SavePlan:
    """The save area for the whole-state tensors among ``layouts`` (append state is never saved: a rejected
    position's KV is simply overwritten by the next step)."""
    return SavePlan(num_slots, [lay for lay in layouts if lay.update == StateUpdate.REPLACE])
