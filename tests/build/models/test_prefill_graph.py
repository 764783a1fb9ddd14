"""The cpu flavor's int8 prefill graph: its linears against numpy and transformers, and where the runtime uses it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from lineside.build.graph import prefill
from lineside.build.graph.builder import GraphBuilder
from lineside.build.quant.smooth import (
    InputStats,
    Int8Form,
    choose_form,
    int8_error,
    quantize_columns,
    smooth_scales,
)
from lineside.bundle import open_bundle
from lineside.runtime.backend import StepBatch
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import PREFILL_MIN_TOKENS, OnnxRuntimeBackend
from tests.host_cpu import needs_exact_int8

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150, 61, 12, 200, 33, 90, 120, 7, 64, 31, 222]


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


# ---- one linear, against numpy ---------------------------------------------------------------------------------
def run_linear(tmp_path, x, w, bias=None, stats=None, forms=None):
    """x [B, S, K] through one recorded linear of a variant graph (the base graph's node is an Identity); the form
    the linear took goes into ``forms``."""
    gb = GraphBuilder(tmp_path / "m.onnx")
    prefill.enable(gb, {} if stats is None else {"lin": stats})
    xin = gb.input("x", TensorProto.FLOAT, ["b", "s", w.shape[1]])
    y = gb.op("Identity", [xin], name="lin/base")  # what the base graph computes does not matter here
    prefill.record_linear(gb, xin, y, "lin", lambda: w, bias)
    gb.op("Identity", [y], outputs=["y"])
    gb.output("y", TensorProto.FLOAT, ["b", "s", w.shape[0]])
    gb.save()
    if forms is not None:
        forms.update(prefill.forms(gb))
    path = prefill.write_prefill_graph(gb, tmp_path / "m.prefill.onnx")
    assert path is not None
    onnx.checker.check_model(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@needs_exact_int8
def test_linear_is_within_int8_rounding_of_the_float_product(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 40)).astype(np.float32)
    x = rng.standard_normal((2, 5, 40)).astype(np.float32)
    bias = rng.standard_normal(48).astype(np.float32)
    y = run_linear(tmp_path, x, w, bias)
    ref = x @ w.T + bias
    assert y.shape == (2, 5, 48)
    # each product term is off by at most half a step of x's row and of w's column
    step_x = np.abs(x).max(-1, keepdims=True) / 127
    step_w = np.abs(w).max(1) / 127
    bound = 0.5 * (step_x * np.abs(w).sum(1) + np.abs(x) @ step_w[:, None].repeat(40, 1).T) * 1.01 + 1e-5
    assert (np.abs(y - ref) <= bound).all(), float((np.abs(y - ref) - bound).max())
    assert rel_err(y, ref) < 0.02


def test_zero_rows_and_zero_weights_give_no_nan(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    w[3] = 0  # an all-zero output channel: scale 1, codes 0
    x = rng.standard_normal((1, 4, 32)).astype(np.float32)
    x[0, 1] = 0  # an all-zero row (a padded position): codes all 128, output exactly the bias
    bias = np.arange(16, dtype=np.float32)
    y = run_linear(tmp_path, x, w, bias)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[0, 1], bias)
    np.testing.assert_array_equal(y[0, :, 3], np.full(4, 3.0, np.float32))


@needs_exact_int8
def test_smoothing_keeps_the_product_and_tames_an_outlier_channel(tmp_path):
    rng = np.random.default_rng(2)
    w = (0.1 * rng.standard_normal((64, 96))).astype(np.float32)
    x = rng.standard_normal((1, 32, 96)).astype(np.float32)
    x[..., 7] *= 200  # one channel far larger than the rest, as LLM activations have
    ref = x @ w.T
    plain = run_linear(tmp_path / "plain", x, w)
    forms = {}
    flat = x.reshape(-1, 96)
    smoothed = run_linear(tmp_path / "smooth", x, w, stats=InputStats(np.abs(flat).max(0), flat[::2]), forms=forms)
    assert forms == {"lin": Int8Form.SMOOTHED}
    assert rel_err(smoothed, ref) < 0.5 * rel_err(plain, ref)
    assert rel_err(smoothed, ref) < 0.02


def test_each_linear_takes_the_int8_form_its_calibration_rows_favour(tmp_path):
    """Each linear takes the closer of smoothed and plain int8 on its calibration rows; a weight no int8 form holds
    keeps the base graph's node in the variant."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 64, 96)).astype(np.float32)
    flat = x.reshape(-1, 96)
    w = (0.1 * rng.standard_normal((32, 96))).astype(np.float32)
    stats = InputStats(np.abs(flat).max(0), flat)
    form, _, err = choose_form(stats, w)
    assert form in (Int8Form.PLAIN, Int8Form.SMOOTHED) and err < 0.02
    assert int8_error(flat, w, None) <= int8_error(flat, w, smooth_scales(stats.amax, w)) or form == Int8Form.SMOOTHED
    # an input channel that is zero on every calibration row meets weights 1e6 times the rest: each output
    # channel's int8 step is then larger than all its other weights, and no per-input-channel scale helps
    wild = w.copy()
    wild[:, 0] = 1e6
    x2 = x.copy()
    x2[..., 0] = 0
    flat2 = x2.reshape(-1, 96)
    stats2 = InputStats(np.abs(flat2).max(0), flat2)
    form, _, err = choose_form(stats2, wild)
    assert form == Int8Form.KEEP_4BIT and err > 0.5
    gb = GraphBuilder(tmp_path / "m.onnx")
    prefill.enable(gb, {"lin": stats2})
    xin = gb.input("x", TensorProto.FLOAT, ["b", "s", 96])
    prefill.record_linear(gb, xin, gb.op("Identity", [xin]), "lin", lambda: wild, None)
    assert prefill.forms(gb) == {"lin": Int8Form.KEEP_4BIT}
    gb.save()
    # its 4-bit node stays; with nothing else to replace, no prefill graph is written at all
    assert prefill.write_prefill_graph(gb, tmp_path / "m.prefill.onnx") is None


def test_smooth_scales_fall_back_to_one_where_statistics_say_nothing():
    w = np.ones((4, 5), np.float32)
    w[:, 1] = 0  # a dead input channel
    act = np.array([4.0, 9.0, 0.0, np.inf, np.nan], np.float32)
    s = smooth_scales(act, w, alpha=0.5)
    assert s[0] == pytest.approx(2.0)
    assert s[1] == 1.0 and s[2] == 1.0 and s[3] == 1.0 and s[4] == 1.0


def test_quantize_columns_round_trip():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((10, 7)).astype(np.float32)
    codes, scales = quantize_columns(w)
    assert codes.dtype == np.int8 and codes.shape == (7, 10) and np.abs(codes).max() == 127
    np.testing.assert_allclose(codes.T * scales[:, None], w, atol=float(scales.max()) / 2 + 1e-7)


# ---- whole bundles ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def w4_bundle(tiny_bundles):
    def get(variant="llama-gqa", **kw):
        return open_bundle(tiny_bundles(variant=variant, quant="w4a16", group_size=32, max_seq_len=64, **kw))
    return get


def reference_logits(ckpt, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def prefill_logits(be, ids):
    be.reset_slot(0)
    return be._run(StepBatch.single(0, ids, 0, all_logits=True), session=be.prefill_session)[0][0]


@needs_exact_int8
@pytest.mark.parametrize(("variant", "method"), [("llama-gqa", "rtn"), ("qwen2-bias-tied", "rtn"),
                                                 ("llama-bias", "rtn"), ("llama-gqa", "awq"),
                                                 ("qwen2-bias-tied", "gptq")])
def test_prefill_graph_tracks_transformers_as_the_4bit_graph_does(w4_bundle, tiny_dense, variant, method):
    """AWQ folds scales into norms and up_proj (the statistics are taken on the graph's own inputs); GPTQ's grids
    are dequantized exactly."""
    bundle = w4_bundle(variant, method=method)
    entry = bundle.flavor("cpu")
    assert entry.prefill_graph == "graphs/cpu/model.prefill.onnx"
    assert bundle.file(entry.prefill_graph).exists()
    be = OnnxRuntimeBackend(bundle)
    assert be.prefill_session is not None
    ref = reference_logits(tiny_dense(variant), IDS)
    base = compute_logits(be, IDS, "prefill")  # every logit asked for: the 4-bit graph
    int8 = prefill_logits(be, IDS)
    # int8 weights per channel and int8 rows (smoothed): within 3% of float32 from float weights; a GPTQ grid's
    # own error stays (its values are what the int8 graph quantizes), plus int8 rounding
    assert rel_err(int8, ref) < max(0.03, rel_err(base, ref) + 0.01), (rel_err(int8, ref), rel_err(base, ref))


def count_runs(be):
    """Runs of ``be``'s decode-graph session ("base") and prefill-graph session ("prefill"), counted from now on."""
    calls = {"prefill": 0, "base": 0}

    class Counting:
        def __init__(self, real, key):
            self.real, self.key = real, key

        def __getattr__(self, attr):
            return getattr(self.real, attr)

        def run_with_iobinding(self, io, *a):
            calls[self.key] += 1
            return self.real.run_with_iobinding(io, *a)

    for key, name in (("prefill", "prefill_session"), ("base", "session")):
        setattr(be, name, Counting(getattr(be, name), key))
    return calls


@needs_exact_int8
def test_a_prompt_chunk_runs_on_the_prefill_graph_and_decode_reads_its_cache(w4_bundle, tiny_dense):
    bundle = w4_bundle()
    be = OnnxRuntimeBackend(bundle)
    calls = count_runs(be)
    n = len(IDS)
    assert n >= PREFILL_MIN_TOKENS
    be.reset_slot(0)
    last = be.forward(StepBatch.single(0, IDS[:-1], 0))  # a prompt: logits at its last position only
    assert calls == {"prefill": 1, "base": 0}
    step = be.forward(StepBatch.single(0, IDS[-1:], n - 1))
    assert calls == {"prefill": 1, "base": 1}
    ref = reference_logits(tiny_dense("llama-gqa"), IDS)
    base = compute_logits(be, IDS, "prefill")  # all logits: the base graph, and a fresh cache
    assert calls["prefill"] == 1
    assert rel_err(last[0, 0], ref[n - 2]) < rel_err(base[n - 2], ref[n - 2]) + 0.03
    # the decode step after the int8 prompt reads the cache it wrote
    assert rel_err(step[0, 0], ref[n - 1]) < rel_err(base[n - 1], ref[n - 1]) + 0.03
    # so does a 2-token chunk; a 1-token step and a verification (a logit at every position) stay on the 4-bit graph
    assert PREFILL_MIN_TOKENS == 2
    be.reset_slot(0)
    be.forward(StepBatch.single(0, IDS[:2], 0))
    assert calls["prefill"] == 2
    be.forward(StepBatch.single(0, IDS[2:3], 2))
    be.forward(StepBatch.single(0, IDS[3:8], 3, all_logits=True))
    assert calls["prefill"] == 2


def test_switches_that_leave_the_prefill_graph_out(w4_bundle, tiny_bundles, monkeypatch):
    monkeypatch.setenv("LINESIDE_PREFILL_GRAPH", "0")
    assert OnnxRuntimeBackend(w4_bundle()).prefill_session is None
    monkeypatch.delenv("LINESIDE_PREFILL_GRAPH")
    off = w4_bundle(prefill_graph=False)
    assert off.flavor("cpu").prefill_graph is None
    assert not (off.path / "graphs/cpu/model.prefill.onnx").exists()
    fp32 = open_bundle(tiny_bundles(quant="fp32"))  # float weights: the float graph's prompt is no slower
    assert fp32.flavor("cpu").prefill_graph is None
    manifest = json.loads((w4_bundle().path / "manifest.json").read_text())
    assert manifest["flavors"]["cpu"]["prefill_graph"] == "model.prefill.onnx"
    assert "graphs/cpu/model.prefill.onnx" in manifest["files"]


def test_a_cpu_whose_int8_product_saturates_runs_prompts_on_the_4bit_graph(w4_bundle, monkeypatch, caplog):
    """x86 without VNNI: onnxruntime adds pairs of int8 products in 16 bits and saturates (cpu_features.py), so the
    runtime leaves the prefill graph unused, says so in one line, and a prompt chunk equals the 4-bit graph's."""
    from lineside.runtime import onnxruntime_backend

    bundle = w4_bundle()
    monkeypatch.setattr(onnxruntime_backend, "host_int8_gemm_exact", lambda: False)
    with caplog.at_level("INFO", logger="lineside.runtime"):
        be = OnnxRuntimeBackend(bundle)
    assert be.prefill_session is None
    assert [r.getMessage() for r in caplog.records if "VNNI" in r.getMessage()] == [
        "prompts run on the 4-bit graph: onnxruntime's int8 product saturates on this CPU (x86 without VNNI), so the "
        "bundle's int8 prefill graph is left unused"]
    be.reset_slot(0)
    chunk = be.forward(StepBatch.single(0, IDS, 0))[0, -1]
    monkeypatch.setenv("LINESIDE_PREFILL_GRAPH", "0")
    off = OnnxRuntimeBackend(bundle)
    off.reset_slot(0)
    assert np.array_equal(chunk, off.forward(StepBatch.single(0, IDS, 0))[0, -1])
    monkeypatch.delenv("LINESIDE_PREFILL_GRAPH")
    monkeypatch.setattr(onnxruntime_backend, "host_int8_gemm_exact", lambda: True)
    assert OnnxRuntimeBackend(bundle).prefill_session is not None


@needs_exact_int8
def test_with_adapter_slots_base_prompts_take_it_and_adapter_prompts_the_lora_graph(w4_bundle, peft_adapter,
                                                                                   monkeypatch):
    """The prefill graph is the base model's: on a server with adapter slots a base request's prompt runs on it (as on
    a server without: the same logits), an adapter's on the LoRA graph (as with the prefill graph switched off)."""
    from lineside.lora import read_adapter
    from lineside.runtime.lora_stack import LoraSlotsConfig
    from tests.conftest import LORA_ADAPTERS

    bundle = w4_bundle(max_lora_rank=8)
    name = sorted(LORA_ADAPTERS)[0]
    adapter = read_adapter(peft_adapter("llama-gqa", name), bundle.config, name)

    def served(**env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        be = OnnxRuntimeBackend(bundle, num_slots=2, lora=LoraSlotsConfig(max_loras=1, max_rank=8))
        be.load_adapter(1, adapter)
        for slot in (0, 1):
            be.reset_slot(slot)
        return be

    be = served()
    calls = count_runs(be)
    base = be.forward(StepBatch.single(0, IDS, 0))[0, -1]
    assert calls == {"prefill": 1, "base": 0}
    tuned = be.forward(StepBatch.single(1, IDS, 0, adapter=1))[0, -1]
    assert calls == {"prefill": 1, "base": 1}
    plain = OnnxRuntimeBackend(w4_bundle())  # the same model without LoRA graphs
    plain.reset_slot(0)
    assert np.array_equal(base, plain.forward(StepBatch.single(0, IDS, 0))[0, -1])
    off = served(LINESIDE_PREFILL_GRAPH="0")
    assert off.prefill_session is None
    assert np.array_equal(tuned, off.forward(StepBatch.single(1, IDS, 0, adapter=1))[0, -1])
    assert not np.allclose(base, tuned, atol=1e-3)  # the adapter changes the answer: its rows did read the adapter


@needs_exact_int8
@pytest.mark.slow
def test_smollm2_prefill_graph_predicts_as_its_4bit_graph(smol_bundle):
    """The real model on real text: the int8 graph's next-token choices agree with the 4-bit graph's nearly
    everywhere, and its log-likelihood of the text is within a percent (benchmarks/quality_smollm2.py measures it)."""
    from lineside.runtime.sampling import log_softmax
    from lineside.runtime.tokenizer import Tokenizer

    bundle = open_bundle(smol_bundle)
    tok = Tokenizer.from_bundle(bundle)
    text = ("The maintenance team checks every conveyor belt at the start of each shift. A worn belt is replaced "
            "before it tears, because a stopped line costs far more than a spare part. Bearings are greased weekly, "
            "and any motor that runs hot is logged, inspected and, if needed, swapped during the next planned stop.")
    ids = tok.encode(text, add_special=False)
    be = OnnxRuntimeBackend(bundle)
    base = compute_logits(be, ids, "prefill")
    int8 = prefill_logits(be, ids)
    agree = float((base.argmax(-1) == int8.argmax(-1)).mean())
    nll = [-sum(log_softmax(lg[i])[t] for i, t in enumerate(ids[1:])) / (len(ids) - 1) for lg in (base, int8)]
    assert agree >= 0.85, agree
    assert abs(nll[1] - nll[0]) < 0.01 * nll[0] + 0.01, nll


def test_accuracy_level_0_keeps_prompts_exact(w4_bundle, tiny_dense):
    """--accuracy-level 0 asks for float32 activations (exact): its prompts ran on the int8 graph all the same,
    a prompt's last logits 5% off what the same bundle's decode steps give (tiny Llama). At level 0 no prefill graph is
    built unless asked for (--prefill-graph), and a prompt chunk equals one-token steps to float32 rounding."""
    exact = w4_bundle(accuracy_level=0)
    assert exact.flavor("cpu").prefill_graph is None
    be = OnnxRuntimeBackend(exact)
    assert be.prefill_session is None
    be.reset_slot(0)
    last = be.forward(StepBatch.single(0, IDS, 0))[0, -1]
    steps = compute_logits(be, IDS, "decode")
    assert rel_err(last, steps[-1]) < 1e-4
    assert w4_bundle(accuracy_level=0, prefill_graph=True).flavor("cpu").prefill_graph is not None
    assert w4_bundle().flavor("cpu").prefill_graph is not None  # level 4 (the default): int8 activations anyway


def test_a_drafts_cost_counts_the_decode_graphs_weights_only(w4_bundle):
    """The data file holds the prefill graph's int8 weights too: a draft's cost in target steps (adaptive draft
    length) is judged on what a decode step reads, so a bundle with and one without a prefill graph cost the same."""
    from lineside.runtime.speculative.proposers import _size_ratio

    with_graph, without = w4_bundle(), w4_bundle(prefill_graph=False)
    assert with_graph.file("graphs/cpu/model.onnx.data").stat().st_size > \
        1.5 * without.file("graphs/cpu/model.onnx.data").stat().st_size
    assert _size_ratio(without, with_graph) == pytest.approx(1.0)
    assert with_graph.graph_weight_bytes("graphs/cpu/model.onnx") == without.graph_weight_bytes("graphs/cpu/model.onnx")


def test_an_rtn_build_chooses_the_int8_forms_on_its_calib_text(w4_bundle, tiny_bundles, tmp_path_factory):
    """The prefill graph's smoothing scales come from --calib or the shipped text (quant/smooth.py), RTN builds
    included: `--calib` with the default --method rtn was refused ("rtn reads no calibration text")."""
    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text("Pump 4 tripped at 03:12; the bearing ran at 91 C before the alarm. " * 40)
    own = open_bundle(tiny_bundles(variant="llama-gqa", quant="w4a16", group_size=32, max_seq_len=64, calib=calib))
    shipped = w4_bundle()
    data = "graphs/cpu/model.onnx.data"
    assert own.flavor("cpu").prefill_graph is not None
    assert own.manifest.files[data].sha256 != shipped.manifest.files[data].sha256  # other smoothing scales
    assert own.manifest.files["graphs/cpu/model.onnx"].sha256 == shipped.manifest.files["graphs/cpu/model.onnx"].sha256


@needs_exact_int8
def test_a_model_with_a_tiny_vocabulary_builds_its_prefill_graph_by_default(dense_checkpoint, tmp_path, monkeypatch):
    """The shipped calibration text says little through a tokenizer of 12 tokens (8 distinct ids, a character or
    DNA model): the default build failed ("calibration text has only 8 distinct tokens; give --calib varied text"),
    which no --calib could satisfy. The prefill graph's statistics take what the shipped text gives."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    ck = dense_checkpoint("llama-vocab12", "llama", vocab_size=12)
    bundle = open_bundle(build_bundle(ck, tmp_path / "b", BuildOptions(quant="w4a16", group_size=32, max_seq_len=64)))
    assert bundle.flavor("cpu").prefill_graph is not None
    be = OnnxRuntimeBackend(bundle)
    ids = [i % 12 for i in IDS]
    ref = reference_logits(ck, ids)
    base = compute_logits(be, ids, "prefill")
    int8 = prefill_logits(be, ids)
    assert rel_err(int8, ref) < max(0.03, rel_err(base, ref) + 0.01), (rel_err(int8, ref), rel_err(base, ref))
    # a text its tokenizer gives no id for: no statistics, every linear plain int8
    monkeypatch.setattr("lineside.build.quant.calibrate.default_calibration_text", lambda: "\u2603" * 100)
    plain = open_bundle(build_bundle(ck, tmp_path / "p", BuildOptions(quant="w4a16", group_size=32, max_seq_len=64)))
    assert plain.flavor("cpu").extra["prefill_forms"] == {"smoothed": 0, "plain": 8, "4-bit": 0}


def _as_older_onnxruntime_infers_attention(graph, out):
    """``graph`` saved to ``out`` with each GroupQueryAttention replaced by a stand-in whose output has what
    onnxruntime 1.20-1.23 infer for it when its packed query's width is not known statically: [b, s, 0] (their
    inference divides that unknown width, read as 0, by the heads). The stand-in is only for loading."""
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph), load_external_data=False)
    nodes = []
    for n in model.graph.node:
        if n.op_type != "GroupQueryAttention":
            nodes.append(n)
            continue
        none = f"{n.name}/no_columns"
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(0, np.int64), none))
        nodes += [helper.make_node("Gather", [n.input[0], none], [n.output[0]], axis=2),
                  helper.make_node("Identity", [n.input[3]], [n.output[1]]),
                  helper.make_node("Identity", [n.input[4]], [n.output[2]])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(out))
    return out


def test_the_prefill_graph_does_not_rely_on_the_attention_width_older_onnxruntime_infers(w4_bundle, tmp_path):
    """onnxruntime 1.20-1.23 (1.23.2 is Python 3.10's newest, JetPack 6's) refused the prefill graph at load:
    '[ShapeInferenceError] Incompatible dimensions' at o_proj's smoothing Mul, which broadcast the attention's
    output (inferred [b, s, 0] from a packed query whose width the prefill linear's Reshape leaves unknown) against
    its [hidden] scales; prompts fell back to the 4-bit graph. The smoothing now scales the [rows, hidden] rows its
    quantizer reshapes anyway."""
    import shutil

    bundle = w4_bundle()
    entry = bundle.flavor("cpu")
    assert entry.extra["prefill_forms"]["smoothed"] > 0
    shutil.copy(bundle.file("graphs/cpu/model.onnx.data"), tmp_path / "model.onnx.data")
    older = _as_older_onnxruntime_infers_attention(bundle.file(entry.prefill_graph), tmp_path / "model.prefill.onnx")
    ort.InferenceSession(str(older), providers=["CPUExecutionProvider"])  # raised: Incompatible dimensions
