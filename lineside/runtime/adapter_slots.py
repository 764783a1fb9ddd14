"""Which adapter sits in which of the backend's LoRA slots, and who is using it.

The engine owns one ``AdapterSlots``: a request naming an adapter takes a reference on its slot at submit
and gives it back when it finishes, so an adapter never leaves its slot under a running or waiting
request. An adapter not in a slot goes into a free one, else into the least recently used slot nobody
references (its adapter is unloaded); when every slot is referenced ``acquire`` raises ``AdapterSlotsFull`` and
the request waits in the scheduler's queue (``Scheduler.adapter_gate``) until a request's end frees one, as vLLM's
scheduler holds a request whose LoRA does not fit. The writes themselves are queued and run by the step runner in
the step thread before the step's forward calls, the only place the backend's tensors change.

Adapters may come and go at runtime (``serve --allow-runtime-lora``): ``add`` serves a new one, ``remove`` stops
serving one; requests already holding it (``hold``, taken at submit) keep it until the last of them ends
(``drop``), then its slot frees. Each load gets its own prefix-cache namespace, so an adapter loaded again under
the same name never reuses KV the old one computed.
"""

from __future__ import annotations

import itertools
from collections import Counter
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
    """Write ``adapter`` into backend slot ``slot`` before the next forward call (None: empty the slot)."""

    slot: int
    adapter: LoraAdapter | None


class AdapterInUse(LinesideError):
    """An adapter name that cannot be (re)loaded now: it is served, or still finishing requests after an unload."""


class AdapterSlots:
    def __init__(self, adapters: dict[str, LoraAdapter], num_slots: int):
        self.adapters = dict(adapters)  # served: new requests may name these
        self.retiring: dict[str, LoraAdapter] = {}  # removed, still held by requests in flight
        self.holds: Counter[str] = Counter()  # requests in flight (waiting or running) per adapter name
        self.namespaces = {name: name for name in adapters}  # prefix-cache namespace of each adapter's KV
        self._generation = itertools.count(1)
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

    def _unknown(self, name: str) -> UnknownAdapter:
        return UnknownAdapter(f"adapter {name!r} is not served here (served: {', '.join(self.adapters) or 'none'})")

    def hold(self, name: str) -> str:
        """A new request names ``name``: count it in flight (its adapter stays until ``drop``); returns the prefix
        namespace its KV belongs to. Only a served adapter can be held."""
        if name not in self.adapters:
            raise self._unknown(name)
        self.holds[name] += 1
        return self.namespaces[name]

    def drop(self, name: str) -> None:
        """A request that held ``name`` ended (after ``release`` of its slot): a removed adapter goes when the last
        one has ended, and its slot is emptied."""
        if self.holds[name] > 0:
            self.holds[name] -= 1
        if self.holds[name] == 0:
            del self.holds[name]
            if self.retiring.pop(name, None) is not None:
                self._forget(name)

    def add(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` from now on (runtime loading); a name served, or still in use after its removal, is
        refused."""
        name = adapter.name
        if name in self.adapters:
            raise AdapterInUse(f"adapter {name!r} is already loaded; unload it first (POST /v1/unload_lora_adapter) "
                               "or choose another lora_name")
        if name in self.retiring:
            raise AdapterInUse(f"adapter {name!r} was unloaded but {self.holds[name]} request(s) still use it; retry "
                               "after they finish")
        self.adapters[name] = adapter
        self.namespaces[name] = f"{name}#{next(self._generation)}"  # '#' is never in a name: no clash

    def remove(self, name: str) -> None:
        """Stop serving ``name``: new requests get UnknownAdapter; those in flight finish with it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded (loaded: {', '.join(self.adapters) or 'none'})")
        if self.holds[name] > 0:
            self.retiring[name] = adapter
        else:
            self.holds.pop(name, None)
            self._forget(name)

    def _forget(self, name: str) -> None:
        """Empty the slot of an adapter nobody uses any more (the backend write is queued like a load)."""
        self.namespaces.pop(name, None)
        slot = self.slot_of(name)
        if slot is not None:
            del self.resident[slot]
            self.refs[slot] = 0
            self.pending.append(AdapterLoad(slot, None))

    def acquire(self, name: str) -> int:
        """The slot holding ``name`` (queued for loading if it was not resident), with a reference taken."""
        adapter = self.adapters.get(name) or self.retiring.get(name)
        if adapter is None:
            raise self._unknown(name)
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
