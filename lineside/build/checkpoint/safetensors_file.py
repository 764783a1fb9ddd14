"""One ``.safetensors`` file read lazily: our own header parser plus ``np.memmap``.

We parse the header ourselves (instead of ``safetensors.safe_open``) so that every dtype a
checkpoint may hold — bf16, FP8 e4m3/e5m2, e8m0 scales — comes back as a numpy array via
ml_dtypes, and so that a truncated or malformed file fails with one line naming it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from lineside.errors import CheckpointError

# safetensors dtype string → numpy dtype (all little-endian, as the format specifies).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0")
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives inside its file (offsets are absolute file positions)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """Parses the header eagerly (a few KB) and maps tensor bytes only when asked."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tensors, self.metadata = _parse_header(self.path)
        self._mm: np.memmap | None = None

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def get_raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype: a read-only view into the memory map (no copy)."""
        t = self.tensors[name]
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        if t.end == t.begin:
            return np.zeros(t.shape, dtype=DTYPES[t.dtype])
        return self._mm[t.begin : t.end].view(DTYPES[t.dtype]).reshape(t.shape)

    def close(self) -> None:
        # Views handed out keep the mapping alive; we only drop our reference.
        self._mm = None


def _parse_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate the header against the file size; every failure is one line naming the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER:
                raise CheckpointError(f"{path}: malformed safetensors header (length {n}); re-download it")
            if 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated safetensors file (header needs {8 + n} bytes, file has {size}); re-download it"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8").rstrip(" \x00"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header ({e}); re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (not a JSON object); re-download it")
    base = 8 + n
    data_size = size - base
    meta = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    for name, ent in header.items():
        tensors[name] = _tensor_info(path, name, ent, base, data_size)
    return tensors, meta if isinstance(meta, dict) else {}


def _tensor_info(path: Path, name: str, ent: object, base: int, data_size: int) -> TensorInfo:
    try:
        dtype = ent["dtype"]  # type: ignore[index]
        shape = tuple(int(d) for d in ent["shape"])  # type: ignore[index]
        b, e = (int(x) for x in ent["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{path}: malformed safetensors header entry for tensor {name!r}") from None
    if dtype not in DTYPES:
        raise CheckpointError(
            f"{path}: tensor {name!r} has dtype {dtype!r}, which lineside cannot read "
            f"(supported: {', '.join(DTYPES)})"
        )
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if any(d < 0 for d in shape) or b < 0 or e < b or e - b != numel * DTYPES[dtype].itemsize:
        raise CheckpointError(
            f"{path}: malformed safetensors header: tensor {name!r} {dtype}{list(shape)} "
            f"does not fit its byte range [{b}, {e})"
        )
    if e > data_size:
        raise CheckpointError(
            f"{path}: truncated file: tensor {name!r} ends at byte {base + e} but the file has "
            f"{base + data_size} bytes; re-download it"
        )
    return TensorInfo(dtype=dtype, shape=shape, begin=base + b, end=base + e)
