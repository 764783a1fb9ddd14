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
(``drop``), then its slot frees. Everything past ``hold`` is keyed by the *load* (its prefix-cache namespace), not
the name: a name loaded again (after ``remove``, or ``add(replace=True)``, vLLM's load_inplace) while its old load's
requests still run is a new load beside the old one, so those finish on the old weights, new requests get the new
ones at once, and neither reuses KV the other computed.
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
    """An adapter name that cannot be loaded now: it is served already (and the load does not replace it)."""


class AdapterSlots:
    def __init__(self, adapters: dict[str, LoraAdapter], num_slots: int):
        # a load's key is its prefix-cache namespace: the name for the adapters served from the start, name#N later
        self.served: dict[str, str] = {name: name for name in adapters}  # name -> key of the load requests get
        self.by_key: dict[str, LoraAdapter] = dict(adapters)  # key -> adapter: served, or retiring (held, unloaded)
        self.holds: Counter[str] = Counter()  # requests in flight (waiting or running) per load
        self._generation = itertools.count(1)
        self.num_slots = num_slots
        self.resident: dict[int, str] = {}  # slot (1..num_slots) -> key of the load it holds
        self.refs = [0] * (num_slots + 1)
        self.used = [0] * (num_slots + 1)  # LRU clock per slot
        self._tick = itertools.count(1)
        self.pending: list[AdapterLoad] = []
        self.loads = 0  # adapters written into a slot so far
        self.evictions = 0  # of those, ones that replaced another adapter

    @property
    def names(self) -> list[str]:
        return list(self.served)

    @property
    def adapters(self) -> dict[str, LoraAdapter]:
        """The served adapters by name (what new requests may name)."""
        return {name: self.by_key[key] for name, key in self.served.items()}

    @property
    def namespaces(self) -> dict[str, str]:
        """Each served name's current load key (its prefix-cache namespace)."""
        return dict(self.served)

    @property
    def retiring(self) -> dict[str, LoraAdapter]:
        """Loads no longer served that requests in flight still hold, by key."""
        current = set(self.served.values())
        return {key: a for key, a in self.by_key.items() if key not in current}

    def slot_of(self, key: str) -> int | None:
        return next((s for s, k in self.resident.items() if k == key), None)

    def _unknown(self, name: str) -> UnknownAdapter:
        return UnknownAdapter(f"adapter {name!r} is not served here (served: {', '.join(self.served) or 'none'})")

    def hold(self, name: str) -> str:
        """A new request names ``name``: count it in flight on the current load of ``name`` (kept until ``drop``);
        returns that load's key (its KV's prefix namespace), which ``acquire`` and ``drop`` take. Only a served
        adapter can be held."""
        key = self.served.get(name)
        if key is None:
            raise self._unknown(name)
        self.holds[key] += 1
        return key

    def drop(self, key: str) -> None:
        """A request that held load ``key`` ended (after ``release`` of its slot): an unloaded or replaced load goes
        when the last one has ended, and its slot is emptied."""
        if self.holds[key] > 0:
            self.holds[key] -= 1
        if self.holds[key] == 0:
            del self.holds[key]
            if key not in self.served.values():
                self._forget(key)

    def add(self, adapter: LoraAdapter, *, replace: bool = False) -> None:
        """Serve ``adapter`` from now on (runtime loading) as a new load; a name served already is refused unless
        ``replace`` (vLLM's load_inplace): then its old load retires as ``remove`` retires one."""
        name = adapter.name
        if name in self.served and not replace:
            raise AdapterInUse(f"adapter {name!r} is already loaded; unload it first (POST /v1/unload_lora_adapter), "
                               "reload it with load_inplace true, or choose another lora_name")
        old = self.served.get(name)
        key = f"{name}#{next(self._generation)}"  # '#' is never in a name: no clash with another's key
        self.served[name], self.by_key[key] = key, adapter
        if old is not None:
            self._retire(old)

    def remove(self, name: str) -> None:
        """Stop serving ``name``: new requests get UnknownAdapter; those in flight finish with it."""
        key = self.served.pop(name, None)
        if key is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded (loaded: {', '.join(self.served) or 'none'})")
        self._retire(key)

    def _retire(self, key: str) -> None:
        """A load no longer served: gone now if nobody holds it, else when its last request ends (``drop``)."""
        if self.holds[key] == 0:
            self.holds.pop(key, None)
            self._forget(key)

    def _forget(self, key: str) -> None:
        """Empty the slot of a load nobody uses any more (the backend write is queued like a load)."""
        self.by_key.pop(key, None)
        slot = self.slot_of(key)
        if slot is not None:
            del self.resident[slot]
            self.refs[slot] = 0
            self.pending.append(AdapterLoad(slot, None))

    def acquire(self, key: str) -> int:
        """The slot holding load ``key`` (queued for loading if it was not resident), with a reference taken."""
        adapter = self.by_key.get(key)
        if adapter is None:
            raise self._unknown(_name(key))
        slot = self.slot_of(key)
        if slot is None:
            free = [s for s in range(1, self.num_slots + 1) if s not in self.resident]
            idle = sorted((s for s in self.resident if self.refs[s] == 0), key=lambda s: self.used[s])
            if not free and not idle:
                held = sorted(_name(k) for k in self.resident.values())
                raise AdapterSlotsFull(f"all {self.num_slots} LoRA adapter slots are in use by running requests "
                                       f"(adapters {', '.join(held)}); retry after they finish or start the server "
                                       "with a larger --max-loras")
            slot = free[0] if free else idle[0]
            if slot in self.resident:
                self.evictions += 1
            self.resident[slot] = key
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
        return dict(lora_adapters_served=len(self.served), lora_slots=self.num_slots,
                    lora_adapters_loaded=len(resident), lora_adapters_in_use=sum(1 for s in resident if self.refs[s] > 0),
                    lora_slot_loads=self.loads, lora_slot_evictions=self.evictions)

    def take_pending(self) -> list[AdapterLoad]:
        ops, self.pending = self.pending, []
        return ops


def _name(key: str) -> str:
    """The adapter name of a load's key (name, or name#N)."""
    return key.partition("#")[0]
