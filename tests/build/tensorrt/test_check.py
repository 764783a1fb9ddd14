"""`lineside check`: op/dtype support against onnx-tensorrt's tables for TensorRT 10.3 and the newest release."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lineside.build.tensorrt.check import check_bundle, check_model
from lineside.build.tensorrt.optable import load_table, parse_operators_md
from lineside.cli import main
from lineside.errors import LinesideError

SAMPLE = """
TensorRT 10.0 supports operators in the inclusive range of opset 9 to opset 20.
TensorRT supports the following ONNX data types: DOUBLE, FLOAT32, FLOAT16, INT32, and BOOL
| Operator | Supported | Supported Types | Restrictions |
|---|---|---|---|
| Add | Y | FP32, FP16, INT32 |
| Bernoulli | N |
| ConstantOfShape | Y | FP32, INF64 |
| ReduceSum | Y | FP32 | `axes` must be an initializer |
"""


def test_parse_operators_md():
    t = parse_operators_md(SAMPLE)
    assert (t["doc_version"], t["opset_min"], t["opset_max"]) == ("10.0", 9, 20)
    assert t["graph_types"] == ["DOUBLE", "FP32", "FP16", "INT32", "BOOL"]
    assert t["ops"]["Add"]["types"] == ["FP32", "FP16", "INT32"]
    assert not t["ops"]["Bernoulli"]["supported"]
    assert t["ops"]["ConstantOfShape"]["types"] == ["FP32", "INT64"] and t["fixes"]
    assert t["ops"]["ReduceSum"]["const_inputs"] == [{"input": "axes", "kind": "an initializer"}]


def test_stored_tables():
    old, new = load_table("10.3"), load_table("newest")
    assert new["trt_version"] == "10.15" and old["trt_version"] == "10.3"
    assert "INT4" in old["ops"]["DequantizeLinear"]["types"]
    assert "Attention" not in old["ops"] and new["ops"]["Attention"]["supported"]
    assert "const_inputs" not in old["ops"]["Slice"]  # lifted in 10.3 (changelog)
    with pytest.raises(LinesideError, match="no op-support table"):
        load_table("9.9")


@pytest.mark.parametrize("trt", ["10.3", "newest"])
def test_real_trt_graph_passes(trt_bundle, trt):
    rep = check_bundle(trt_bundle("fp16"), trt)
    assert rep.ok, rep.offenders
    assert rep.nodes > 50 and rep.op_counts["MatMul"] > 0


@pytest.mark.parametrize("trt", ["10.3", "newest"])
def test_w4a16_trt_graph_passes(trt_bundle, trt):
    rep = check_bundle(trt_bundle("w4a16"), trt)
    assert rep.op_counts["DequantizeLinear"] > 0
    assert rep.ok, rep.offenders


def test_int8_gather_is_rejected():
    """What the trt emitter once did for embeddings: TensorRT has no INT8 Gather (INT8 only behind DQ)."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])
    out = helper.make_tensor_value_info("emb", TensorProto.FLOAT, None)
    table = numpy_helper.from_array(np.zeros((10, 4), dtype=np.int8), "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["codes"], name="embed/gather_codes"),
             helper.make_node("Cast", ["codes"], ["emb"], name="embed/cast", to=TensorProto.FLOAT)]
    m = helper.make_model(helper.make_graph(nodes, "g", [ids], [out], [table]),
                          opset_imports=[helper.make_opsetid("", 21)])
    rep = check_model(m, "10.3")
    assert {o.node for o in rep.offenders} == {"embed/gather_codes", "embed/cast"}
    assert all(o.dtypes == "INT8" for o in rep.offenders)


