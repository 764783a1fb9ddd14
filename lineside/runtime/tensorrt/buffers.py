"""The TensorRT backend's device memory plan: every buffer's dtype, largest shape, size and offset.

All buffers come from one allocation, so their addresses are fixed for the backend's life — the
precondition for replaying captured CUDA Graphs. The plan is pure data (tested on CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lineside.config import ModelConfig
from lineside.errors import BundleError
from lineside.graph_io import PACKED_INT4, STORAGE_DTYPE, Dim, StateTensor, StateUpdate

ALIGN = 256  # cudaMalloc alignment; TensorRT wants ≥ 16-byte aligned I/O


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype a buffer of state/IO dtype ``name`` holds (a packed int4 state: its uint8 bytes)."""
    name = STORAGE_DTYPE.get(name, name)
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    try:
        return np.dtype(name)
    except TypeError:
        raise BundleError(f"state dtype {name!r} is not supported by the TensorRT backend; rebuild the bundle") from None


@dataclass
class BufferSpec:
    name: str
    role: str  # "input" | "output" | "arena" | "scratch" | "control"
    dtype: np.dtype
    shape: tuple[int, ...]  # largest shape
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize


@dataclass
class StateLayout:
    """One state tensor: its arena buffer and its output buffer, and how a row is laid out."""

    state: StateTensor
    update: StateUpdate
    outer: int  # product of dims between batch and the seq axis (append) — kv_heads for KV
    inner: int  # product of dims after the seq axis (head_dim); for replace: whole row
    dtype: np.dtype

    def row_bytes(self, pitch: int) -> int:
        if self.update == StateUpdate.APPEND:
            return self.outer * pitch * self.inner * self.dtype.itemsize
        return self.outer * self.inner * self.dtype.itemsize


@dataclass
class BufferPlan:
    buffers: dict[str, BufferSpec] = field(default_factory=dict)
    states: list[StateLayout] = field(default_factory=list)
    total: int = 0

    def add(self, spec: BufferSpec) -> BufferSpec:
        spec.offset = self.total
        self.total += -(-spec.nbytes // ALIGN) * ALIGN
        self.buffers[spec.name] = spec
        return spec

    def address(self, base: int, name: str) -> int:
        return base + self.buffers[name].offset


def state_dims(cfg: ModelConfig) -> dict[str, int]:
    """Named dims a manifest's state shapes may use besides batch/past_seq/seq/max_seq."""
    return {"kv_heads": cfg.num_kv_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "hidden": cfg.hidden_size, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads}


def _layout(st: StateTensor, dims: dict[str, int]) -> StateLayout:
    shape = list(st.shape)
    if not shape or shape[0] != "batch":
        raise BundleError(f"state {st.input}: first dim must be 'batch' (got {shape}); rebuild the bundle")
    def num(d: Dim) -> int:
        if isinstance(d, int):
            return d
        if d not in dims:
            raise BundleError(f"state {st.input}: unknown dim {d!r} in shape {shape}; rebuild the bundle")
        return int(dims[d])
    if st.update == StateUpdate.APPEND:
        ax = st.seq_axis if st.seq_axis >= 0 else len(shape) + st.seq_axis
        if not 0 < ax < len(shape) or shape[ax] != "past_seq":
            raise BundleError(f"state {st.input}: append state needs 'past_seq' at seq_axis {st.seq_axis} "
                              f"(shape {shape}); the TensorRT backend cannot run it")
        outer = math.prod(num(d) for d in shape[1:ax])
        inner = math.prod(num(d) for d in shape[ax + 1:])
        return StateLayout(st, StateUpdate.APPEND, outer, inner, np_dtype(st.dtype))
    if st.update.fixed:
        if "past_seq" in shape or "seq" in shape:
            raise BundleError(f"state {st.input}: a {st.update} state must have a fixed shape (got {shape})")
        return StateLayout(st, st.update, 1, math.prod(num(d) for d in shape[1:]), np_dtype(st.dtype))
    raise BundleError(f"state {st.input}: update '{st.update}' cannot run on TensorRT (only append/replace/prefix); "
                      "use the trt flavor")


def plan_buffers(states: list[StateTensor], cfg: ModelConfig, *, num_slots: int, max_seq: int, max_prefill: int,
                 max_logits: int, vocab: int, input_names: list[str]) -> BufferPlan:
    """Lay out every buffer the engine and the runtime touch, at its largest shape."""
    dims = state_dims(cfg) | {"max_seq": max_seq}
    plan = BufferPlan()
    b, s = num_slots, max_prefill
    i64 = np.dtype(np.int64)
    for name, shape in (("input_ids", (b, s)), ("position_ids", (b, s)), ("attention_mask", (b, max_seq + s)),
                        ("logits_positions", (b, max_logits)), ("past_lengths", (b,))):
        if name in input_names:
            plan.add(BufferSpec(name, "input", i64, shape))
    plan.add(BufferSpec("write_pos", "control", i64, (b,)))
    plan.add(BufferSpec("new_lengths", "control", i64, (b,)))
    plan.add(BufferSpec("logits", "output", np.dtype(np.float32), (b, max_logits, vocab)))
    scratch = 0
    for st in states:
        lay = _layout(st, dims)
        plan.states.append(lay)
        if lay.update == StateUpdate.APPEND:
            arena = (b, lay.outer, max_seq, lay.inner)
            out = (b, lay.outer, s, lay.inner)
        else:
            arena = out = (b, lay.inner)
        spec = plan.add(BufferSpec(st.input, "arena", lay.dtype, arena))
        plan.add(BufferSpec(st.output, "output", lay.dtype, out))
        scratch = max(scratch, spec.nbytes)
    plan.add(BufferSpec("scratch", "scratch", np.dtype(np.uint8), (scratch,)))
    return plan


def kv_dtype_of(states: list[StateTensor]) -> str:
    """The KV dtype a trt graph's states carry (``--kv-dtype`` of its build): int4, int8, fp8 or fp16 (float)."""
    dtypes = {s.dtype for s in states}
    if PACKED_INT4 in dtypes:
        return "int4"
    return "fp8" if "float8_e4m3fn" in dtypes else "int8" if "uint8" in dtypes else "fp16"  # int8 grid, +128


def check_kv_support(states: list[StateTensor], sm: str) -> None:
    """FP8 needs SM >= 8.9 (Ada, Hopper and newer); Orin (SM 8.7) has none: refuse in one line."""
    major, minor = (int(x) for x in sm.split(".")[:2])
    if kv_dtype_of(states) == "fp8" and (major, minor) < (8, 9):
        raise BundleError(f"this bundle's KV cache is fp8, which needs a GPU of SM >= 8.9 (this one is SM {sm}; "
                          "Orin is 8.7): rebuild the bundle with --kv-dtype int8")
