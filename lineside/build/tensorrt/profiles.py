"""TensorRT optimization profiles derived from a bundle: a decode profile and a prefill profile.

Max batch = the backend's slot count; decode feeds one token per row — or, for speculative verification, up
to ``max_verify`` = 1 + the most proposed tokens (the pending token and its drafts), with logits at each,
so verification steps run (and are captured in CUDA Graphs) on the decode profile; prefill up to ``max_prefill`` tokens;
``past_seq`` spans the runtime's length buckets (first bucket .. max_seq_len). Pure data: tested on CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lineside.bundle import FlavorEntry
from lineside.config import ModelConfig
from lineside.errors import LinesideError
from lineside.graph_io import StateTensor, StateUpdate
from lineside.runtime.speculative.config import MAX_SPEC_TOKENS
from lineside.runtime.tensorrt.buffers import state_dims

LOGITS_BUDGET = 256 << 20  # bytes for the float32 logits buffer [batch, n_logits, vocab]
DEFAULT_PREFILL = 512
FIRST_BUCKET = 64
BUCKET_STEP = 512

Dims = tuple[int, ...]


@dataclass
class Limits:
    max_batch: int
    max_seq: int
    max_prefill: int
    max_logits: int
    first_bucket: int = FIRST_BUCKET
    bucket_step: int = BUCKET_STEP
    max_verify: int = 1  # tokens per row the decode profile takes (1 + speculative drafts)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class ProfileSpec:
    name: str
    shapes: dict[str, tuple[Dims, Dims, Dims]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shapes": {k: [list(d) for d in v] for k, v in self.shapes.items()}}


def derive_limits(max_seq: int, vocab: int, num_slots: int, max_prefill: int | None = None,
                  max_logits: int | None = None, first_bucket: int = FIRST_BUCKET,
                  bucket_step: int = BUCKET_STEP) -> Limits:
    """Batch, prefill and logits limits; the logits buffer is kept under LOGITS_BUDGET."""
    if num_slots < 1:
        raise LinesideError(f"--slots must be at least 1 (got {num_slots})")
    mp = min(max_seq, max_prefill or DEFAULT_PREFILL)
    if mp < 1:
        raise LinesideError(f"--max-prefill must be at least 1 (got {max_prefill})")
    budget = max(1, LOGITS_BUDGET // (num_slots * vocab * 4))
    ml = min(mp, max_logits or budget)
    if first_bucket < 1 or bucket_step < 1:
        raise LinesideError("length buckets must be at least 1 token")
    verify = max(1, min(1 + MAX_SPEC_TOKENS, mp, max(1, ml)))
    return Limits(num_slots, max_seq, mp, max(1, ml), min(first_bucket, max_seq), bucket_step, verify)


def _state_shape(st: StateTensor, dims: dict[str, int], b: int, p: int) -> Dims:
    out = []
    for d in st.shape:
        if d == "batch":
            out.append(b)
        elif d == "past_seq":
            out.append(p)
        elif isinstance(d, int):
            out.append(d)
        elif d in dims:
            out.append(int(dims[d]))
        else:
            raise LinesideError(f"state {st.input}: unknown dim {d!r} in {st.shape}; rebuild the bundle")
    return tuple(out)


def derive_profiles(flavor: FlavorEntry, cfg: ModelConfig, lim: Limits,
                    lora: dict[str, tuple[int, ...]] | None = None) -> list[ProfileSpec]:
    """[decode, prefill] profiles for the trt graph's inputs (names from the manifest's flavor entry); ``lora``:
    the LoRA graph's stacked adapter tensors and their (fixed) shapes, beside the per-row ``lora_slots``."""
    inputs, states = list(flavor.inputs), list(flavor.state)
    dims = state_dims(cfg) | {"max_seq": lim.max_seq}
    b_opt = min(lim.max_batch, 4)
    p_min, p_max = lim.first_bucket, lim.max_seq
    p_opt = min(p_max, max(p_min, 512))
    out = []
    v = lim.max_verify
    for name, s_rng, k_rng in (("decode", (1, 1, v), (1, 1, v)),
                               ("prefill", (1, min(128, lim.max_prefill), lim.max_prefill),
                                (1, 1, lim.max_logits))):
        spec = ProfileSpec(name)
        bs = (1, b_opt, lim.max_batch)
        ps = (p_min, p_opt, p_max)
        state_inputs = {st.input for st in states}
        for inp in inputs:
            if inp in state_inputs:
                continue
            if inp in ("input_ids", "position_ids"):
                spec.shapes[inp] = tuple((bs[i], s_rng[i]) for i in range(3))  # type: ignore[assignment]
            elif inp == "attention_mask":
                spec.shapes[inp] = tuple((bs[i], ps[i] + s_rng[i]) for i in range(3))  # type: ignore[assignment]
            elif inp == "past_lengths":
                spec.shapes[inp] = tuple((bs[i],) for i in range(3))  # type: ignore[assignment]
            elif inp == "logits_positions":
                spec.shapes[inp] = tuple((bs[i], k_rng[i]) for i in range(3))  # type: ignore[assignment]
            else:
                raise LinesideError(f"trt graph input {inp!r} is not one the TensorRT backend feeds; "
                                   "rebuild the bundle with this lineside")
        for st in states:
            if st.update == StateUpdate.APPEND:
                spec.shapes[st.input] = tuple(_state_shape(st, dims, bs[i], ps[i]) for i in range(3))  # type: ignore[assignment]
            else:
                spec.shapes[st.input] = tuple(_state_shape(st, dims, bs[i], p_max) for i in range(3))  # type: ignore[assignment]
        if lora is not None:
            spec.shapes["lora_slots"] = tuple((bs[i],) for i in range(3))  # type: ignore[assignment]
            for name, shape in lora.items():
                spec.shapes[name] = (shape, shape, shape)
        out.append(spec)
    return out
