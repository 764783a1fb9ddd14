"""KV cache arena bookkeeping: which request owns which backend slot, block-granular capacity, prefix reuse.

The backend preallocates ``num_slots`` slots of ``max_seq_len`` positions; nothing is reallocated.
Capacity is counted in blocks of ``block_size`` positions: a request reserves the blocks for
prompt + max_tokens when it is admitted, so it can never run out mid-generation (``num_blocks``
may be set below ``num_slots × blocks_per_slot`` to budget memory). The arena answers every
capacity question itself (``can_admit``, also "if these slots were freed" for preemption), so
the scheduler never sums reservations. ``move`` relocates a request for a backend that wants the
decode batch in one range of slots (``Backend.needs_contiguous_slots``). A slot's KV stays valid
after its request ends: full blocks are hashed (chained, so a hash names the whole prefix) and a
new prompt that starts with a cached prefix copies those positions instead of recomputing them. KV is
kept per ``namespace`` (a LoRA adapter's name; "" for the base model): the chain starts from it and a
lookup matches only slots of the same one, since another adapter's KV of the same tokens differs. A request's
vLLM ``cache_salt`` joins its namespace (``salted``): KV is then shared only between requests of that salt.
A request that reuses nothing takes the free slot whose cache is worth least (``victim``): one holding no
reusable KV, else the least recently used, so recently used prefixes survive unrelated requests while free slots
can hold them (vLLM's prefix cache is LRU over all free blocks); the lowest free slot would overwrite the same
prefix every time requests come one at a time.
A finished request's answer was written by decode steps, which are not offered for reuse (the scheduler's
``single-token steps``); ``keep_answer`` notes the ids to recompute it from with prefill chunks while the engine idles
(``settled``), so a chat's next turn reuses its prompt and the answer, as vLLM's prefix cache does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lineside.strenum import StrEnum

# whose KV a slot holds: an adapter load's name ("" the base model), or (that name, a cache_salt)
Namespace = str | tuple[str, str]


def salted(namespace: str, salt: str | None) -> Namespace:
    """``namespace`` kept apart by ``salt`` (vLLM's cache_salt); no salt: the namespace itself, shared as before.
    A tuple, so no adapter name can spell another's salted namespace."""
    return namespace if salt is None else (namespace, salt)


class SlotOpKind(StrEnum):
    COPY = "copy"  # Backend.copy_slot(src, dst, length): prefix reuse or a move
    RESET = "reset"  # Backend.reset_slot(dst): a request starts from position 0


@dataclass
class SlotOp:
    """A backend operation the next step runs before its forward calls (in order)."""

    kind: SlotOpKind
    src: int
    dst: int
    length: int = 0


class KVCacheArena:
    def __init__(self, num_slots: int, max_seq_len: int, block_size: int = 16, *, num_blocks: int | None = None,
                 prefix_cache: bool = True):
        if block_size < 1:
            raise ValueError("kv_block_size must be ≥ 1")
        self.num_slots, self.max_seq_len, self.block_size = num_slots, max_seq_len, block_size
        self.blocks_per_slot = -(-max_seq_len // block_size)
        full = num_slots * self.blocks_per_slot
        self.total_blocks = full if num_blocks is None else max(1, min(int(num_blocks), full))
        self.prefix_cache = prefix_cache
        self.owner: list[Any] = [None] * num_slots
        self.reserved = [0] * num_slots  # blocks reserved by the owner
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]  # tokens whose KV the slot holds
        self.shared = [0] * num_slots  # leading tokens of ``tokens`` whose KV may be reused
        self.space: list[Namespace] = [""] * num_slots  # the namespace (adapter, salt) the slot's KV was computed under
        self._hashes: list[list[int]] = [[] for _ in range(num_slots)]
        self._index: dict[int, set[int]] = {}
        self.used = [0] * num_slots  # when each slot was last given out, reused or released: LRU order of free slots
        self._clock = 0
        self.pending: list[SlotOp] = []
        self.unsettled: dict[int, list[int]] = {}  # free slots whose tail is decode-written: the ids to prefill it from
        self.prefix_hits = 0
        self.prefix_hit_tokens = 0

    # ---- capacity -----------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        return -(-min(n_tokens, self.max_seq_len) // self.block_size)

    @property
    def occupied(self) -> int:
        return sum(o is not None for o in self.owner)

    @property
    def free_slots(self) -> int:
        return self.num_slots - self.occupied

    @property
    def reserved_blocks(self) -> int:
        return sum(self.reserved)

    @property
    def used_blocks(self) -> int:
        """Blocks that hold live KV of running requests."""
        return sum(self.blocks_for(len(t)) for o, t in zip(self.owner, self.tokens, strict=True) if o is not None)

    @property
    def held_tokens(self) -> int:
        """Positions whose KV the running requests' slots hold (the /metrics KV bytes in use)."""
        return sum(min(len(t), self.max_seq_len) for o, t in zip(self.owner, self.tokens, strict=True) if o is not None)

    def can_admit(self, n_tokens: int, freeing: Iterable[int] = ()) -> bool:
        """A free slot and enough unreserved blocks for ``n_tokens`` positions, once the slots in ``freeing``
        are released (preemption asks this before it evicts anyone, so it never evicts in vain)."""
        gone = set(freeing)
        slots = self.occupied - len(gone)
        blocks = self.reserved_blocks - sum(self.reserved[s] for s in gone)
        return slots < self.num_slots and blocks + self.blocks_for(n_tokens) <= self.total_blocks

    def fits_ever(self, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) <= self.total_blocks

    # ---- allocation ---------------------------------------------------------------------
    def allocate(self, owner: Any, tokens: list[int], reserve_tokens: int, max_reuse: int,
                 lowest: int = 0, namespace: Namespace = "", near: tuple[int, int] | None = None) -> tuple[int, int]:
        """Give ``owner`` a free slot (from ``lowest`` on when there is one): the one caching the longest prefix of
        ``tokens`` in ``namespace`` if it is free, else ``victim(lowest, near)``; returns (slot, positions reused)."""
        free = [i for i, o in enumerate(self.owner) if o is None]
        src, reuse = self.lookup(tokens, max_reuse, namespace) if self.prefix_cache else (-1, 0)
        if len(tokens) - reuse == 1 and len(tokens) > 1:
            reuse -= 1  # never leave a 1-token prefill: see ``single-token steps`` in the scheduler
        if reuse <= 0:
            src, reuse = -1, 0
        slot = src if reuse and src in free and src >= lowest else self.victim(lowest, near)
        if reuse:
            self._touch(src)  # a hit: the source's prefix is in use again
        self._touch(slot)
        self.owner[slot] = owner
        self.reserved[slot] = self.blocks_for(reserve_tokens)
        if self.space[slot] != namespace:
            self._set_tokens(slot, [])  # its hashes were chained from the old namespace
            self.space[slot] = namespace
        if reuse and src != slot:
            self.pending.append(SlotOp(SlotOpKind.COPY, src, slot, reuse))
            self._set_tokens(slot, self.tokens[src][:reuse])
        else:
            self._set_tokens(slot, self.tokens[slot][:reuse])
        if not reuse:
            self.pending.append(SlotOp(SlotOpKind.RESET, slot, slot))
        else:
            self.prefix_hits += 1
            self.prefix_hit_tokens += reuse
        return slot, reuse

    def victim(self, lowest: int = 0, near: tuple[int, int] | None = None, avoid: range = range(0)) -> int:
        """The free slot (from ``lowest`` on and outside ``avoid`` when there is one) whose cached KV is worth least:
        one holding no reusable block, else the least recently used. ``near``: the lowest and highest slot of the
        running requests, for a backend that decodes one range of slots; among slots worth the same kind, one within
        one slot of that span goes first: it joins the decode batch without a move (a move would overwrite a free slot
        there too, while the others still decode)."""
        free = [i for i, o in enumerate(self.owner) if o is None]
        pool = [i for i in free if i >= lowest and i not in avoid] or [i for i in free if i not in avoid] or free

        def key(i: int) -> tuple[int, bool, int]:
            held, used = self.worth(i)
            return held, near is not None and not near[0] - 1 <= i <= near[1] + 1, used

        return min(pool, key=key)

    def worth(self, slot: int) -> tuple[int, int]:
        """What overwriting ``slot``'s KV loses, for ordering: (holds a reusable block, last use); nothing without
        the prefix cache (then the lowest free slot is taken, as before)."""
        return (1, self.used[slot]) if self.prefix_cache and self._hashes[slot] else (0, 0)

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self.used[slot] = self._clock

    def free(self, slot: int) -> None:
        """Release ``slot``; its KV stays cached for prefix reuse until the slot is given out again."""
        self.owner[slot], self.reserved[slot] = None, 0
        self._touch(slot)

    def hand_over(self, slot: int, owner: Any, reserve_tokens: int, keep: int) -> None:
        """Give ``slot`` (free, or held by a prefill session or a request) to ``owner`` with its first ``keep``
        positions' KV: a session lending its KV to the completion that extends it, or keeping a finished one's."""
        self.owner[slot], self.reserved[slot] = owner, self.blocks_for(reserve_tokens)
        self.unsettled.pop(slot, None)
        self.truncate(slot, keep)
        self._touch(slot)

    def move(self, src: int, dst: int) -> None:
        """Move a request (its KV, reservation and ownership) from ``src`` to the free slot ``dst``."""
        assert self.owner[dst] is None and self.owner[src] is not None
        self.pending.append(SlotOp(SlotOpKind.COPY, src, dst, len(self.tokens[src])))
        self.owner[dst], self.reserved[dst] = self.owner[src], self.reserved[src]
        self.owner[src], self.reserved[src] = None, 0
        self.used[dst], self.used[src] = self.used[src], 0  # src keeps a copy of dst's KV: the first to overwrite
        self._set_tokens(dst, [])
        self.space[dst] = self.space[src]
        self._set_tokens(dst, list(self.tokens[src]), self.shared[src])  # src keeps its tokens: still cached

    def take_pending(self) -> list[SlotOp]:
        ops, self.pending = self.pending, []
        return ops

    # ---- a finished answer's KV --------------------------------------------------------------------
    def keep_answer(self, slot: int, ids: list[int]) -> None:
        """``slot``'s request has ended; ``ids``: its prompt and every generated token (the last one's KV was never
        written). Its decode-written tail is worth recomputing when two or more ids lie past the shared run."""
        toks = self.tokens[slot]
        if (self.prefix_cache and not self.space[slot] and len(ids) <= self.max_seq_len
                and len(ids) - self.shared[slot] >= 2 and ids[:len(toks)] == toks):
            self.unsettled[slot] = list(ids)

    def next_unsettled(self) -> int | None:
        """The free slot to settle next: the latest answer (the likeliest to be continued by a next turn)."""
        free = [s for s in self.unsettled if self.owner[s] is None]
        return max(free, key=lambda s: self.used[s]) if free else None

    def settled(self, slot: int, start: int, tokens: list[int]) -> None:
        """Prefill wrote ``tokens``' KV at ``start``.. of the free ``slot``: they join its shared run, if the slot
        still holds that answer (it was not given out meanwhile)."""
        ids = self.unsettled.get(slot)
        end = start + len(tokens)
        if ids is None or self.owner[slot] is not None or self.shared[slot] != start or ids[start:end] != tokens:
            return
        self._set_tokens(slot, ids[:max(end, len(self.tokens[slot]))], shared=end)
        if end < len(ids):
            self.unsettled[slot] = ids

    # ---- contents -------------------------------------------------------------------------
    def append(self, slot: int, new_tokens: list[int], shareable: bool = True) -> None:
        """Record that positions len(tokens).. now hold ``new_tokens``' KV. Only a slot's leading
        ``shareable`` run (KV written by multi-token prefill calls) is offered for prefix reuse."""
        toks = self.tokens[slot]
        self.unsettled.pop(slot, None)
        if shareable and self.shared[slot] == len(toks):
            self.shared[slot] += len(new_tokens)
        toks.extend(new_tokens)
        hs, bs = self._hashes[slot], self.block_size
        while (len(hs) + 1) * bs <= self.shared[slot]:
            i = len(hs)
            h = hash((hs[-1] if hs else _seed(self.space[slot]), *toks[i * bs:(i + 1) * bs]))
            hs.append(h)
            self._index.setdefault(h, set()).add(slot)

    def truncate(self, slot: int, length: int) -> None:
        if length < len(self.tokens[slot]):
            self._set_tokens(slot, self.tokens[slot][:length], min(self.shared[slot], length))

    def lookup(self, tokens: list[int], max_reuse: int, namespace: Namespace = "") -> tuple[int, int]:
        """(slot, length) of the longest cached full-block prefix of ``tokens`` in ``namespace``, capped at
        ``max_reuse``."""
        bs = self.block_size
        best_slot, best_len, h = -1, 0, _seed(namespace)
        for i in range(min(len(tokens), max_reuse) // bs):
            block = tokens[i * bs:(i + 1) * bs]
            h = hash((h, *block))
            cands = self._index.get(h)
            if not cands:
                break
            end = (i + 1) * bs
            good = [s for s in cands if self.tokens[s][:end] == tokens[:end]  # guard against hash collisions
                    and self.space[s] == namespace]
            if not good:
                break
            best_slot = min(good, key=lambda s: (self.owner[s] is not None, s))
            best_len = end
        if best_slot >= 0:  # extend past the last full block where the cached tokens still agree
            cached = self.tokens[best_slot]
            limit = min(self.shared[best_slot], len(tokens), max_reuse)
            while best_len < limit and cached[best_len] == tokens[best_len]:
                best_len += 1
        return best_slot, best_len

    def _set_tokens(self, slot: int, toks: list[int], shared: int | None = None) -> None:
        self.unsettled.pop(slot, None)  # its contents change: an answer noted for it no longer matches
        for h in self._hashes[slot]:
            s = self._index.get(h)
            if s is not None:
                s.discard(slot)
                if not s:
                    del self._index[h]
        self.tokens[slot], self._hashes[slot], self.shared[slot] = [], [], 0
        n = len(toks) if shared is None else shared
        self.append(slot, toks[:n], shareable=True)
        self.append(slot, toks[n:], shareable=False)


def _seed(namespace: Namespace) -> int:
    """Where a slot's hash chain starts: 0 for the base model unsalted (as before adapters), else its namespace
    (salting the first block's hash, as vLLM salts it: every later block's hash chains from it)."""
    return hash(("lora", namespace)) if namespace else 0
