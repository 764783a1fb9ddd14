"""The trt flavor uses only what TensorRT 10.3's ONNX parser accepts (checked against onnx-tensorrt's table)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("schedule,scheme", [("a", "fp32"), ("b", "w4a16")])
def test_trt_graph_passes_trt_10_3_op_check(v4, schedule, scheme):
    from lineside.build.tensorrt.check import check_onnx_file

    r = v4.runner(v4.hf_dir(schedule), "trt", scheme, 64)
    report = check_onnx_file(Path(r.sess._model_path), "10.3")
    assert not report.offenders, report.offenders
    assert report.op_counts["TopK"] >= 1 and report.op_counts["ScatterND"] >= 1  # indexer + compressed-state writes
    assert "NonZero" not in report.op_counts  # dense masked experts: no data-dependent shapes on TensorRT


def test_cpu_moe_runs_only_selected_experts(v4):
    """cpu flavor: each expert is an If taken only when routed to, and gathers just its tokens inside."""
    import onnx

    r = v4.runner(v4.hf_dir("a"), "cpu")
    m = onnx.load(r.sess._model_path, load_external_data=False)
    cfg = v4.model("a").config
    ifs = [x for x in m.graph.node if x.op_type == "If"]
    assert len(ifs) == cfg.num_hidden_layers * cfg.n_routed_experts
    for node in ifs:
        then = next(a.g for a in node.attribute if a.name == "then_branch")
        ops = [n.op_type for n in then.node]
        assert "NonZero" in ops and ops[-1] == "ScatterND"
        assert not any(n.op_type == "MatMul" for n in then.node if "experts" not in n.name)
