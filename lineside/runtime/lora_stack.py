"""The adapter slots' A/B tensors, laid out as the LoRA graphs read them (build/graph/lora.py says how).

A backend running a LoRA graph owns one ``LoraStack``: per adapted site a buffer for A^T ``[P·K, in]`` and one
per part for B^T ``[out_part, K]`` (PEFT's own orientations: an adapter's lora_A rows and lora_B columns are
copied as they are), allocated once at the slots' capacity (K ≤ slots × max_rank), so nothing is allocated
when adapters come and go. What the graph is given (``arrays``) are contiguous views of the buffers' first
K columns' worth, K being the stack's live width:
- packed (onnxruntime): the loaded adapters side by side, each at its own rank, empty slots taking no
  column — a step reads what is loaded and nothing more; K changes with every load or unload, the views
  are rebuilt then (``version`` counts them), and K = 0 means no adapter at all (run the base graph);
- padded (TensorRT): every slot at max_rank whether loaded or not, so shapes and device addresses never
  change (a captured CUDA graph replays for any set of loaded adapters).
The column → slot maps (``lora_cols.P``, the row masks' other side) are rebuilt with the layout. Slot 0 means
"no adapter" and owns no columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lineside.config import ModelConfig
from lineside.errors import LinesideError
from lineside.lora import LoraAdapter, LoraSite, LoraTarget, check_fits, cols_input, lora_sites


@dataclass(frozen=True)
class LoraSlotsConfig:
    """How many adapters a backend holds at once, and the largest rank each slot takes."""

    max_loras: int
    max_rank: int

    def check(self) -> None:
        if not 1 <= self.max_loras <= 64:
            raise LinesideError(f"--max-loras {self.max_loras} must be 1 to 64")
        if not 1 <= self.max_rank <= 1024:
            raise LinesideError(f"--max-lora-rank {self.max_rank} must be 1 to 1024")


def stack_bytes(cfg: ModelConfig, targets: tuple[LoraTarget, ...], slots: LoraSlotsConfig,
                itemsize: int = 4) -> int:
    """What a ``LoraStack`` of ``slots`` allocates (A/B of ``itemsize`` bytes, int64 column maps), counted before
    allocating it: ``serve`` refuses slots that cannot fit in memory instead of being OOM-killed."""
    cap = slots.max_loras * slots.max_rank
    sites = lora_sites(cfg, targets)
    ab = sum(cap * (len(s.parts) * s.in_features + sum(s.part_widths)) for s in sites) * itemsize
    return ab + sum(cap * p * 8 for p in {len(s.parts) for s in sites})


@dataclass(frozen=True)
class SlotColumns:
    """Where one slot's columns sit in every part's block: ``start .. start + width`` (its adapter or none)."""

    slot: int
    start: int
    width: int
    adapter: LoraAdapter | None


class LoraStack:
    """Every site's A/B tensors and the column → slot maps (the graph's ``lora_cols.P`` inputs)."""

    def __init__(self, cfg: ModelConfig, targets: tuple[LoraTarget, ...], slots: LoraSlotsConfig, *,
                 dtype: type = np.float32, packed: bool = True) -> None:
        slots.check()
        self.targets, self.slots, self.packed = targets, slots, packed
        self.sites: list[LoraSite] = lora_sites(cfg, targets)
        cap = slots.max_loras * slots.max_rank
        self._a = {s.a_input: np.zeros((len(s.parts) * cap, s.in_features), dtype=dtype) for s in self.sites}
        self._b = {b: np.zeros(cap * w, dtype=dtype) for s in self.sites
                   for b, w in zip(s.b_inputs, s.part_widths, strict=True)}
        self._cols = {p: np.zeros(p * cap, dtype=np.int64) for p in sorted({len(s.parts) for s in self.sites})}
        self.adapters: list[LoraAdapter | None] = [None] * (slots.max_loras + 1)  # by slot; [0] stays None
        self.arrays: dict[str, np.ndarray] = {}  # the graph's inputs: views of the buffers at the live width
        # the same inputs at width 0: a step with no adapter row binds these (its deltas read nothing)
        self.empty: dict[str, np.ndarray] = {cols_input(p): np.zeros(0, np.int64) for p in self._cols}
        for s in self.sites:
            self.empty[s.a_input] = np.zeros((0, s.in_features), dtype=dtype)
            self.empty.update({b: np.zeros((w, 0), dtype=dtype) for b, w in zip(s.b_inputs, s.part_widths, strict=True)})
        self.width = 0
        self.version = 0
        self._repack()

    @property
    def loaded(self) -> list[str | None]:
        return [None if a is None else a.name for a in self.adapters]

    @property
    def nbytes(self) -> int:
        """The buffers' capacity (what ``stack_bytes`` counts), whatever is loaded."""
        return sum(a.nbytes for group in (self._a, self._b, self._cols) for a in group.values())

    @property
    def live_bytes(self) -> int:
        """What one step reads of the stack: the live views."""
        return sum(a.nbytes for a in self.arrays.values())

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot`` (1..max_loras), replacing what it held."""
        self._check_slot(slot)
        check_fits(adapter, self.slots.max_rank, self.targets, "this backend's adapter slots")
        self.adapters[slot] = adapter
        self._repack()

    def unload(self, slot: int) -> None:
        self._check_slot(slot)
        self.adapters[slot] = None
        self._repack()

    def layout(self) -> list[SlotColumns]:
        """Each slot's columns: packed, the loaded ones at their own rank; padded, every slot at max_rank."""
        r, out, start = self.slots.max_rank, [], 0
        for slot in range(1, self.slots.max_loras + 1):
            adapter = self.adapters[slot]
            if self.packed and adapter is None:
                continue
            width = adapter.rank if self.packed and adapter is not None else r
            out.append(SlotColumns(slot, start, width, adapter))
            start += width
        return out

    def _repack(self) -> None:
        """Rewrite every tensor for the current layout (between steps; the bound views change with K)."""
        cols = self.layout()
        k = sum(c.width for c in cols)
        owner = np.concatenate([np.full(c.width, c.slot, np.int64) for c in cols]) if cols else \
            np.zeros(0, np.int64)
        arrays: dict[str, np.ndarray] = {}
        for p, buf in self._cols.items():
            view = buf[:p * k]
            view[:] = np.tile(owner, p)
            arrays[cols_input(p)] = view
        for s in self.sites:
            a = self._a[s.a_input][:len(s.parts) * k]
            a[:] = 0
            arrays[s.a_input] = a
            for j, (part, b_name, w) in enumerate(zip(s.parts, s.b_inputs, s.part_widths, strict=True)):
                b = self._b[b_name][:w * k].reshape(w, k)
                b[:] = 0
                arrays[b_name] = b
                for c in cols:
                    pair = None if c.adapter is None else c.adapter.scaled_pair((s.layer, part))
                    if pair is None:
                        continue
                    la, lb = pair  # [rank, in], [out, rank] (scaling folded in)
                    rank = la.shape[0]
                    a[j * k + c.start:j * k + c.start + rank] = la
                    b[:, c.start:c.start + rank] = lb
        self.arrays, self.width = arrays, k
        self.version += 1

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.slots.max_loras:
            raise LinesideError(f"adapter slot {slot} is outside 1..{self.slots.max_loras}")
