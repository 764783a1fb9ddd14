"""DeepSeek-V4's multi-token-prediction module as proposer (`--speculative mtp`): the bundle's MTP graph
(build/models/deepseek_v4/mtp.py has the formula and its sources) proposes k tokens per row.

At position p the MTP reads the target's last-layer streams h_p and the token t[p+1], and predicts t[p+2].
The target's graph hands out h for every position it computes; a tap on the target backend keeps the last
``window + 18`` of them per slot (``HiddenRing``), moved and reset with the target's slots. For a row t_0..t_n
(t_n sampled, not yet in the target's KV) the MTP first catches up — positions the target computed since the
MTP last ran, with their true h — and its logits at n-1 give the first draft; each further draft feeds the
MTP's own output streams as the h it has not got (vLLM's recursion past num_nextn_predict_layers).

Its state lives in its own backend, one slot per target slot: the block's sliding window, a whole-state
tensor. It is saved after the catch-up and restored after the drafts, so it only ever holds true positions;
the proposer remembers which tokens each slot's state covers and, as the draft-model proposer does, feeds only
what comes after them. A key in that window depends on its own position's input alone (K = V is a projection
of it), so starting over needs the last ``window`` positions only, never the whole text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lineside.runtime.backend import StepBatch
from lineside.runtime.speculative.config import MAX_SPEC_TOKENS, Draft, DraftRow

if TYPE_CHECKING:
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

HIDDEN = "hidden_streams"  # the main graph's output the MTP graph reads (build/models/deepseek_v4/mtp.py)
MTP_HIDDEN = "mtp_hidden"  # the MTP graph's own output streams at its logits positions


class HiddenRing:
    """The target's last-layer streams [N, D] of each slot's last ``cap`` positions, by position."""

    def __init__(self, num_slots: int, cap: int, shape: tuple[int, ...]) -> None:
        self.cap = int(cap)
        self.data = np.zeros((num_slots, self.cap, *shape), np.float32)
        self.pos = np.full((num_slots, self.cap), -1, np.int64)  # which position each entry holds (-1: none)

    def put(self, slot: int, start: int, rows: np.ndarray) -> None:
        keep = rows[-self.cap:]
        p = np.arange(start + len(rows) - len(keep), start + len(rows), dtype=np.int64)
        self.data[slot, p % self.cap] = keep
        self.pos[slot, p % self.cap] = p

    def first_of_run(self, slot: int, end: int) -> int:
        """The smallest p0 with positions p0..end-1 all held (``end`` when end-1 is not)."""
        p = end
        while p > 0 and end - p < self.cap and self.pos[slot, (p - 1) % self.cap] == p - 1:
            p -= 1
        return p

    def rows(self, slot: int, start: int, end: int) -> np.ndarray:
        return self.data[slot, np.arange(start, end) % self.cap]

    def copy(self, src: int, dst: int, length: int) -> None:
        """dst takes src's entries for positions below ``length`` (a slot copy: a move, or a shared prefix)."""
        held = (self.pos[src] >= 0) & (self.pos[src] < length)
        rows, where = self.data[src, held], self.pos[src, held]  # copies (boolean indexing), so src may be dst
        self.pos[dst] = -1
        self.data[dst, held] = rows
        self.pos[dst, held] = where

    def reset(self, slot: int) -> None:
        self.pos[slot] = -1


