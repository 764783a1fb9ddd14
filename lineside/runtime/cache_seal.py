"""A digest sealed into onnxruntime's cached graph, so a corrupted or misplaced cache is rebuilt instead of run.

The bundle's own files are checked against the manifest's sha256; the optimized-graph cache (ort_cache) is written
on the machine and holds some tensors inline (norm weights, scales), where a flipped bit or a bad copy still loads
and changes every answer. The seal is one more ``metadata_props`` entry appended to the serialized ModelProto
(protobuf takes a repeated field's entries anywhere), holding sha256 of the cache key and the bytes before it:
onnxruntime reads the file as before, and checking it needs no ``import onnx`` (~0.65 s on the path to ready).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ENTRY_KEY = b"lineside.cache_sha256"
_MODEL_METADATA_PROPS = (14 << 3) | 2  # ModelProto.metadata_props, length-delimited
_KEY, _VALUE = (1 << 3) | 2, (2 << 3) | 2  # StringStringEntryProto.key / .value


def _entry(body: bytes, key: str) -> bytes:
    digest = hashlib.sha256(key.encode() + b"\0" + body).hexdigest().encode()
    inner = bytes([_KEY, len(ENTRY_KEY)]) + ENTRY_KEY + bytes([_VALUE, len(digest)]) + digest
    return bytes([_MODEL_METADATA_PROPS, len(inner)]) + inner  # every length < 128: one-byte varints


TRAILER_LEN = len(_entry(b"", ""))


def seal(body: bytes, key: str) -> bytes:
    """``body`` (a serialized ModelProto) with its seal for ``key`` appended."""
    return body + _entry(body, key)


def sealed(data: bytes, key: str) -> bool:
    """Whether ``data`` ends with the seal of the bytes before it under ``key``: False for a changed, truncated or
    unsealed file (an older lineside's cache), and for a cache written under another key."""
    body = data[:-TRAILER_LEN]
    return len(data) > TRAILER_LEN and data[-TRAILER_LEN:] == _entry(body, key)


def seal_file(path: Path, key: str) -> None:
    """Append the seal to the model at ``path`` (a temporary file only this process writes)."""
    path.write_bytes(seal(path.read_bytes(), key))
