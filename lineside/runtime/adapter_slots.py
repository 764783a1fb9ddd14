"""Which adapter sits in which of the backend's LoRA slots, and who is using it.

The engine owns one ``AdapterSlots``: a request naming an adapter takes a reference on its slot at submit
and gives it back when it finishes, so an adapter never leaves its slot under a running or waiting
request. An adapter not in a slot goes into a free one, else into the least recently used slot nobody
references (its adapter is unloaded); when every slot is referenced ``acquire`` raises ``AdapterSlotsFull`` and
the request waits in the scheduler's queue (``Scheduler.adapter_gate``) until a request's end frees one, as vLLM's
scheduler holds a request whose LoRA does not fit. The writes themselves are queued and run by the step runner in
the step thread before the step's forward calls, the only place the backend's tensors change.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from lineside.errors import LinesideError
from lineside.lora import LoraAdapter
from lineside.runtime.request import QueueFullError


class UnknownAdapter(LinesideError):
    """A request named an adapter this engine does not serve (the server answers 404 model_not_found)."""


class AdapterSlotsFull(QueueFullError):
    """Every LoRA slot holds an adapter some request is using: the request waits for one."""


@dataclass(frozen=True)
class AdapterLoad:
    """Write ``adapter`` into backend slot ``slot`` before the next forward call."""

    slot: int
    adapter: LoraAdapter


class AdapterSlots:
    def __init__(self, adapters: dict[str, LoraAdapter], num_slots: int):
        self.adapters = adapters
        self.num_slots = num_slots
        self.resident: dict[int, str] = {}  # slot (1..num_slots) -> adapter name
        self.refs = [0] * (num_slots + 1)
        self.used = [0] * (num_slots + 1)  # LRU clock per slot
        self._tick = itertools.count(1)
        self.pending: list[AdapterLoad] = []
        self.loads = 0  # adapters written into a slot so far
        self.evictions = 0  # of those, ones that replaced another adapter

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def slot_of(self, name: str) -> int | None:
        return next((s for s, n in self.resident.items() if n == name), None)

    def acquire(self, name: str) -> int:
        """The slot holding ``name`` (queued for loading if it was not resident), with a reference taken."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise UnknownAdapter(f"adapter {name!r} is not served here (served: {', '.join(self.adapters) or 'none'})")
        slot = self.slot_of(name)
        if slot is None:
            free = [s for s in range(1, self.num_slots + 1) if s not in self.resident]
            idle = sorted((s for s in self.resident if self.refs[s] == 0), key=lambda s: self.used[s])
            if not free and not idle:
                raise AdapterSlotsFull(f"all {self.num_slots} LoRA adapter slots are in use by running requests "
                                       f"(adapters {', '.join(sorted(self.resident.values()))}); retry after they "
                                       "finish or start the server with a larger --max-loras")
            slot = free[0] if free else idle[0]
            if slot in self.resident:
                self.evictions += 1
            self.resident[slot] = name
            self.pending.append(AdapterLoad(slot, adapter))
            self.loads += 1
        self.refs[slot] += 1
        self.used[slot] = next(self._tick)
        return slot

    def release(self, slot: int) -> None:
        if slot > 0 and self.refs[slot] > 0:
            self.refs[slot] -= 1

    def stats(self) -> dict[str, int]:
        """The engine's ``lora_*`` stats (what /metrics shows)."""
        resident = list(self.resident)
        return dict(lora_adapters_served=len(self.adapters), lora_slots=self.num_slots,
                    lora_adapters_loaded=len(resident), lora_adapters_in_use=sum(1 for s in resident if self.refs[s] > 0),
                    lora_slot_loads=self.loads, lora_slot_evictions=self.evictions)

    def take_pending(self) -> list[AdapterLoad]:
        ops, self.pending = self.pending, []
        return ops
