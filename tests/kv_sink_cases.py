"""The step around int4's 4 fp16 sink entries that the KV tests run on every backend: three rows, slot 0 decoding
at position 2, slot 1 prefilling 6 tokens from 0, slot 2 decoding at 9 (slots 0 and 2 prefilled before by
``prime_sink_boundary``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lineside.runtime.backend import StepBatch

POSITIONS = (2, 5, 9)  # each row's logits position in the whole sequence


def prime_sink_boundary(backend: Any, ids: list[int]) -> None:
    backend.forward(StepBatch.single(0, ids[:2], 0))
    backend.forward(StepBatch.single(2, ids[:9], 0))


def sink_boundary_batch(ids: list[int]) -> StepBatch:
    tokens = np.zeros((3, 6), np.int64)
    tokens[0, 0], tokens[1], tokens[2, 0] = ids[2], ids[:6], ids[9]
    return StepBatch(slots=[0, 1, 2], input_ids=tokens, past_lengths=np.array([2, 0, 9]),
                     new_lengths=np.array([1, 6, 1]), logits_positions=np.array([[0], [5], [0]]))
