"""A lone row's verification step (a few new tokens) runs on a cached IOBinding like a decode step: its logits
and the cache it writes equal the generic path's, bit for bit, also when the binding is reused for another
step of the same shape and another slot's."""

from __future__ import annotations

import numpy as np

from lineside.bundle import open_bundle
from lineside.runtime.backend import StepBatch
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend


def test_cached_verify_binding_equals_the_generic_step(tiny_bundle):
    b = open_bundle(tiny_bundle)
    fast, generic = (OnnxRuntimeBackend(b, num_slots=3, threads=1) for _ in range(2))
    generic._decode_ready = False  # every step binds its inputs and the cache anew
    rng = np.random.default_rng(4)
    prompts = {slot: rng.integers(3, 259, n).tolist() for slot, n in ((0, 9), (2, 14))}
    for be in (fast, generic):
        for slot, p in prompts.items():
            be.forward(StepBatch.single(slot, p, 0))
    steps = [(2, [5, 6, 7, 8, 9]), (2, [10, 11, 12, 13, 14]), (0, [20, 21, 22, 23, 24]), (2, [30, 31])]
    pos = {slot: len(p) for slot, p in prompts.items()}
    for slot, toks in steps:
        batch = StepBatch.single(slot, toks, pos[slot], all_logits=True)
        got, want = fast.forward(batch), generic.forward(batch)
        np.testing.assert_array_equal(got, want)
        pos[slot] += len(toks)
    # (slot 2, 5 tokens) reused; (slot 0, 5) and (slot 2, 2) bound anew; the prefills (last logits only) not cached
    assert {key[:4] for key in fast._fast_verify} == {(2, 1, 5, 5), (0, 1, 5, 5), (2, 1, 2, 2)} and not generic._fast_verify
    for name, arr in fast.arena.items():
        np.testing.assert_array_equal(arr, generic.arena[name])
