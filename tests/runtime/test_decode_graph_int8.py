"""LINESIDE_DECODE_GRAPH=int8: every base-model step on the bundle's int8 graph (a throughput mode), its rows
independent of each other, its logits within the int8 graph's bound of transformers, and one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.errors import LinesideError
from lineside.runtime import onnxruntime_backend
from lineside.runtime.backend import StepBatch
from lineside.runtime.onnxruntime_backend import DECODE_GRAPH_ENV, OnnxRuntimeBackend
from tests.host_cpu import needs_exact_int8

PROMPTS = [[1, 17, 42, 5, 99, 250, 3], [77, 8, 150, 61], [12, 200, 33, 90, 120, 7, 64, 31, 222], [5, 6]]


@pytest.fixture(scope="module")
def w4(tiny_bundles):
    def get(**kw):
        return open_bundle(tiny_bundles(variant="llama-gqa", quant="w4a16", group_size=32, max_seq_len=64, **kw))
    return get


def decode_step(be, rows, tokens, pasts):
    n = len(rows)
    return be.forward(StepBatch(slots=rows, input_ids=np.array(tokens, np.int64).reshape(n, 1),
                                past_lengths=np.array(pasts, np.int64), new_lengths=np.ones(n, np.int64),
                                logits_positions=np.zeros((n, 1), np.int64)))[:, 0]


def prompts_then_one_batched_step(be):
    """Each of PROMPTS but its last token into slots 0..3, then one decode step of the four last tokens together:
    (its logits, the last tokens, their past lengths) for comparing each row with the same step alone."""
    for slot, ids in enumerate(PROMPTS):
        be.reset_slot(slot)
        be.forward(StepBatch.single(slot, ids[:-1], 0))
    pasts = [len(p) - 1 for p in PROMPTS]
    last = [p[-1] for p in PROMPTS]
    return decode_step(be, [0, 1, 2, 3], last, pasts), last, pasts


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@needs_exact_int8
def test_every_step_runs_on_the_int8_graph_and_rows_do_not_see_each_other(w4, tiny_dense, monkeypatch, caplog):
    import torch
    from transformers import AutoModelForCausalLM

    bundle = w4()
    monkeypatch.setenv(DECODE_GRAPH_ENV, "int8")
    opened = []
    real_open = onnxruntime_backend.open_session
    monkeypatch.setattr(onnxruntime_backend, "open_session",
                        lambda ort, path, *a, **kw: opened.append(path.name) or real_open(ort, path, *a, **kw))
    with caplog.at_level("INFO", logger="lineside.runtime"):
        be = OnnxRuntimeBackend(bundle, num_slots=4)
    assert any("every step runs on the bundle's int8 graph" in r.getMessage() for r in caplog.records)  # said once
    # the int8 graph is the one session: the 4-bit graph is not even loaded
    assert opened == ["model.prefill.onnx"] and be.prefill_session is None
    batched, last, pasts = prompts_then_one_batched_step(be)
    for slot in range(4):  # the same step alone rewrites the same cache entry: its logits are the batch row's
        alone = decode_step(be, [slot], [last[slot]], [pasts[slot]])
        assert np.array_equal(alone[0], batched[slot]), slot

    model = AutoModelForCausalLM.from_pretrained(tiny_dense("llama-gqa"), dtype=torch.float32).eval()
    monkeypatch.delenv(DECODE_GRAPH_ENV)
    base = OnnxRuntimeBackend(bundle, num_slots=4)
    base.reset_slot(2)
    base.forward(StepBatch.single(2, PROMPTS[2][:-1], 0))
    base_logits = decode_step(base, [2], [last[2]], [pasts[2]])[0]
    assert not np.array_equal(base_logits, batched[2])  # the default decode graph is another one
    with torch.no_grad():
        ref = model(torch.tensor([PROMPTS[2]])).logits[0, -1].numpy()
    # int8 weights and rows: within 3% of float32, or of the 4-bit graph's own error plus int8 rounding
    assert rel_err(batched[2], ref) < max(0.03, rel_err(base_logits, ref) + 0.01)


def test_refusals_are_one_line(w4, tiny_bundles, monkeypatch):
    bundle = w4()
    monkeypatch.setenv(DECODE_GRAPH_ENV, "fp8")
    with pytest.raises(LinesideError, match=r"^LINESIDE_DECODE_GRAPH='fp8' is not a decode graph: use int8"):
        OnnxRuntimeBackend(bundle)
    monkeypatch.setenv(DECODE_GRAPH_ENV, "int8")
    with pytest.raises(LinesideError, match=r"this bundle has no int8 graph \(rebuild it with --prefill-graph\)"):
        OnnxRuntimeBackend(w4(prefill_graph=False))
    # where `build --prefill-graph` would refuse, the line does not send the user there
    with pytest.raises(LinesideError, match=r"has no int8 graph \(it is built for w4a16 and w8a16 bundles only, "
                                            r"not fp32\); unset LINESIDE_DECODE_GRAPH$"):
        OnnxRuntimeBackend(open_bundle(tiny_bundles(quant="fp32")))
    assert "Llama and Qwen2 models only, not deepseek_v4" in onnxruntime_backend.no_int8_graph_hint(
        "deepseek_v4", "w4a16", "cpu")
    assert "rebuild with --flavors cpu" in onnxruntime_backend.no_int8_graph_hint("llama", "w4a16", "trt")
    monkeypatch.setenv("LINESIDE_PREFILL_GRAPH", "0")
    with pytest.raises(LinesideError, match="ask for opposite graphs"):
        OnnxRuntimeBackend(bundle)
    monkeypatch.delenv("LINESIDE_PREFILL_GRAPH")
    monkeypatch.setattr(onnxruntime_backend, "host_int8_gemm_exact", lambda: False)
    with pytest.raises(LinesideError, match="saturates on this CPU"):
        OnnxRuntimeBackend(bundle)
    for default in ("4bit", "", "default"):
        monkeypatch.setenv(DECODE_GRAPH_ENV, default)
        assert OnnxRuntimeBackend(bundle).session_source is not None


@needs_exact_int8
def test_adapter_slots_are_refused(w4, monkeypatch):
    from lineside.runtime.lora_stack import LoraSlotsConfig

    bundle = w4(max_lora_rank=8)
    monkeypatch.setenv(DECODE_GRAPH_ENV, "int8")
    with pytest.raises(LinesideError, match="runs the base model only .* serve without --max-loras"):
        OnnxRuntimeBackend(bundle, lora=LoraSlotsConfig(max_loras=2, max_rank=8))


@needs_exact_int8
def test_a_draft_bundle_without_an_int8_graph_serves_beside_an_int8_target(w4, monkeypatch):
    """The mode is the served model's: a draft:BUNDLE built without an int8 graph (--no-prefill-graph, or at
    accuracy level 0) was refused as if the target lacked one. Greedy answers equal the mode's without drafts."""
    from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
    from tests.runtime.conftest import run
    from tests.runtime.test_speculative_model import engine_outputs, tiny_prompts

    target, draft = w4(), w4(prefill_graph=False)
    monkeypatch.setenv(DECODE_GRAPH_ENV, "int8")
    prompts, n = tiny_prompts(), 12
    plain, _ = run(engine_outputs(target.path, prompts, n, spec=None))
    spec = SpeculativeConfig(SpecMethod.DRAFT, 4, max_rows=8, draft_bundle=draft.path, draft_cost=0.0)
    got, st = run(engine_outputs(target.path, prompts, n, spec=spec))
    assert got == plain
    assert st.spec_accepted_tokens_total > 0  # the same weights: the draft's guesses are mostly the target's
