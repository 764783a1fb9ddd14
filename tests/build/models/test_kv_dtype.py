"""--kv-dtype: the trt flavor's int8 cache (uint8 values + per-token-per-head fp16 scales) against the float cache and
transformers, its state tensors, TensorRT 10.3's op tables, the manifest record and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.build.tensorrt.check import check_bundle
from lineside.bundle import open_bundle
from lineside.errors import LinesideError
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from tests.build.models.test_dense_parity import IDS, reference_logits, rel_err


@pytest.fixture(scope="module")
def kv_bundle(tiny_bundles):
    def get(kv: str, quant: str = "fp16", variant: str = "llama-gqa"):
        return open_bundle(tiny_bundles(variant=variant, quant=quant, flavors=("trt",), max_seq_len=64,
                                        group_size=64, accuracy_level=0, kv_dtype=kv))
    return get


def logits(bundle):
    be = OnnxRuntimeBackend(bundle, flavor="trt", accuracy_level=0)
    return compute_logits(be, IDS, "prefill"), compute_logits(be, IDS, "decode")


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
def test_int8_kv_within_bound_of_float_kv_and_transformers(kv_bundle, tiny_dense, variant):
    ref_pre, _ = logits(kv_bundle("fp16", variant=variant))
    pre, dec = logits(kv_bundle("int8", variant=variant))
    # measured 0.4% on these models; the bound leaves 2.5x headroom, and rounding K/V to int8 must show
    assert 1e-5 < rel_err(pre, ref_pre) < 1e-2 and rel_err(dec, ref_pre) < 1e-2
    assert rel_err(dec, pre) < 1e-4  # prefill and decode read the same stored values
    ref = reference_logits(tiny_dense(variant), IDS)
    f32_pre, f32_dec = logits(kv_bundle("int8", quant="fp32", variant=variant))
    assert rel_err(f32_pre, ref) < 1e-2 and rel_err(f32_dec, ref) < 1e-2


def test_int8_states_manifest_and_trt_10_3_tables(kv_bundle):
    b = kv_bundle("int8")
    st = {s.input: s for s in b.flavor("trt").state}
    assert st["past_key.0"].dtype == "uint8" and st["past_key.0"].shape == ["batch", 2, "past_seq", 16]
    assert st["past_key_scale.0"].dtype == "float16" and st["past_key_scale.0"].shape == ["batch", 2, "past_seq", 1]
    assert st["past_value_scale.1"].output == "present_value_scale.1" and len(st) == 8
    rec = b.manifest.quantization["kv_cache"]
    assert rec["dtype"] == "int8" and rec["scales"] == "per-token-per-head dynamic" and "why" in rec
    rep = check_bundle(b, "10.3")
    assert rep.ok, rep.offenders[:3]
    import onnx

    from lineside.build.graph.kv_cache import hadamard

    m = onnx.load(b.path / b.flavor("trt").graph, load_external_data=False)
    h = hadamard(16)
    consts = [onnx.numpy_helper.to_array(t) for t in m.graph.initializer if list(t.dims) == [16, 16]]
    assert any(np.array_equal(c, h) for c in consts) and np.allclose(h @ h.T, np.eye(16), atol=1e-6)
    assert "rotation" in rec
    # K and V of a layer are quantized by one set of ops (2 layers): one Round, one ReduceMax each
    assert rep.op_counts["Round"] == 2 and rep.op_counts["ReduceMax"] == 2


def test_fp8_kv_is_refused_for_orin_and_by_onnxruntime(trt_bundle):
    from lineside.graph_io import StateTensor
    from lineside.runtime.tensorrt.buffers import check_kv_support

    fp8 = [StateTensor("past_key.0", "present_key.0", ["batch", 2, "past_seq", 16], dtype="float8_e4m3fn",
                       update="append")]
    with pytest.raises(LinesideError, match=r"needs a GPU of SM >= 8.9 .*--kv-dtype int8"):
        check_kv_support(fp8, "8.7")
    check_kv_support(fp8, "9.0")
    check_kv_support(trt_bundle("fp16").flavor("trt").state, "8.7")


def _with_state_dtype(bundle, dtype: str, dst):
    """A copy of ``bundle`` whose manifest says its KV states are ``dtype`` (another build's cache)."""
    import json
    import shutil

    shutil.copytree(bundle.path, dst)
    man = json.loads((dst / "manifest.json").read_text())
    for st in man["flavors"]["trt"]["state"]:
        st["dtype"] = dtype
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


@pytest.mark.parametrize("dtype,msg", [
    ("float8_e4m3fn", r"is float8_e4m3fn, .*cannot hold: fp8 KV runs on TensorRT only, on a GPU of SM >= 8.9"),
    ("uint2x4", r"is uint2x4, .*cannot hold: it holds .*uint4x2.*; rebuild the bundle with this lineside"),
])
def test_a_kv_dtype_onnxruntime_cannot_hold_is_one_line_before_the_graph_loads(trt_bundle, tmp_path, monkeypatch,
                                                                               dtype, msg):
    """A bundle whose cache onnxruntime's CPU arena cannot hold (fp8, or a dtype of another lineside's build) is
    refused in one line naming the state and what to do, before its graph is loaded (seconds to minutes for a real
    model); it said "fp8 KV runs on TensorRT" whatever the dtype, after loading the graph."""
    import lineside.runtime.onnxruntime_backend as ob

    path = _with_state_dtype(trt_bundle("fp16"), dtype, tmp_path / "b")

    def loaded(*_a, **_k):
        raise AssertionError("the graph was loaded before the state dtypes were checked")

    monkeypatch.setattr(ob, "open_session", loaded)
    with pytest.raises(LinesideError, match=rf"state past_key\.0 {msg}") as e:
        OnnxRuntimeBackend(open_bundle(path), flavor="trt")
    assert "\n" not in str(e.value)
    from tests.cli.cli_run import assert_one_line_error, run_cli

    assert_one_line_error(run_cli("generate", path, "--prompt", "hi", "--max-tokens", "2", "--backend", "onnxruntime"),
                          f"state past_key.0 is {dtype}")


@pytest.mark.parametrize("kv,flavors,msg", [
    ("fp8", ("trt",), "TensorRT takes FP8 only from a QuantizeLinear inside the network.*Orin.*--kv-dtype int8"),
    ("int8", ("cpu", "trt"), "the cpu flavor keeps a float32 cache"),
    ("int4", ("cpu",), "the cpu flavor keeps a float32 cache.*--flavors trt with --kv-dtype int4"),
    ("bf8", ("trt",), "is not one of fp16, int8, fp8, int4"),
])
def test_bad_kv_dtype_is_one_line(tiny_dense, tmp_path, kv, flavors, msg):
    with pytest.raises(LinesideError, match=msg) as e:
        build_bundle(tiny_dense("llama-gqa"), tmp_path / "b", BuildOptions(flavors=flavors, kv_dtype=kv))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "b").exists()


