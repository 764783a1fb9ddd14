"""The positions a graph's rotary tables hold, checked against the context it is asked to serve.

A dense graph carries its cos/sin tables as initializers ``[max_seq, rotary_dim/2]`` (build/models/rope.py),
sized by the bundle's max_seq_len at build. The manifest is not checksummed, so a max_seq_len raised there by
hand reached the graph only when a long request ran (onnxruntime: "cos_cache dimension 0 shall not be less than
total_sequence_length"; TensorRT gathers past the table). It is refused when the graph is loaded instead.
DeepSeek-V4's graphs compute their angles from the positions and hold no table: nothing to check.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lineside.errors import BundleError

ROPE_TABLES = ("rope_cos", "rope_sin")  # the initializers build/models/dense.py names
TRUNCATED = "a graph file ends inside a field: it is truncated; rebuild or re-copy the bundle"


def rope_positions(graph: Path) -> int | None:
    """The rows of the graph's rotary tables (the fewest, if they differ); None when it has none.

    Read from the ONNX file's protobuf wire format (ModelProto.graph → GraphProto.initializer → TensorProto
    dims/name) rather than with ``onnx.load``: importing onnx costs ~0.65 s, which `serve` would pay on its path to
    ready (13's cold start); the weights stay in their external-data file either way."""
    data = graph.read_bytes()
    rows = []
    graph_msg = b"".join(_fields(data, 7))  # ModelProto.graph (a message given twice is merged: concatenated)
    for tensor in _fields(graph_msg, 5):  # GraphProto.initializer
        name, dims = b"", []
        for number, wire, value in _walk(tensor):
            if number == 8 and wire == 2:  # TensorProto.name
                name = value
            elif number == 1 and wire == 0:  # dims, one varint each (proto2's default)
                dims.append(value)
            elif number == 1 and wire == 2:  # dims packed
                dims.extend(v for _, _, v in _walk(value, packed=True))
        if name.decode("utf-8", "replace") in ROPE_TABLES and dims:
            rows.append(int(dims[0]))
    return min(rows) if rows else None


def _fields(data: bytes, number: int) -> list[bytes]:
    """The length-delimited values of field ``number`` in one message."""
    return [v for n, w, v in _walk(data) if n == number and w == 2]


def _walk(data: bytes, packed: bool = False) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of a protobuf message (``packed``: bare varints)."""
    i, end = 0, len(data)
    while i < end:
        if packed:
            v, i = _varint(data, i)
            yield 1, 0, v
            continue
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(data, i)
            yield number, wire, v
            continue
        if wire == 2:
            n, i = _varint(data, i)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
        else:
            raise BundleError(f"a graph file this reader cannot parse (field {number}, wire type {wire}); rebuild "
                              "or re-copy the bundle")
        if i + n > end:
            raise BundleError(TRUNCATED)
        yield number, wire, data[i:i + n]
        i += n


def _varint(data: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(data):
            raise BundleError(TRUNCATED)
        b = data[i]
        v |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return v, i
        shift += 7


def check_rope_positions(graph: Path, rel: str, max_seq_len: int, context_limit: int | None = None) -> None:
    """One line when ``max_seq_len`` positions would run past the graph ``rel``'s rotary tables; ``context_limit``:
    the model's (ModelConfig.context_limit), the most a rebuild can give."""
    held = rope_positions(graph)
    if held is None or max_seq_len <= held:
        return
    rebuild = max_seq_len if context_limit is None else min(max_seq_len, context_limit)
    why = "" if rebuild == max_seq_len else f" (the model's context limit, {context_limit})"
    fix = f", or rebuild the bundle with --max-seq-len {rebuild}{why}" if rebuild > held else ""
    raise BundleError(f"the bundle's max_seq_len is {max_seq_len} but its graph {rel} holds rotary tables for "
                      f"{held} positions; set max_seq_len to at most {held} in manifest.json{fix}")