def _bad_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128])
    d = helper.make_tensor_value_info("d", TensorProto.DOUBLE, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    z = helper.make_tensor_value_info("z", TensorProto.DOUBLE, [1, 4])
    w = numpy_helper.from_array(np.zeros((4, 128, 16), dtype=np.uint8), "w_nbits")
    sc = numpy_helper.from_array(np.ones((4, 4), dtype=np.float32), "w_scales")
    q = helper.make_tensor("q", TensorProto.UINT4, [128, 4], np.zeros(128 * 4 // 2, dtype=np.uint8).tobytes(), raw=True)
    qs = numpy_helper.from_array(np.ones((4, 4), dtype=np.float32), "q_scale")
    zp = helper.make_tensor("q_zp", TensorProto.UINT4, [4, 4], bytes([0x88] * 8), raw=True)
    nodes = [
        helper.make_node("MatMulNBits", ["x", "w_nbits", "w_scales"], ["y"], name="mlp/matmul_nbits",
                         domain="com.microsoft", K=128, N=4, bits=4, block_size=32),
        helper.make_node("Add", ["d", "d"], ["z"], name="double_add"),
        helper.make_node("DequantizeLinear", ["q", "q_scale", "q_zp"], ["deq"], name="uint4_dq", axis=0, block_size=32),
    ]
    g = helper.make_graph(nodes, "bad", [x, d], [y, z], [w, sc, q, qs, zp])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m


def test_rejects_contrib_ops_and_bad_dtypes():
    rep = check_model(_bad_model(), "10.3", graph_name="bad.onnx")
    by_node = {}
    for o in rep.offenders:
        by_node.setdefault(o.node, []).append(o)
    assert "com.microsoft" in by_node["mlp/matmul_nbits"][0].reason
    assert by_node["double_add"][0].dtypes == "DOUBLE"
    reasons = " ".join(o.reason for o in by_node["uint4_dq"])
    assert "UINT4" in reasons and "block_size 32" in reasons and "not zero" in reasons
    assert not rep.ok
    assert "4 of 3" not in rep.summary() and "would fail" in rep.summary()


def test_rejects_int4_shapes_tensorrt_cannot_pack():
    """INT4 [K, N] with N odd, or K not a whole number of blocks: onnx-tensorrt's DequantizeLinear refuses both."""
    def dq(name, k, n):
        raw = np.zeros((k * n + 1) // 2, dtype=np.uint8).tobytes()
        q = helper.make_tensor(f"{name}_q", TensorProto.INT4, [k, n], raw, raw=True)
        s = numpy_helper.from_array(np.ones((max(k // 64, 1), n), dtype=np.float16), f"{name}_s")
        node = helper.make_node("DequantizeLinear", [q.name, s.name], [f"{name}_w"], name=name, axis=0, block_size=64)
        return node, [q, s], helper.make_tensor_value_info(f"{name}_w", TensorProto.FLOAT16, [k, n])
    parts = [dq("odd_n", 128, 33), dq("ragged_k", 96, 32), dq("fine", 128, 32)]
    g = helper.make_graph([p[0] for p in parts], "int4", [], [p[2] for p in parts], [t for p in parts for t in p[1]])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    rep = check_model(m, "10.3", graph_name="int4.onnx")
    by_node = {o.node: o.reason for o in rep.offenders}
    assert "odd last dimension 33" in by_node["odd_n"]
    assert "96 along axis 0 is not a whole number of blocks of 64" in by_node["ragged_k"]
    assert "fine" not in by_node


def test_rejects_runtime_axes_and_unsupported_op():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    ax = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    r = helper.make_tensor_value_info("r", TensorProto.FLOAT, None)
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum_runtime_axes"),
             helper.make_node("Bernoulli", ["x"], ["r"], name="coin")]
    m = helper.make_model(helper.make_graph(nodes, "g", [x, ax], [y, r]), opset_imports=[helper.make_opsetid("", 21)])
    rep = check_model(m, "newest")
    names = {o.node: o.reason for o in rep.offenders}
    assert "must be an initializer" in names["sum_runtime_axes"]
    assert "not supported" in names["coin"]


def test_cli_check(tmp_path, trt_bundle, capsys):
    onnx.save(_bad_model(), str(tmp_path / "bad.onnx"))
    with pytest.raises(SystemExit) as e:
        main(["check", str(tmp_path / "bad.onnx"), "--trt", "10.3"])
    assert e.value.code == 1
    out = capsys.readouterr()
    assert "mlp/matmul_nbits" in out.out and "would fail" in out.err
    with pytest.raises(SystemExit) as e:
        main(["check", str(trt_bundle("fp16").path), "--trt", "newest"])
    assert e.value.code == 0
    assert "parse in TensorRT 10.15" in capsys.readouterr().out


def test_lora_graph_parses_in_trt_10_3(tiny_bundles):
    """`lineside check` checks the LoRA graph of a --max-lora-rank bundle too, and it parses in 10.3."""
    from lineside.build.tensorrt.check import check_bundle_graphs
    from lineside.bundle import open_bundle

    b = open_bundle(tiny_bundles(quant="w4a16", flavors=("trt",), max_seq_len=64, group_size=64, accuracy_level=0,
                                 max_lora_rank=8))
    reps = check_bundle_graphs(b, "10.3")
    assert [r.graph for r in reps] == ["model.onnx", "model.lora.onnx"]
    assert all(r.ok for r in reps), [r.summary() for r in reps]
    assert reps[1].op_counts["MatMul"] > reps[0].op_counts["MatMul"]


def test_cli_check_notes_stay_one_line_when_piped(trt_bundle, capsys, monkeypatch):
    """Piped or logged (not a terminal) rich wraps at 80 columns: each note and the summary must stay one line."""
    monkeypatch.setenv("COLUMNS", "60")
    with pytest.raises(SystemExit) as e:
        main(["check", str(trt_bundle("w4a16").path), "--trt", "10.3"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    note = [ln for ln in lines if ln.startswith("note: graph opset 21")]
    assert len(note) == 1 and note[0].endswith("which TensorRT parses since 10.0"), lines
    assert lines[-1].startswith("model.onnx: all ") and lines[-1].endswith("parse in TensorRT 10.3"), lines
