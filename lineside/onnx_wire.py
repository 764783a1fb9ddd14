"""Reading an ONNX file's protobuf wire format directly, for the few facts the runtime needs of a graph (its rotary
tables' rows, its initializers' bytes): importing onnx costs ~0.65 s, which `serve` would pay on its path to ready.
The weights stay in their external-data file either way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lineside.errors import BundleError

TRUNCATED = "a graph file ends inside a field: it is truncated; rebuild or re-copy the bundle"


def initializers(model: bytes) -> list[bytes]:
    """The TensorProto messages of ModelProto.graph.initializer (a message given twice is merged: concatenated)."""
    return fields(b"".join(fields(model, 7)), 5)


def initializer_bytes(graph: Path) -> int:
    """Bytes of the graph's initializers: an external one's ``length``, an embedded one's raw_data."""
    total = 0
    for tensor in initializers(graph.read_bytes()):
        external = {}
        raw = 0
        for number, wire, value in walk(tensor):
            if number == 13 and wire == 2:  # TensorProto.external_data: StringStringEntryProto key=1, value=2
                entry = {n: v for n, w, v in walk(value) if w == 2}
                external[entry.get(1, b"").decode()] = entry.get(2, b"").decode()
            elif number == 9 and wire == 2:  # TensorProto.raw_data
                raw += len(value)
        total += int(external.get("length", 0)) if external else raw
    return total


def fields(data: bytes, number: int) -> list[bytes]:
    """The length-delimited values of field ``number`` in one message."""
    return [v for n, w, v in walk(data) if n == number and w == 2]


def walk(data: bytes, packed: bool = False) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of a protobuf message (``packed``: bare varints)."""
    i, end = 0, len(data)
    while i < end:
        if packed:
            v, i = varint(data, i)
            yield 1, 0, v
            continue
        key, i = varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(data, i)
            yield number, wire, v
            continue
        if wire == 2:
            n, i = varint(data, i)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
        else:
            raise BundleError(f"a graph file this reader cannot parse (field {number}, wire type {wire}); rebuild "
                              "or re-copy the bundle")
        if i + n > end:
            raise BundleError(TRUNCATED)
        yield number, wire, data[i:i + n]
        i += n


def varint(data: bytes, i: int) -> tuple[int, int]:
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
