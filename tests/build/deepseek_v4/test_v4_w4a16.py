"""W4A16 V4 graphs: every large linear (all experts included) is INT4, and the numbers are the RTN model's."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from tests.build.deepseek_v4.helpers import fake_quant_model, reference, rel_err


def _ops(runner) -> Counter:
    """Op counts of the decoder layers' nodes (the LM head is emit_lm_head's business)."""
    m = onnx.load(runner.sess._model_path, load_external_data=False)
    out: Counter = Counter()

    def walk(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            if n.name.startswith("layers."):
                out[n.op_type] += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)

    walk(m.graph)
    return out


def _n_linears(cfg) -> int:
    """Large linears per model: attention, compressors, indexer, grouped output, shared + routed experts."""
    n = 0
    for t in cfg.layer_types:
        n += 3 + cfg.o_groups + 1  # q_a, q_b, kv, o_a groups, o_b
        n += {"sliding_attention": 0, "heavily_compressed_attention": 2, "compressed_sparse_attention": 5}[t]
        n += 3 * (cfg.n_routed_experts + 1)
    return n


@pytest.mark.parametrize("schedule", ["a", "b", "c", "g"])  # c: 96 inputs, g: MoE width 40, ragged groups of 64
def test_w4a16_cpu_equals_rtn_reference(v4, schedule):
    """cpu flavor (MatMulNBits, accuracy level 0) = transformers with the same RTN-rounded weights."""
    ids, float_ref, _ = v4.ref(schedule)
    ref, gap = reference(fake_quant_model(schedule, 64, "cpu"), ids)
    assert gap > 1e-4
    r = v4.runner(v4.hf_dir(schedule), "cpu", "w4a16", 64)
    ops = _ops(r)
    assert ops["MatMulNBits"] == _n_linears(v4.model(schedule).config)
    pre, _ = r.prefill(ids)
    dec, _ = r.decode(ids)
    e_pre, e_dec, drift = rel_err(pre[0], ref), rel_err(dec, ref), rel_err(pre[0], float_ref)
    print(f"w4a16 cpu {schedule}: vs RTN reference prefill {e_pre:.2e} decode {e_dec:.2e}; vs float {drift:.2e}")
    assert e_pre < 1e-4 and e_dec < 1e-4
    assert drift < 1.5  # bounded: tiny random models route differently after 4-bit rounding


@pytest.mark.parametrize("schedule,trt_dtype", [("a", "fp32"), ("b", "fp32"), ("a", "fp16"), ("b", "fp16")])
def test_w4a16_trt(v4, schedule, trt_dtype):
    """trt flavor: INT4 DequantizeLinear (block 64) → MatMul equals the RTN model with the same scale dtype."""
    ids, _, _ = v4.ref(schedule)
    sdt = np.float16 if trt_dtype == "fp16" else np.float32
    ref, _ = reference(fake_quant_model(schedule, 64, "trt", sdt), ids)
    r = v4.runner(v4.hf_dir(schedule), "trt", "w4a16", 64, trt_dtype)
    m = onnx.load(r.sess._model_path, load_external_data=False)
    int4 = {t.name for t in m.graph.initializer if t.data_type == onnx.TensorProto.INT4}
    dq4 = [n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int4]
    assert len(dq4) == _n_linears(v4.model(schedule).config)
    assert not [n for n in m.graph.node if n.domain not in ("", "ai.onnx")]
    pre, _ = r.prefill(ids)
    dec, _ = r.decode(ids)
    e_pre, e_dec = rel_err(pre[0], ref), rel_err(dec, ref)
    print(f"w4a16 trt/{trt_dtype} {schedule}: vs RTN reference prefill {e_pre:.2e} decode {e_dec:.2e}")
    assert np.isfinite(pre).all() and np.isfinite(dec).all()
    tol = 1e-4 if trt_dtype == "fp32" else 1e-3  # fp16 scales; onnxruntime computes the MatMul in fp32 on CPU
    assert e_pre < tol and e_dec < tol


@pytest.mark.parametrize("schedule,flavor", [("a", "cpu"), ("g", "cpu"), ("g", "trt")])
def test_w8a16_equals_int8_rtn_reference(v4, schedule, flavor):
    """W8A16 (per-channel INT8) = transformers with the same rounded weights. g's MoE width 40 has no MatMulNBits
    block (16..128): its routed experts' down projections, inside the cpu flavor's If branches, were an INT8
    DequantizeLinear on an outer-scope weight, which onnxruntime's MatMulNBits fusion cannot load."""
    ids, _, _ = v4.ref(schedule)
    sdt = np.float16 if flavor == "trt" else np.float32
    ref, gap = reference(fake_quant_model(schedule, 64, flavor, sdt, bits=8), ids)
    assert gap > 1e-4
    r = v4.runner(v4.hf_dir(schedule), flavor, "w8a16", 64)
    pre, _ = r.prefill(ids)
    dec, _ = r.decode(ids)
    e_pre, e_dec = rel_err(pre[0], ref), rel_err(dec, ref)
    print(f"w8a16 {flavor} {schedule}: vs INT8 RTN reference prefill {e_pre:.2e} decode {e_dec:.2e}")
    tol = 1e-4 if flavor == "cpu" else 1e-3  # trt: fp16 scales and activations
    assert e_pre < tol and e_dec < tol
