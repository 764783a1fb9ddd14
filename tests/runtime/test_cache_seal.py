"""The seal on onnxruntime's cached graph: valid protobuf that onnx reads as one more metadata entry, and broken by
any change, any cut and any other key."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from lineside.runtime.cache_seal import ENTRY_KEY, TRAILER_LEN, seal, sealed


def _model() -> bytes:
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph).SerializeToString()


def test_a_sealed_model_is_still_the_model():
    body = _model()
    model = onnx.load_from_string(seal(body, "k1"))
    assert [p.key for p in model.metadata_props] == [ENTRY_KEY.decode()]
    assert model.graph.node[0].op_type == "Identity"


def test_any_change_cut_or_other_key_breaks_the_seal():
    body = _model()
    data = seal(body, "k1")
    assert sealed(data, "k1")
    assert not sealed(data, "k2")
    assert not sealed(body, "k1")  # an older lineside's cache: no seal
    assert not sealed(data[:-1], "k1") and not sealed(data[:TRAILER_LEN], "k1") and not sealed(b"", "k1")
    for at in (0, len(body) // 2, len(body) - 1, len(data) - 1):
        assert not sealed(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:], "k1")
