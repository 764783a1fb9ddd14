"""A 4-bit GGUF keeps its own grid in the cpu flavor: equal to the dequantized float reference."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

IDS = [1, 504, 3458, 314, 260, 1345, 282, 4649, 30, 2, 216, 33, 30, 216, 34, 17]


@pytest.fixture(scope="module")
def bundles(smol_level0_bundle, smol_bundles):
    """The carried W4A16 build (fp32 activations, the suite's shared one) and a float32 build of the same GGUF."""
    return open_bundle(smol_level0_bundle), open_bundle(smol_bundles(quant="fp32", max_seq_len=64))


def test_carried_grid_equals_dequantized_reference(bundles):
    carry, ref = bundles
    q = carry.manifest.quantization["carried_from_source"]
    assert len(q) == 30 * 7 + 1 and set(q.values()) == {"Q4_1", "Q8_0"}
    a = compute_logits(OnnxRuntimeBackend(carry), IDS, "decode")
    b = compute_logits(OnnxRuntimeBackend(ref), IDS, "prefill")
    err = np.abs(a - b).max() / np.abs(b).max()
    assert err < 1e-4, err
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_carried_graph_has_no_float_zero_points(bundles):
    import onnx

    carry, _ = bundles
    m = onnx.load(str(carry.file("graphs/cpu/model.onnx")), load_external_data=False)
    nbits = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) >= 30 * 4  # qkv, o, gate_up, down per layer (q/k/v and gate/up fused)
    assert all(len(n.input) < 4 or n.input[3] == "" for n in nbits), "MatMulNBits with zero points"
    assert json.loads((carry.path / "manifest.json").read_text())["quantization"]["scheme"] == "w4a16"
