"""The backend interface: what the runtime needs from onnxruntime or TensorRT.

A backend owns the model's decode state (the KV cache arena and any other state tensors)
as ``num_slots`` fixed slots; the scheduler maps requests to slots. One ``forward`` call
runs one step for a batch of slots and returns logits for the requested positions. Whether
the decode batch must sit in one range of slots is the backend's to say
(``needs_contiguous_slots``), so exactly one party ever moves a sequence between slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lineside.graph_io import StateUpdate


@dataclass
class StepBatch:
    """One model step. Rows are right-padded to ``input_ids.shape[1]``; ``new_lengths`` says how many are real.

    ``logits_positions[b]`` indexes row b's new tokens (0 .. new_lengths[b]-1) whose logits are wanted.
    """

    slots: list[int]
    input_ids: np.ndarray  # int64 [B, S]
    past_lengths: np.ndarray  # int64 [B]: tokens already in each slot's cache
    new_lengths: np.ndarray  # int64 [B]: real tokens in each row (≤ S)
    logits_positions: np.ndarray  # int64 [B, K]
    adapters: np.ndarray | None = None  # int64 [B]: each row's LoRA adapter slot (0 or None: the base model)
    # Inputs a graph takes beyond the control inputs, by name (the MTP graph's hidden_streams [B, S, N, D]).
    extra_inputs: dict[str, np.ndarray] | None = None
    # A prompt chunk (one row), even with logits at every position (a request scoring its prompt): it runs as any
    # prompt chunk does (onnxruntime's int8 prefill graph), so its KV is the one every other request's prompt gets.
    prompt: bool = False

    def adapter_rows(self) -> np.ndarray:
        """int64 [B] adapter slots, zeros when the step names none."""
        b = len(self.slots)
        return np.zeros(b, np.int64) if self.adapters is None else np.asarray(self.adapters, np.int64).reshape(b)

    @staticmethod
    def single(slot: int, token_ids: list[int] | np.ndarray, past_length: int, all_logits: bool = False,
               adapter: int = 0, prompt: bool = False) -> StepBatch:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, -1)
        n = ids.shape[1]
        pos = np.arange(n, dtype=np.int64) if all_logits else np.array([n - 1], dtype=np.int64)
        return StepBatch(
            slots=[slot],
            input_ids=ids,
            past_lengths=np.array([past_length], dtype=np.int64),
            new_lengths=np.array([n], dtype=np.int64),
            logits_positions=pos.reshape(1, -1),
            adapters=np.array([adapter], dtype=np.int64) if adapter else None,
            prompt=prompt,
        )


class Backend(Protocol):
    """Implemented by OnnxRuntimeBackend (CPU) and TensorRTBackend (GPU)."""

    name: str  # "onnxruntime" | "tensorrt"
    flavor: str  # which bundle graph it runs: "cpu" | "trt"
    num_slots: int
    max_seq_len: int
    vocab_size: int
    # True: a decode batch in slots k..k+B-1 runs without gathering the cache, so the scheduler keeps the
    # decoding sequences in slots 0..B-1 (it moves them with copy_slot). False: any slots work as well
    # (the backend places rows itself, as TensorRT's ArenaLayout does), and the scheduler moves nothing.
    needs_contiguous_slots: bool

    def forward(self, batch: StepBatch) -> np.ndarray:
        """Run one step; writes the new tokens' state into the slots; returns float32 logits [B, K, vocab]."""
        ...

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` into ``dst`` (prefix reuse)."""
        ...

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's state (a new request will start from position 0)."""
        ...

    def close(self) -> None:
        ...


class LoraBackend(Protocol):
    """A backend running a LoRA graph (``StepBatch.adapters`` picks each row's slot); its slots are written only
    between steps, from the engine's step thread."""

    max_loras: int
    max_lora_rank: int

    def load_adapter(self, slot: int, adapter: object) -> None:
        """Write a ``lineside.lora.LoraAdapter`` into slot 1..max_loras."""
        ...

    def unload_adapter(self, slot: int) -> None:
        ...


def has_whole_state(backend: Any) -> bool:
    """Whether the backend's decode state has whole-state tensors (mode replace: DeepSeek-V4's window and
    compressor state), which advance over every token a step feeds and cannot be cut back to a prefix."""
    return any(getattr(s, "update", None) == StateUpdate.REPLACE for s in getattr(backend, "states", []))
