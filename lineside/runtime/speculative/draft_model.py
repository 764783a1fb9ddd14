"""A draft model as proposer: a smaller model (``draft:BUNDLE``) or the target's own first layers
(``layerskip:N``) runs k cheap 1-token steps per row and proposes what it would generate.

Its KV lives in its own backend's slots, one per target slot. With its own KV, the proposer remembers
which tokens each slot holds and, before proposing, feeds only what differs from the row's text: the
tokens after the longest common prefix (a rejected draft's positions lie past it and are simply written
over — the same rule the target's KV follows). With ``shares_target_kv`` (layerskip: its layers are the
target's first N, with the very same weights) its cache *is* the target's cache for those layers, so it
never catches up: the target has written every accepted position, and the positions the draft writes
past them are overwritten by the verification step that follows. Whole-state tensors among those layers
(DeepSeek-V4's window and compressor state, replaced each step) are not positional: the draft's steps would
advance the target's own state, so they are saved before the draft runs and put back after it, whatever
happens — the target then verifies from exactly the state plain decoding would have.

A draft may have fewer embedding rows than the target (one tokenizer, padded differently: R1-Distill-Qwen-1.5B has
151936, -7B 152064): a target token past the draft's rows is fed to the draft as token 0 (its KV there is a
guess; the target's verification keeps the output exact), and the draft never proposes one.

Greedy rows take the draft's argmax; sampled rows draw from the draft's distribution q under the row's
own sampling settings and report q, for the speculative-sampling rule (verify.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lineside.runtime.backend import Backend, StepBatch, has_whole_state
from lineside.runtime.speculative.config import Draft, DraftRow


class DraftModelProposer:
    cheap = False

    def __init__(self, backend: Backend, target_vocab: int, *, shares_target_kv: bool = False,
                 max_prefill: int = 512, cost: float = 1.0):
        """``cost``: one draft step's time in target decode steps (the adaptive rule weighs it)."""
        self.backend = backend
        self.cost = float(cost)
        self.target_vocab = int(target_vocab)
        self.draft_vocab = int(getattr(backend, "vocab_size", 0) or target_vocab)
        self.shares_target_kv = shares_target_kv
        self.max_prefill = max(2, int(max_prefill))
        self.fed: dict[int, list[int]] = {}  # own KV: the tokens whose KV each draft slot holds, in order
        # the target's whole-state tensors this draft advances (shared with the target: put back after it runs)
        self.restores_state = shares_target_kv and has_whole_state(backend)

    def propose_rows(self, rows: list[DraftRow]) -> list[Draft]:
        if not self.restores_state:
            return self._propose(rows)
        slots = sorted({r.slot for r in rows if r.k > 0 and r.tokens})
        saved: dict[int, dict[str, Any]] = self.backend.save_rows(slots)  # type: ignore[attr-defined]
        try:
            return self._propose(rows)
        finally:
            for slot in slots:
                self.backend.restore_rows(saved, slot)  # type: ignore[attr-defined]

    def _propose(self, rows: list[DraftRow]) -> list[Draft]:
        out = [Draft([]) for _ in rows]
        live = []  # (index in rows, row) that propose this step
        for i, r in enumerate(rows):
            k = min(r.k, self.backend.max_seq_len - len(r.tokens))
            if k <= 0 or not r.tokens:
                continue
            r = DraftRow(r.slot, r.tokens, k, r.sampler, r.prompt_len)
            self._catch_up(r)
            live.append((i, r))
        if not live:
            return out
        hist = {i: list(r.tokens) for i, r in live}
        feed = {i: r.tokens[-1] for i, r in live}
        probs: dict[int, list[np.ndarray]] = {i: [] for i, _ in live}
        while live:
            ids = self._own(np.array([[feed[i]] for i, _ in live], dtype=np.int64))
            batch = StepBatch(slots=[r.slot for _, r in live], input_ids=ids,
                              past_lengths=np.array([len(hist[i]) - 1 for i, _ in live], dtype=np.int64),
                              new_lengths=np.ones(len(live), dtype=np.int64),
                              logits_positions=np.zeros((len(live), 1), dtype=np.int64))
            logits = self.backend.forward(batch)
            still = []
            for b, (i, r) in enumerate(live):
                tok, q = r.sampler.draw(self._target_logits(logits[b, 0]), hist[i], r.prompt_len)
                if q is not None:
                    probs[i].append(q)
                out[i].tokens.append(tok)
                hist[i].append(tok)
                feed[i] = tok
                if len(out[i].tokens) < r.k:
                    still.append((i, r))
            live = still
        for i, r in enumerate(rows):
            if out[i].tokens:
                if probs.get(i):
                    out[i].probs = probs[i]
                if not self.shares_target_kv:  # it fed the text and every draft but the last
                    self.fed[r.slot] = [*r.tokens, *out[i].tokens[:-1]]
        return out

    def _catch_up(self, r: DraftRow) -> None:
        """Own KV: feed the row's tokens the slot lacks, all but the last (the first proposing step feeds it)."""
        if self.shares_target_kv:
            return
        fed = self.fed.get(r.slot, [])
        n = min(len(fed), len(r.tokens) - 1)
        same = next((j for j in range(n) if fed[j] != r.tokens[j]), n)
        if same == 0:
            self.backend.reset_slot(r.slot)
        todo = r.tokens[same:-1]
        pos = same
        while todo:
            chunk, todo = todo[:self.max_prefill], todo[self.max_prefill:]
            self.backend.forward(StepBatch.single(r.slot, self._own(np.asarray(chunk, dtype=np.int64)), pos))
            pos += len(chunk)
        self.fed[r.slot] = list(r.tokens[:-1])

    def _own(self, ids: np.ndarray) -> np.ndarray:
        """The target's token ids as the draft's embedding takes them: past its rows, token 0."""
        return np.where(ids < self.draft_vocab, ids, 0) if self.draft_vocab < self.target_vocab else ids

    def _target_logits(self, x: np.ndarray) -> np.ndarray:
        """The draft's logits over the target's vocabulary: rows past the draft's own are impossible (-inf),
        the draft's padding rows past the target's are dropped."""
        v = self.target_vocab
        if x.shape[0] == v:
            return x
        out = np.full(v, -np.inf, dtype=np.float32)
        n = min(v, x.shape[0])
        out[:n] = x[:n]
        return out

    def close(self) -> None:
        self.backend.close()
