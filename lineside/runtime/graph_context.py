"""The positions a graph's rotary tables hold, checked against the context it is asked to serve.

A dense graph carries its cos/sin tables as initializers ``[max_seq, rotary_dim/2]`` (build/models/rope.py),
sized by the bundle's max_seq_len at build. The manifest is not checksummed, so a max_seq_len raised there by
hand reached the graph only when a long request ran (onnxruntime: "cos_cache dimension 0 shall not be less than
total_sequence_length"; TensorRT gathers past the table). It is refused when the graph is loaded instead.
DeepSeek-V4's graphs compute their angles from the positions and hold no table: nothing to check.
"""

from __future__ import annotations

from pathlib import Path

from lineside.errors import BundleError
from lineside.onnx_wire import initializers, walk

ROPE_TABLES = ("rope_cos", "rope_sin")  # the initializers build/models/dense.py names


def rope_positions(graph: Path) -> int | None:
    """The rows of the graph's rotary tables (the fewest, if they differ); None when it has none.

    Read from the ONNX file's protobuf wire format (ModelProto.graph → GraphProto.initializer → TensorProto
    dims/name) rather than with ``onnx.load``: importing onnx costs ~0.65 s, which `serve` would pay on its path to
    ready (13's cold start); the weights stay in their external-data file either way."""
    rows = []
    for tensor in initializers(graph.read_bytes()):
        name, dims = b"", []
        for number, wire, value in walk(tensor):
            if number == 8 and wire == 2:  # TensorProto.name
                name = value
            elif number == 1 and wire == 0:  # dims, one varint each (proto2's default)
                dims.append(value)
            elif number == 1 and wire == 2:  # dims packed
                dims.extend(v for _, _, v in walk(value, packed=True))
        if name.decode("utf-8", "replace") in ROPE_TABLES and dims:
            rows.append(int(dims[0]))
    return min(rows) if rows else None


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
