"""The trt flavor uses only what TensorRT 10.3's ONNX parser accepts (checked against onnx-tensorrt's table)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("schedule,scheme", [("a", "fp32"), ("b", "w4a16")])
def test_trt_graph_passes_trt_10_3_op_check(v4, schedule, scheme):
    from trtedge.build.engine.check import check_onnx_file

    r = v4.runner(v4.hf_dir(schedule), "trt", scheme, 64)
    report = check_onnx_file(Path(r.sess._model_path), "10.3")
    assert not report.offenders, report.offenders
    assert report.op_counts["TopK"] >= 1 and report.op_counts["ScatterND"] >= 1  # indexer + compressed-state writes
    assert "NonZero" not in report.op_counts  # dense masked experts: no data-dependent shapes on TensorRT


def test_cpu_moe_gathers_tokens_per_expert(v4):
    """cpu flavor: each expert runs only on its routed tokens (NonZero → Gather → ScatterND add)."""
    import onnx

    r = v4.runner(v4.hf_dir("a"), "cpu")
    m = onnx.load(r.sess._model_path, load_external_data=False)
    cfg = v4.model("a").config
    n = sum(1 for x in m.graph.node if x.op_type == "NonZero")
    assert n == cfg.num_hidden_layers * cfg.n_routed_experts
