"""DeepSeek-V4 trt graph with --kv-dtype int8: window and compressed entries stored as uint8 + one fp16 scale per
entry, indexer keys and compressor buffers float32; logits within a bound of the float state, prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.build.tensorrt.check import check_model
from tests.build.deepseek_v4.helpers import rel_err


def test_prefill_state_is_the_float_state_on_the_int8_grid(v4):
    """Each stored entry is within half a grid step of the float state's entry (schedule b: every state kind)."""
    ids, _, _ = v4.ref("b")
    _, sf = v4.runner(v4.hf_dir("b"), "trt").prefill(ids)
    _, sq = v4.runner(v4.hf_dir("b"), "trt", kv_dtype="int8").prefill(ids)
    checked = 0
    for name, q in sq.items():
        if q.dtype != np.uint8:
            continue
        scale = sq[name.replace("past.", "past_scale.", 1)].astype(np.float32)
        deq = (q.astype(np.float32) - 128) * scale
        assert np.all(np.abs(deq - sf[name]) <= 0.5 * scale + 1e-6), name
        assert np.abs(q.astype(np.int32) - 128).max() == 127  # every non-empty state uses the whole grid
        checked += 1
    assert checked == 7  # schedule b: a window per layer and compressed entries in its compressed layers


@pytest.mark.parametrize("schedule", ["a"])
def test_int8_state_logits_near_float_state(v4, schedule):
    ids, ref, _ = v4.ref(schedule)
    f32 = v4.runner(v4.hf_dir(schedule), "trt")
    q8 = v4.runner(v4.hf_dir(schedule), "trt", kv_dtype="int8")
    pre_f, _ = f32.prefill(ids)
    pre_q, _ = q8.prefill(ids)
    dec_f, _ = f32.decode(ids)
    dec_q, st = q8.decode(ids)
    e_pre, e_dec, e_ref = rel_err(pre_q[0], pre_f[0]), rel_err(dec_q, dec_f), rel_err(dec_q, ref)
    print(f"V4 int8 state {schedule}: prefill {e_pre:.2e} / decode {e_dec:.2e} vs float state, decode vs "
          f"transformers {e_ref:.2e}")
    # one step reads its own new entries in float32, so a prefill from an empty state is exact; decode reads
    # every earlier entry from the int8 state. Measured 2.1% on a (schedule b: 17%): larger than the dense
    # models' 0.4% because these tiny random V4 models route their top-k experts differently after any
    # rounding (4-bit weights move them up to 150%: test_v4_w4a16), so b is checked on its state above
    assert e_pre < 1e-5 and 1e-6 < e_dec < 5e-2 and e_ref < 5e-2
    dtypes = {s.input: s.dtype for s in q8.entry.state}
    assert dtypes["past.0.window"] == "uint8" and dtypes["past_scale.0.window"] == "float16"
    kept = {k: v for k, v in dtypes.items() if k.endswith(("comp_kv", "comp_gate", "idx_kv", "idx_gate", "idx_keys"))}
    assert kept and set(kept.values()) == {"float32"}
    assert st["past.0.window"].dtype == np.uint8


def test_int8_state_graph_passes_trt_10_3_tables(v4):
    import onnx

    r = v4.runner(v4.hf_dir("a"), "trt", kv_dtype="int8")
    rep = check_model(onnx.load(r.sess._model_path, load_external_data=False), "10.3")
    assert not [o for o in rep.offenders if "past" in o.node or "present" in o.node or o.op in ("Cast", "Round")]
