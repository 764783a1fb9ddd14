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