def test_default_float_cache_is_unchanged(kv_bundle):
    b = kv_bundle("fp16")
    assert {s.dtype for s in b.flavor("trt").state} == {"float16"}
    assert b.manifest.quantization["kv_cache"]["dtype"] == "fp16"
    assert np.isfinite(logits(b)[0]).all()


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_cache_prefix_copy_and_rollback(kv_bundle, kv):
    """copy_slot (prefix reuse) and rewriting positions after a rejected draft (speculative rollback) move the
    scales with the values: both give the logits of a fresh run."""
    from lineside.runtime.backend import StepBatch

    b = kv_bundle(kv)
    be = OnnxRuntimeBackend(b, num_slots=2, flavor="trt", accuracy_level=0)
    fresh = be.forward(StepBatch.single(1, IDS[:10], 0, all_logits=True))[0]
    be.reset_slot(1)
    be.forward(StepBatch.single(0, IDS[:6], 0))
    be.copy_slot(0, 1, 6)
    got = be.forward(StepBatch.single(1, IDS[6:10], 6, all_logits=True))[0]
    tol = 1e-5
    assert rel_err(got, fresh[6:10]) < tol
    be.forward(StepBatch.single(0, [250, 251, 252], 6))  # a draft of 3 tokens, all rejected
    again = be.forward(StepBatch.single(0, IDS[6:10], 6, all_logits=True))[0]  # rewritten from position 6
    assert rel_err(again, fresh[6:10]) < tol
    if kv == "int4":  # the sink entry travelled with the copy: a slot without it reads other values
        be.reset_slot(1)
        be.forward(StepBatch.single(0, IDS[:6], 0))
        be.copy_slot(0, 1, 6)
        for name in [n for n in be.arena if n.startswith("past_sink.")]:
            be.arena[name][1] = 0
        lost = be.forward(StepBatch.single(1, IDS[6:10], 6, all_logits=True))[0]
        assert rel_err(lost, fresh[6:10]) > 1e-2


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """The stored grid values (0..15) of a packed int4 state: channel c in the low nibble, c + d/2 in the high one."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.int32)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
def test_int4_kv_within_bound_of_float_kv_and_transformers(kv_bundle, tiny_dense, variant):
    ref_pre, _ = logits(kv_bundle("fp16", variant=variant))
    pre, dec = logits(kv_bundle("int4", variant=variant))
    e_pre, e_dec = rel_err(pre, ref_pre), rel_err(dec, ref_pre)
    print(f"int4 KV {variant}: prefill {e_pre:.2e}, decode {e_dec:.2e} vs fp16 KV")
    # measured 3.1% (llama-gqa) / 2.3% (qwen2) with the asymmetric grid and the fp16 first entry (5.8% / 2.1% without
    # it; int8: 0.4%): 16 levels per head vector must show, and stay bounded. Loose: a scale off by 5% passes it
    # (11% / 4.6%); test_quantized_kv_is_transformers_with_the_readme_format is the bound that catches that
    assert 1e-2 < e_pre < 0.15 and e_dec < 0.15
    assert rel_err(dec, pre) < 1e-4  # prefill and decode read the same stored values
    ref = reference_logits(tiny_dense(variant), IDS)
    f32_pre, f32_dec = logits(kv_bundle("int4", quant="fp32", variant=variant))
    assert rel_err(f32_pre, ref) < 0.15 and rel_err(f32_dec, ref) < 0.15


def test_int4_states_packing_manifest_and_trt_10_3_tables(kv_bundle):
    """Values are [.., head_dim/2] bytes (two 4-bit grid values each) and an fp16 (scale, minimum) pair per 16
    channels (here head_dim 16: one group); each vector's extremes sit on the grid's ends, and the stored values
    dequantize to within half a step of the entries the float cache holds."""
    b = kv_bundle("int4")
    st = {s.input: s for s in b.flavor("trt").state}
    assert st["past_key.0"].dtype == "uint4x2" and st["past_key.0"].shape == ["batch", 2, "past_seq", 8]
    assert st["past_key_scale.0"].dtype == "float16" and st["past_key_scale.0"].shape == ["batch", 2, "past_seq", 2]
    rec = b.manifest.quantization["kv_cache"]
    assert rec["dtype"] == "int4" and rec["scale_group"] == 16 and "packing" in rec and "why" in rec
    assert rec["grid"].startswith("asymmetric") and rec["bytes_per_head_vector"] == 8 + 4
    rep = check_bundle(b, "10.3")
    assert rep.ok, rep.offenders[:3]
    # unpacked with Floor: the past entries only (the new ones are read from their grid values), K and V of a layer
    # apart (kv_cache.emit_kv_pair), 2 layers; no bit ops (not in TensorRT 10.3's tables)
    assert rep.op_counts["Floor"] == 4 and not rep.op_counts["BitShift"] and not rep.op_counts["BitwiseAnd"]
    # the past is read whole (the sink slots are keys of their own, the cache's copies of them masked): no Slice
    assert not rep.op_counts["Slice"]
    be = OnnxRuntimeBackend(b, num_slots=1, flavor="trt", accuracy_level=0)
    from lineside.runtime.backend import StepBatch

    be.forward(StepBatch.single(0, IDS, 0))
    packed = be.arena["past_key.0"][0, :, :len(IDS)]
    grid = unpack_int4(packed)
    assert packed.dtype == np.uint8
    assert (grid.min(-1) == 0).all() and (grid.max(-1) == 15).all()  # each vector's min and max sit on the ends
    sc = be.arena["past_key_scale.0"][0, :, :len(IDS)].astype(np.float32)  # (scale, minimum) per vector
    deq = grid * sc[..., :1] + sc[..., 1:]
    assert (sc[..., 0] > 0).all() and np.isfinite(deq).all()


def test_int4_packing_matmul_is_exact_on_onnxruntime():
    """The int4 bytes come from one MatMul of the grid values by a 0/1/16 matrix (kv_cache._packing): every (lo, hi)
    pair of 4-bit values gives lo + 16·hi exactly, through onnxruntime's CPU MatMul, the byte layout
    ``unpack_int4`` reads (channel c low, c + d/2 high)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from lineside.build.graph.kv_cache import _packing

    d = 64
    lo, hi = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    pairs = np.stack([lo.ravel(), hi.ravel()], -1)  # 256 (lo, hi)
    rows = pairs.reshape(256 // (d // 2), d // 2, 2)  # 8 head vectors of 32 pairs each
    grid = np.concatenate([rows[..., 0], rows[..., 1]], -1).astype(np.float32)  # lo half, then hi half
    node = helper.make_node("MatMul", ["g", "p"], ["b"])
    model = helper.make_model(helper.make_graph(
        [node], "pack", [helper.make_tensor_value_info("g", TensorProto.FLOAT, list(grid.shape))],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)], [numpy_helper.from_array(_packing(d), "p")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    packed = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"g": grid})[0]
    assert np.array_equal(packed, grid[:, :d // 2] + 16 * grid[:, d // 2:])
    assert np.array_equal(unpack_int4(packed.astype(np.uint8)), grid.astype(np.int32))


def test_by_value_input_binder_falls_back_to_the_pointer_api():
    """The by-value step binds its inputs through onnxruntime's numpy binding where IOBinding has it (no reference
    to the array kept), and through the public pointer API where it does not."""
    from lineside.runtime.onnxruntime_backend import _input_binder

    calls = []

    class Raw:
        def bind_input(self, *args):
            calls.append(("raw", args))

    class WithRaw:
        _iobinding = Raw()

    class PublicOnly:
        def bind_input(self, *args):
            calls.append(("public", args))

    arr = np.arange(6, dtype=np.uint8).reshape(2, 3)
    _input_binder(WithRaw())("past_key.0", arr)
    _input_binder(PublicOnly())("past_key.0", arr)
    assert calls[0] == ("raw", ("past_key.0", arr))
    kind, (name, device, device_id, dtype, shape, ptr) = calls[1]
    assert (kind, name, device, device_id, dtype, shape, ptr) == \
        ("public", "past_key.0", "cpu", 0, np.uint8, [2, 3], arr.ctypes.data)


def test_int4_layout_tiles_the_head_vector_or_is_refused():
    from lineside.build.quant.kv import FORMATS, KvDtype

    fmt = FORMATS[KvDtype.INT4]
    assert (fmt.stored_dim(128), fmt.scale_dim(128)) == (64, 8) and (fmt.stored_dim(16), fmt.scale_dim(16)) == (8, 1)
    assert fmt.scale_state_dim(128) == 16 and fmt.scale_state_dim(64) == 8  # a (scale, minimum) pair per group
    with pytest.raises(LinesideError, match="head_dim 72 is not a multiple of its scale group 16.*--kv-dtype int8"):
        fmt.scale_dim(72)
    with pytest.raises(LinesideError, match="head_dim 15 is not a multiple of 2"):
        fmt.stored_dim(15)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
def test_int4_key_means_are_transformers_mean_cached_keys(tiny_dense, variant):
    """The means an int4 cache subtracts from its keys (quant/kv_calib.py) are the post-RoPE keys transformers
    caches, averaged over the tokens, per layer and KV head."""
    import torch
    from transformers import AutoModelForCausalLM

    from lineside.build.checkpoint import open_checkpoint
    from lineside.build.quant.kv_calib import key_means
    from lineside.config import ModelConfig

    ckpt = open_checkpoint(tiny_dense(variant))
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config, name="tiny")
    ids = np.array([IDS[:8], IDS[-8:]], np.int64)
    got = key_means(cfg, ckpt.get, ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_dense(variant), dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor(ids), use_cache=True).past_key_values
    want = np.stack([cache.layers[i].keys.numpy().mean(axis=(0, 2)) for i in range(cfg.num_layers)])
    assert got.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_int4_graph_subtracts_the_key_means(kv_bundle):
    import onnx

    b = kv_bundle("int4")
    assert "key_centering" in b.manifest.quantization["kv_cache"]
    m = onnx.load(b.path / b.flavor("trt").graph, load_external_data=False)
    means = [t for t in m.graph.initializer if list(t.dims) == [2, 1, 16]]  # [kv_heads, 1, head_dim] per layer
    assert len(means) == 2 and all(np.abs(onnx.numpy_helper.to_array(t)).max() > 0 for t in means)



def test_int4_sink_entries_in_a_mixed_batch(kv_bundle):
    """Rows at different positions around the fp16 sink entries (the first 4) in one step — one decoding at
    position 2, one prefilling 6 tokens from 0, one decoding at 9 — give each row's logits alone, and the next
    steps read the sink entries each row wrote."""
    from lineside.build.quant.kv import FORMATS, KvDtype
    from lineside.runtime.backend import StepBatch

    assert FORMATS[KvDtype.INT4].sink == 4
    b = kv_bundle("int4")

    def fresh(slot_count: int = 3) -> OnnxRuntimeBackend:
        return OnnxRuntimeBackend(b, num_slots=slot_count, flavor="trt", accuracy_level=0)

    from tests.kv_sink_cases import prime_sink_boundary, sink_boundary_batch

    alone = fresh()
    prime_sink_boundary(alone, IDS)
    want = [alone.forward(StepBatch.single(0, IDS[2:3], 2))[0, 0], alone.forward(StepBatch.single(1, IDS[:6], 0))[0, 0],
            alone.forward(StepBatch.single(2, IDS[9:10], 9))[0, 0]]
    mixed = fresh()
    prime_sink_boundary(mixed, IDS)
    got = mixed.forward(sink_boundary_batch(IDS))
    for r in range(3):
        assert rel_err(got[r, 0], want[r]) < 1e-5
    # and the next step of each row (slot 0 at 3: its last sink entry; slot 1 at 6) reads what the mixed step wrote
    for slot, past in ((0, 3), (1, 6)):
        nxt = mixed.forward(StepBatch.single(slot, IDS[past:past + 1], past))[0, 0]
        assert rel_err(nxt, alone.forward(StepBatch.single(slot, IDS[past:past + 1], past))[0, 0]) < 1e-5


def _int4_trt(kv_bundle, slots: int = 4) -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend(kv_bundle("int4"), num_slots=slots, flavor="trt", accuracy_level=0)


def _fresh_int4(kv_bundle, n: int) -> np.ndarray:
    from lineside.runtime.backend import StepBatch

    return _int4_trt(kv_bundle).forward(StepBatch.single(0, IDS[:n], 0, all_logits=True))[0]


def test_int4_sink_entries_survive_rejected_drafts_padding_and_short_copies(kv_bundle):
    """Every step that feeds a position below 4 rewrites its sink slot (drafts that are then rejected, a short row's
    padding columns, another sequence's tokens in a slot), and a row reads slot p only once p is below its length:
    each case gives a fresh run's logits."""
    from lineside.runtime.backend import StepBatch

    ref = _fresh_int4(kv_bundle, 8)
    be = _int4_trt(kv_bundle)
    be.forward(StepBatch.single(0, IDS[:1], 0))
    be.forward(StepBatch.single(0, [250, 251, 252, 253], 1, all_logits=True))  # drafts at 1..4, all rejected
    assert rel_err(be.forward(StepBatch.single(0, IDS[1:8], 1, all_logits=True))[0], ref[1:8]) < 1e-5

    be.reset_slot(0)
    be.forward(StepBatch.single(0, IDS[:2], 0))
    be.forward(StepBatch.single(0, [250, 251, 252], 2, all_logits=True))  # drafts at 2..4 rejected
    be.forward(StepBatch.single(0, [IDS[2], 251], 2, all_logits=True))  # the first kept, the second rejected
    for p in range(3, 8):
        assert rel_err(be.forward(StepBatch.single(0, IDS[p:p + 1], p))[0, 0], ref[p]) < 1e-5

    be.reset_slot(0)
    be.forward(StepBatch.single(0, IDS[:1], 0))
    ids = np.zeros((2, 6), np.int64)
    ids[0, 0], ids[1] = IDS[1], IDS[:6]
    be.forward(StepBatch(slots=[0, 1], input_ids=ids, past_lengths=np.array([1, 0]), new_lengths=np.array([1, 6]),
                         logits_positions=np.array([[0], [5]])))  # row 0's padding columns sit at positions 2..6
    for p in range(2, 8):
        assert rel_err(be.forward(StepBatch.single(0, IDS[p:p + 1], p))[0, 0], ref[p]) < 1e-5

    be.forward(StepBatch.single(2, [9, 9, 9, 9, 9, 9], 0))  # slot 3 first holds another sequence
    be.copy_slot(2, 3, 6)
    be.copy_slot(1, 3, 2)  # then the first 2 positions of slot 1's
    assert rel_err(be.forward(StepBatch.single(3, IDS[2:8], 2, all_logits=True))[0], ref[2:8]) < 1e-5


def test_int4_sink_entries_are_not_the_4_bit_values(kv_bundle):
    """What the sink state buys: the same cache with the sink slots holding what the 4-bit entries give back
    (their dequantized values) is measurably further from the float cache."""
    from lineside.runtime.backend import StepBatch

    ref_fp16 = compute_logits(OnnxRuntimeBackend(kv_bundle("fp16"), flavor="trt", accuracy_level=0), IDS[:12],
                              "prefill")
    be = _int4_trt(kv_bundle, slots=1)
    be.forward(StepBatch.single(0, IDS[:4], 0))
    with_sink = be.forward(StepBatch.single(0, IDS[4:12], 4, all_logits=True))[0]
    # the sink slots overwritten by the 4-bit values of the same entries (K's heads, then V's, as stored)
    b = kv_bundle("int4")
    d, kvh = b.config.head_dim, b.config.num_kv_heads
    for layer in range(b.config.num_layers):
        deq = []
        for part in ("key", "value"):
            q = unpack_int4(be.arena[f"past_{part}.{layer}"][0, :, :4]).astype(np.float32)  # [kvh, 4, d]
            sc = be.arena[f"past_{part}_scale.{layer}"][0, :, :4].astype(np.float32).reshape(kvh, 4, d // 16, 2)
            deq.append((q.reshape(kvh, 4, d // 16, 16) * sc[..., :1] + sc[..., 1:]).reshape(kvh, 4, d))
        be.arena[f"past_sink.{layer}"][0] = np.concatenate(deq, axis=0).astype(np.float16)
    four_bit = be.forward(StepBatch.single(0, IDS[4:12], 4, all_logits=True))[0]
    e_sink, e_4bit = rel_err(with_sink, ref_fp16[4:12]), rel_err(four_bit, ref_fp16[4:12])
    print(f"int4 KV vs fp16 KV, positions 4..11: sink entries in fp16 {e_sink:.2e}, as 4-bit values {e_4bit:.2e}")
    assert e_sink < e_4bit


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8", "int4"])
def test_by_value_binding_matches_the_generic_step(kv_bundle, kv_dtype):
    """The trt flavor's decode and verification steps through the cached by-value binding (outputs bound once per
    step shape) give the generic step's logits and arena, bit for bit: two rows of different lengths, then a
    3-token step on one row."""
    from lineside.runtime.backend import StepBatch

    b = kv_bundle(kv_dtype)
    fast, plain = (OnnxRuntimeBackend(b, num_slots=2, flavor="trt", accuracy_level=0) for _ in range(2))
    plain._by_value_ready = False
    assert fast._by_value_ready
    for be in (fast, plain):
        be.forward(StepBatch.single(0, IDS[:7], 0))
        be.forward(StepBatch.single(1, IDS[:3], 0))
    rows = StepBatch(slots=[0, 1], input_ids=np.array([[IDS[7]], [IDS[3]]]), past_lengths=np.array([7, 3]),
                     new_lengths=np.array([1, 1]), logits_positions=np.zeros((2, 1), np.int64))
    steps = [rows, StepBatch.single(1, IDS[4:7], 4, all_logits=True), StepBatch.single(0, [IDS[8]], 8)]
    for step in steps:
        assert np.array_equal(fast.forward(step), plain.forward(step))
    assert fast._by_value and not plain._by_value
    for name, arr in fast.arena.items():
        assert np.array_equal(arr, plain.arena[name]), name


@pytest.mark.parametrize("kv_dtype", ["fp16", "int4"])
def test_by_value_binding_reused_across_past_lengths(kv_bundle, kv_dtype):
    """A cached by-value binding is reused by later steps of the same shape at other past lengths (its key has no
    past length): decode steps on two rows and then on one, interleaved, give the generic step's logits and arena
    bit for bit, and the logits a step returned are not overwritten by the next step."""
    from lineside.runtime.backend import StepBatch

    b = kv_bundle(kv_dtype)
    fast, plain = (OnnxRuntimeBackend(b, num_slots=2, flavor="trt", accuracy_level=0) for _ in range(2))
    plain._by_value_ready = False
    for be in (fast, plain):
        be.forward(StepBatch.single(0, IDS[:5], 0))
        be.forward(StepBatch.single(1, IDS[:2], 0))
    kept = []
    for i in range(12):  # one key, (2 rows, 1 token, 1 logit), at past lengths 5..16 and 2..13
        step = StepBatch(slots=[0, 1], input_ids=np.array([[IDS[i]], [IDS[-1 - i]]]),
                         past_lengths=np.array([5 + i, 2 + i]), new_lengths=np.array([1, 1]),
                         logits_positions=np.zeros((2, 1), np.int64))
        got, want = fast.forward(step), plain.forward(step)
        assert np.array_equal(got, want), i
        kept.append((got, want.copy()))
    assert (2, 1, 1) in fast._by_value and len(fast._by_value) == 3  # the two prefills, then decode
    for slot, past in ((1, 14), (0, 17)):  # one row on either slot: one binding (no bound shape has the slot)
        step = StepBatch.single(slot, [IDS[slot]], past)
        got, want = fast.forward(step), plain.forward(step)
        assert np.array_equal(got, want), slot
        kept.append((got, want.copy()))
    assert (1, 1, 1) in fast._by_value and len(fast._by_value) == 4
    assert all(np.array_equal(g, w) for g, w in kept)
    for name, arr in fast.arena.items():
        assert np.array_equal(arr, plain.arena[name]), name


def test_by_value_binding_keeps_no_copy_of_the_past(kv_bundle):
    """A cached by-value binding holds its outputs only: the copies of the past a step bound are let go after the
    run (held until the binding's next step, 32 bindings of a long context would keep gigabytes)."""
    import gc
    import tracemalloc

    from lineside.graph_io import StateUpdate
    from lineside.runtime.backend import StepBatch

    tracemalloc.start()
    try:
        be = OnnxRuntimeBackend(kv_bundle("fp16"), num_slots=1, flavor="trt", accuracy_level=0)
        past = 48
        for p in range(0, past, 24):  # the generic path: chunks over FAST_VERIFY_TOKENS keep no binding
            be.forward(StepBatch.single(0, (IDS * 4)[p:p + 24], p))
        assert not be._by_value
        for s in range(1, 9):  # eight cached bindings, each bound to the 48-entry past once
            be.forward(StepBatch.single(0, IDS[:s], past, all_logits=True))
        assert len(be._by_value) == 8
        per_entry = sum(be.arena[st.input].nbytes // be.max_seq_len for st in be.states
                        if st.update == StateUpdate.APPEND)
        outputs = sum(a.nbytes for _, outs in be._by_value.values() for a in outs.values())
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        be._by_value.clear()
        gc.collect()
        freed = held - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    copies = 8 * past * per_entry  # what the bindings would hold with their inputs
    print(f"held beyond the outputs: {freed - outputs} B; the copies: {copies} B")
    assert freed - outputs < copies / 4, (freed, outputs, copies)


# head_dim 64 (MHA), 80 (GQA 4, no Hadamard rotation), 96 (MQA, Qwen2 biases, no rotation), 128 (GQA 4)
KV_SHAPES = {
    "hd64-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64)),
    "hd80-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=80)),
    "hd96-mqa": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=96)),
    "hd128-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128)),
}


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("shape", list(KV_SHAPES))
def test_quantized_kv_is_transformers_with_the_readme_format(dense_checkpoint, tmp_path, monkeypatch, shape, kv):
    """A whole context (max_seq_len 64, the last position written) through prefill and through decode gives
    transformers' float32 logits with K and V rounded as README "Quantized KV cache" says (kv_reference.py), within
    a tenth of what the rounding itself moves them: a scale off by 5% fails (measured ~1e-2 from the format), where
    the bounds against the float cache above pass it. Measured here: 1e-7 to 1e-4 from the format, 2e-3 to 5e-2
    from the float cache."""
    from lineside.build.checkpoint import open_checkpoint
    from lineside.build.quant.kv_calib import key_means_for
    from lineside.config import ModelConfig
    from tests.build.models.kv_reference import quantized_kv_logits

    family, over = KV_SHAPES[shape]
    ckpt = dense_checkpoint(f"kv-{shape}", family, max_position_embeddings=128, **over)
    n = 64
    ids = [1, *np.random.default_rng(0).integers(3, 300, n - 1).tolist()]
    b = open_bundle(build_bundle(ckpt, tmp_path / "b", BuildOptions(quant="fp32", flavors=("trt",), max_seq_len=n,
                                                                   accuracy_level=0, kv_dtype=kv)))
    be = OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0)
    pre, dec = compute_logits(be, ids, "prefill"), compute_logits(be, ids, "decode")
    means = None
    if kv == "int4":  # the build's calibrated key means (test_int4_key_means_are_transformers_mean_cached_keys)
        reader = open_checkpoint(ckpt)
        means = key_means_for(ModelConfig.from_hf_dict(reader.hf_config, name="t"), reader, None, lambda _: None)
    want = quantized_kv_logits(ckpt, ids, kv, monkeypatch, means)
    moved = rel_err(want, reference_logits(ckpt, ids))
    e_pre, e_dec = rel_err(pre, want), rel_err(dec, want)
    print(f"{shape} {kv}: prefill {e_pre:.1e}, decode {e_dec:.1e} from the format; the format {moved:.1e} from float")
    assert moved > 1e-3 and e_pre < moved / 10 and e_dec < moved / 10
