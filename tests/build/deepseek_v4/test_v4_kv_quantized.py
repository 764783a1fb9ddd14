"""DeepSeek-V4 trt graph with --kv-dtype int8 / int4: window and compressed entries stored as uint8 (int4: two
per byte) + fp16 scales, indexer keys and compressor buffers float32; logits within a bound of the float state,
prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.build.tensorrt.check import check_model
from tests.build.deepseek_v4.helpers import rel_err


def dequantized(q: np.ndarray, scale: np.ndarray, kv: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid values, dequantized entries, grid step per entry) of a stored state. int8: symmetric, grid − 128;
    int4: low nibble channel c, high nibble c + d/2, asymmetric 0..15, (scale, minimum) pairs per group."""
    if kv == "int8":
        grid = q.astype(np.int32) - 128
        s, lo = scale.astype(np.float32), np.zeros(scale.shape, np.float32)
    else:
        grid = np.concatenate([q & 15, q >> 4], axis=-1).astype(np.int32)
        pairs = scale.astype(np.float32).reshape(*scale.shape[:-1], -1, 2)
        s, lo = pairs[..., 0], pairs[..., 1]
    n = s.shape[-1]
    g = grid.reshape(*grid.shape[:-1], n, -1).astype(np.float32)
    deq = (g * s[..., None] + lo[..., None]).reshape(grid.shape)
    return grid, deq, np.repeat(s, grid.shape[-1] // n, axis=-1)


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_prefill_state_is_the_float_state_on_the_grid(v4, kv):
    """Each stored entry is within half a grid step of the float state's entry (schedule b: every state kind)."""
    ids, _, _ = v4.ref("b")
    _, sf = v4.runner(v4.hf_dir("b"), "trt").prefill(ids)
    _, sq = v4.runner(v4.hf_dir("b"), "trt", kv_dtype=kv).prefill(ids)
    checked = 0
    for name, q in sq.items():
        if q.dtype != np.uint8:
            continue
        scale = sq[name.replace("past.", "past_scale.", 1)]
        grid, deq, step = dequantized(q, scale, kv)
        assert deq.shape == sf[name].shape and np.all(np.abs(deq - sf[name]) <= 0.5 * step + 1e-5), name
        if kv == "int8":
            assert np.abs(grid).max() == 127  # every non-empty state uses the whole grid
        else:
            assert grid.min() == 0 and grid.max() == 15
        checked += 1
    assert checked == 7  # schedule b: a window per layer and compressed entries in its compressed layers


@pytest.mark.parametrize("kv,bound", [("int8", 5e-2), ("int4", 0.8)])
def test_quantized_state_logits_near_float_state(v4, kv, bound):
    ids, ref, _ = v4.ref("a")
    f32 = v4.runner(v4.hf_dir("a"), "trt")
    q = v4.runner(v4.hf_dir("a"), "trt", kv_dtype=kv)
    pre_f, _ = f32.prefill(ids)
    pre_q, _ = q.prefill(ids)
    dec_f, _ = f32.decode(ids)
    dec_q, st = q.decode(ids)
    e_pre, e_dec, e_ref = rel_err(pre_q[0], pre_f[0]), rel_err(dec_q, dec_f), rel_err(dec_q, ref)
    print(f"V4 {kv} state a: prefill {e_pre:.2e} / decode {e_dec:.2e} vs float state, decode vs "
          f"transformers {e_ref:.2e}")
    # one step reads its own new entries in float32, so a prefill from an empty state is exact; decode reads
    # every earlier entry from the quantized state. Measured int8 2.1% on a (schedule b: 17%), int4 29% with the
    # asymmetric grid (the symmetric one: 50%, 32% with 32-channel groups: no trend, the routing is chaotic):
    # larger than the dense models' because these tiny random V4 models route their top-k experts
    # differently after any rounding (4-bit weights move them up to 150%: test_v4_w4a16), so b is checked on
    # its state above
    assert e_pre < 1e-5 and 1e-6 < e_dec < bound and e_ref < bound
    dtypes = {s.input: s.dtype for s in q.entry.state}
    assert dtypes["past.0.window"] == ("uint8" if kv == "int8" else "uint4x2")
    assert dtypes["past_scale.0.window"] == "float16"
    kept = {k: v for k, v in dtypes.items() if k.endswith(("comp_kv", "comp_gate", "idx_kv", "idx_gate", "idx_keys"))}
    assert kept and set(kept.values()) == {"float32"}
    assert st["past.0.window"].dtype == np.uint8


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_state_graph_passes_trt_10_3_tables(v4, kv):
    import onnx

    r = v4.runner(v4.hf_dir("a"), "trt", kv_dtype=kv)
    rep = check_model(onnx.load(r.sess._model_path, load_external_data=False), "10.3")
    assert not [o for o in rep.offenders if "past" in o.node or "present" in o.node
                or o.op in ("Cast", "Round", "Floor", "Concat")]
