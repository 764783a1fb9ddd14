"""The adapter slots' A/B tensors, laid out as the LoRA graphs read them (build/graph/lora.py says how).

A backend running a LoRA graph owns one ``LoraStack``: per adapted site an A ``[in, K]`` and a B ``[K, out]``
with K = slots × max_rank × parts, slot-major, allocated once, so their addresses stay fixed (bound once
through IOBinding, or captured in a CUDA graph). Loading an adapter writes its columns of its slot; unloading
zeroes them. Slot 0 means "no adapter" and owns no columns.
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
    n, r = slots.max_loras, slots.max_rank
    sites = lora_sites(cfg, targets)
    ab = sum(n * r * len(s.parts) * (s.in_features + s.out_features) for s in sites) * itemsize
    return ab + sum(n * r * p * 8 for p in {len(s.parts) for s in sites})


class LoraStack:
    """Every site's stacked A/B tensors and the column → slot maps (the graph's ``lora_cols.P`` inputs)."""

    def __init__(self, cfg: ModelConfig, targets: tuple[LoraTarget, ...], slots: LoraSlotsConfig,
                 dtype: type = np.float32):
        slots.check()
        self.targets, self.slots = targets, slots
        self.sites: list[LoraSite] = lora_sites(cfg, targets)
        n, r = slots.max_loras, slots.max_rank
        self.arrays: dict[str, np.ndarray] = {}
        for s in self.sites:
            k = n * r * len(s.parts)
            self.arrays[s.a_input] = np.zeros((s.in_features, k), dtype=dtype)
            self.arrays[s.b_input] = np.zeros((k, s.out_features), dtype=dtype)
        for p in sorted({len(s.parts) for s in self.sites}):
            self.arrays[cols_input(p)] = np.repeat(np.arange(1, n + 1, dtype=np.int64), r * p)
        self.loaded: list[str | None] = [None] * (n + 1)  # by slot; [0] stays None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot`` (1..max_loras), replacing what it held."""
        self._check_slot(slot)
        check_fits(adapter, self.slots.max_rank, self.targets, "this backend's adapter slots")
        self.unload(slot)
        r = self.slots.max_rank
        for s in self.sites:
            a, b = self.arrays[s.a_input], self.arrays[s.b_input]
            base = (slot - 1) * r * len(s.parts)
            for j, (part, offset) in enumerate(zip(s.parts, s.offsets, strict=True)):
                pair = adapter.weights.get((s.layer, part))
                if pair is None:
                    continue
                la, lb = pair  # [rank, in], [out, rank] (scaling folded in)
                c0, rank = base + j * r, la.shape[0]
                a[:, c0:c0 + rank] = la.T
                b[c0:c0 + rank, offset:offset + lb.shape[0]] = lb.T
        self.loaded[slot] = adapter.name

    def unload(self, slot: int) -> None:
        self._check_slot(slot)
        r = self.slots.max_rank
        for s in self.sites:
            width = r * len(s.parts)
            c0 = (slot - 1) * width
            self.arrays[s.a_input][:, c0:c0 + width] = 0
            self.arrays[s.b_input][c0:c0 + width] = 0
        self.loaded[slot] = None

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.slots.max_loras:
            raise LinesideError(f"adapter slot {slot} is outside 1..{self.slots.max_loras}")