class MtpProposer:
    """Proposes with the MTP graph on its own backend; a ``StepTap`` of the target backend."""

    cheap = False

    def __init__(self, target: OnnxRuntimeBackend, backend: OnnxRuntimeBackend, *, window: int,
                 hidden_shape: tuple[int, int], cost: float = 1.0) -> None:
        """``target``/``backend``: OnnxRuntimeBackends of the main graph and of the MTP graph (same slots);
        ``window``: the MTP block's sliding window; ``cost``: an MTP step in target decode steps."""
        self.target, self.backend = target, backend
        self.window, self.cost = int(window), float(cost)
        self.outputs = (HIDDEN,)
        self.ring = HiddenRing(target.num_slots, self.window + MAX_SPEC_TOKENS + 2, hidden_shape)
        self.fed: dict[int, list[int]] = {}  # tokens t_0..t_v: the slot's MTP state holds positions 0..v-1
        target.add_tap(self)

    # ---- StepTap: what the target computes and does to its slots ---------------------------------------------
    def on_forward(self, batch: StepBatch, values: dict[str, np.ndarray]) -> None:
        h = values[HIDDEN]
        for r, slot in enumerate(batch.slots):
            self.ring.put(slot, int(batch.past_lengths[r]), h[r, :int(batch.new_lengths[r])])

    def on_copy(self, src: int, dst: int, length: int) -> None:
        self.ring.copy(src, dst, length)
        fed = self.fed.get(src)
        if fed is not None and len(fed) - 1 <= length:  # its state covers only positions dst now has
            self.backend.copy_slot(src, dst, length)
            self.fed[dst] = list(fed)
        else:
            self.fed.pop(dst, None)

    def on_reset(self, slot: int) -> None:
        self.ring.reset(slot)
        self.fed.pop(slot, None)

    # ---- ModelProposer ------------------------------------------------------------------------------------------
    def propose_rows(self, rows: list[DraftRow]) -> list[Draft]:
        return [self._propose(r) for r in rows]

    def _propose(self, r: DraftRow) -> Draft:
        tokens, slot = list(r.tokens), r.slot
        n = len(tokens) - 1  # t_n is pending: the target has computed positions 0..n-1
        k = min(r.k, self.backend.max_seq_len - len(tokens))
        have = self.ring.first_of_run(slot, n)
        if k <= 0 or n < 1 or have >= n:
            return Draft([])
        fed = self.fed.get(slot)
        start = len(fed) - 1 if fed and len(fed) <= n and tokens[:len(fed)] == fed else -1
        if start < have:  # start over: the last `window` positions make the state exactly
            start = max(have, n - self.window, 0)
            self.backend.reset_slot(slot)
        logits, streams = self._step(slot, tokens[start + 1:n + 1], self.ring.rows(slot, start, n), start)
        self.fed[slot] = tokens
        saved = self.backend.save_rows([slot]) if k > 1 else None
        out: list[int] = []
        probs: list[np.ndarray] = []
        hist = list(tokens)
        for i in range(k):
            d = r.sampler.distribution(logits, hist, r.prompt_len)
            if isinstance(d, int):
                tok = d
            else:
                tok = int(r.sampler.rng.choice(d.shape[0], p=d))
                probs.append(d)
            out.append(tok)
            hist.append(tok)
            if i + 1 < k:  # position n + i: the drafted token, the MTP's own streams standing in for h
                logits, streams = self._step(slot, [tok], streams, n + i)
        if saved is not None:
            self.backend.restore_rows(saved, slot)
        return Draft(out, probs or None)

    def _step(self, slot: int, ids: list[int], hidden: np.ndarray, past: int) -> tuple[np.ndarray, np.ndarray]:
        """Feed positions past.. with (next token, streams); the logits and streams of the last one."""
        n = len(ids)
        batch = StepBatch(slots=[slot], input_ids=np.asarray(ids, np.int64).reshape(1, n),
                          past_lengths=np.array([past], np.int64), new_lengths=np.array([n], np.int64),
                          logits_positions=np.array([[n - 1]], np.int64),
                          extra_inputs={HIDDEN: np.asarray(hidden, np.float32).reshape(1, n, *hidden.shape[-2:])})
        logits, outs = self.backend.forward_outputs(batch, (MTP_HIDDEN,))
        return logits[0, 0], outs[MTP_HIDDEN][0]

    def close(self) -> None:
        if self in self.target.taps:
            self.target.taps.remove(self)
        self.backend.close()
