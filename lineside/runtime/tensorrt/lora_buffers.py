"""The LoRA graph's extra engine I/O on TensorRT: the stacked adapter tensors (fixed shapes, uploaded when an
adapter is loaded) and the per-row ``lora_slots`` (an input like ``input_ids``). Pure data: tested on CPU."""

from __future__ import annotations

import numpy as np

from lineside.config import ModelConfig
from lineside.lora import LORA_SLOTS_INPUT, LoraTarget, cols_input, lora_sites
from lineside.runtime.tensorrt.buffers import BufferPlan, BufferSpec


def lora_input_shapes(cfg: ModelConfig, targets: tuple[LoraTarget, ...], max_loras: int,
                      max_rank: int) -> dict[str, tuple[int, ...]]:
    """Every stacked input of the LoRA graph with its shape for ``max_loras`` slots of ``max_rank`` (the padded
    layout runtime/lora_stack.py fills for TensorRT)."""
    shapes: dict[str, tuple[int, ...]] = {}
    k = max_loras * max_rank  # padded: every slot at max_rank, whatever is loaded (fixed shapes)
    for s in lora_sites(cfg, targets):
        shapes[s.a_input] = (len(s.parts) * k, s.in_features)
        shapes.update({b: (w, k) for b, w in zip(s.b_inputs, s.part_widths, strict=True)})
        shapes[cols_input(len(s.parts))] = (len(s.parts) * k,)
    return shapes


def add_lora_buffers(plan: BufferPlan, arrays: dict[str, np.ndarray], num_slots: int) -> None:
    """The adapters' device copies (role ``weight``) and the rows' slot ids (role ``input``, staged per step)."""
    plan.add(BufferSpec(LORA_SLOTS_INPUT, "input", np.dtype(np.int64), (num_slots,)))
    for name, arr in arrays.items():
        plan.add(BufferSpec(name, "weight", arr.dtype, tuple(arr.shape)))
