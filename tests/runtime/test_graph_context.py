"""A manifest max_seq_len raised by hand past the graph's rotary tables is refused when the graph is loaded, in
one line saying what the graph holds and how to fix it (it reached onnxruntime's GroupQueryAttention only when a
request ran past the tables: "cos_cache dimension 0 shall not be less than total_sequence_length")."""

from __future__ import annotations

import json
import shutil

import pytest

from lineside.bundle import open_bundle
from lineside.errors import BundleError
from lineside.runtime.generate import Generator
from lineside.runtime.graph_context import rope_positions
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from tests.cli.cli_run import assert_one_line_error, run_cli


def raised(bundle, tmp_path, max_seq_len: int):
    d = shutil.copytree(bundle, tmp_path / f"raised-{max_seq_len}")
    manifest = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**manifest, "max_seq_len": max_seq_len}))
    return d


@pytest.mark.parametrize("to,fix", [
    (64, "rebuild the bundle with --max-seq-len 64"),
    (512, "rebuild the bundle with --max-seq-len 256 (the model's context limit, 256)"),
])
def test_a_raised_max_seq_len_is_refused_at_load_in_one_line(tiny_bundles, tmp_path, to, fix):
    """Built for 32 positions (the model is made for 256): more than 32 is refused; a rebuild can give at most
    the model's context."""
    b = open_bundle(raised(tiny_bundles(max_seq_len=32), tmp_path, to))
    assert rope_positions(b.file(b.flavor("cpu").graph)) == 32
    with pytest.raises(BundleError) as e:
        OnnxRuntimeBackend(b, num_slots=1, threads=1)
    msg = str(e.value)
    assert "\n" not in msg and f"max_seq_len is {to}" in msg and "rotary tables for 32 positions" in msg
    assert "set max_seq_len to at most 32 in manifest.json" in msg and msg.endswith(fix)


def test_a_backend_asked_for_no_more_than_the_tables_hold_still_loads(tiny_bundles, tmp_path):
    b = open_bundle(raised(tiny_bundles(max_seq_len=32), tmp_path, 64))
    be = OnnxRuntimeBackend(b, num_slots=1, threads=1, max_seq_len=32)
    assert be.max_seq_len == 32
    be.close()
    assert rope_positions(open_bundle(tiny_bundles(max_seq_len=32)).file("graphs/cpu/model.onnx")) == 32


def test_the_cli_says_it_in_one_line(tiny_bundle, tmp_path):
    d = raised(tiny_bundle, tmp_path, 512)
    with pytest.raises(BundleError, match="rotary tables for 256 positions"):
        Generator(d)
    proc = run_cli("generate", d, "--prompt", "ab" * 200, "--max-tokens", "2", "--backend", "onnxruntime")
    assert_one_line_error(proc, "max_seq_len is 512", "holds rotary tables for 256 positions", "manifest.json")


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _message_field(number: int, body: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def _packed_tensor(name: str, dims: list[int]) -> bytes:
    """A TensorProto with its dims written packed (proto2 writers may; onnx's own writes one varint each)."""
    return _message_field(1, b"".join(_varint(d) for d in dims)) + b"\x10\x01" + _message_field(8, name.encode())


def test_rope_positions_reads_what_onnx_reads(tiny_bundles, tmp_path):
    """The wire-format reader (no onnx import on serve's path to ready) against onnx's own parse: the built graph,
    the same graph with its weights inline, and tables whose dims are packed."""
    import onnx
    from onnx import helper, numpy_helper

    path = open_bundle(tiny_bundles(max_seq_len=32)).file("graphs/cpu/model.onnx")
    model = onnx.load(str(path))  # weights inline now
    want = min(int(t.dims[0]) for t in model.graph.initializer if t.name in ("rope_cos", "rope_sin"))
    inline = tmp_path / "inline.onnx"
    inline.write_bytes(model.SerializeToString())
    assert rope_positions(path) == rope_positions(inline) == want == 32

    import numpy as np
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
                          initializer=[numpy_helper.from_array(np.zeros((300, 4), np.float32), "other")])
    plain = helper.make_model(g).SerializeToString()
    assert rope_positions(_write(tmp_path / "none.onnx", plain)) is None  # no tables (DeepSeek-V4 computes its angles)
    # append a packed-dims rope_cos initializer to the graph message (protobuf merges a repeated field's entries)
    extra = _message_field(7, _message_field(5, _packed_tensor("rope_cos", [777, 8])))  # graph, initializer
    path2 = _write(tmp_path / "packed.onnx", plain + extra)
    parsed = onnx.load(str(path2))
    assert [list(t.dims) for t in parsed.graph.initializer if t.name == "rope_cos"] == [[777, 8]]
    assert rope_positions(path2) == 777


def test_a_truncated_graph_file_is_one_line(tiny_bundles, tmp_path):
    data = open_bundle(tiny_bundles(max_seq_len=32)).file("graphs/cpu/model.onnx").read_bytes()
    with pytest.raises(BundleError) as e:
        rope_positions(_write(tmp_path / "cut.onnx", data[: len(data) // 2 + 1]))
    assert "\n" not in str(e.value)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path
