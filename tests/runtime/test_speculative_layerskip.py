"""Layerskip self-speculation: `build --draft-layers N` writes the first-N-layers draft graph beside the full one,
reading the same weight data (no second copy); the draft runs on the target's own KV for those layers (exact:
the same positions, the same weights); greedy output with it equals plain decoding at accuracy level 0
(tiny Llama and Qwen2, cpu graph; the trt graph's append cache too)."""

from __future__ import annotations

import asyncio

import numpy as np
import onnx
import pytest

from lineside.bundle import DRAFT_GRAPHS, FlavorEntry, open_bundle
from lineside.runtime.backend import StepBatch
from lineside.runtime.generate import Generator
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from tests.runtime.conftest import run
from tests.runtime.test_speculative_model import engine_outputs, tiny_prompts

LAYERSKIP = SpeculativeConfig(SpecMethod.LAYERSKIP, 4, max_rows=8, draft_layers=1, draft_cost=0.0)


def layerskip_bundle(tiny_bundles, variant="llama-gqa", flavor="cpu", kv_dtype="fp16"):
    return tiny_bundles(variant=variant, quant="w4a16", accuracy_level=0, group_size=32 if flavor == "cpu" else 64,
                        max_seq_len=128, flavors=(flavor,), draft_layers=(1,),
                        **({} if kv_dtype == "fp16" else {"kv_dtype": kv_dtype}))


def test_draft_graph_shares_the_weight_data(tiny_bundles):
    path = layerskip_bundle(tiny_bundles)
    b = open_bundle(path)
    draft = b.flavor("cpu").extra[DRAFT_GRAPHS]["1"]
    assert draft["graph"] == "graphs/cpu/draft-1.onnx" and [s["input"] for s in draft["state"]] == \
        ["past_key.0", "past_value.0"]
    data = [rel for rel in b.manifest.files if rel.endswith(".data")]
    assert data == ["graphs/cpu/model.onnx.data"]  # one weight file for both graphs
    m = onnx.load(str(path / draft["graph"]), load_external_data=False)
    ext = [t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert ext and all({e.key: e.value for e in t.external_data}["location"] == "model.onnx.data" for t in ext)
    assert (path / draft["graph"]).stat().st_size < b.manifest.files["graphs/cpu/model.onnx"].size
    assert 0 < draft["weight_fraction"] < 1


@pytest.mark.parametrize(("flavor", "kv"), [("cpu", "fp16"), ("trt", "fp16"), ("trt", "int4")])
def test_draft_on_the_targets_kv_equals_the_draft_on_its_own(tiny_bundles, flavor, kv, monkeypatch):
    """The target computes the prompt; the draft, reading those layers' KV from the target, scores the next
    tokens exactly as the draft graph run on its own KV from scratch (int4: the scales and the fp16 sink
    entries shared too). The target's prompt runs on its 4-bit graph here, as the draft's own does: a served
    target computes prompts on its int8 prefill graph, and the draft reads those entries (they are the target's)."""
    monkeypatch.setenv("LINESIDE_PREFILL_GRAPH", "0")
    b = open_bundle(layerskip_bundle(tiny_bundles, flavor=flavor, kv_dtype=kv))
    entry = b.flavor(flavor).extra[DRAFT_GRAPHS]["1"]
    if kv == "int4":
        assert {s["input"] for s in entry["state"]} >= {"past_key.0", "past_key_scale.0", "past_sink.0"}
    target = OnnxRuntimeBackend(b, num_slots=2, threads=2, flavor=flavor)
    shared = OnnxRuntimeBackend.draft_of(target, b, entry, threads=2)
    own = OnnxRuntimeBackend(b, num_slots=2, threads=2, flavor=flavor,
                             entry=FlavorEntry.from_json_dict(entry))
    rng = np.random.default_rng(6)
    prompt, nxt = rng.integers(3, 259, 10).tolist(), rng.integers(3, 259, 3).tolist()
    target.forward(StepBatch.single(1, prompt, 0))
    got = [shared.forward(StepBatch.single(1, [t], len(prompt) + i))[0, 0] for i, t in enumerate(nxt)]
    own.forward(StepBatch.single(1, prompt, 0))
    want = [own.forward(StepBatch.single(1, [t], len(prompt) + i))[0, 0] for i, t in enumerate(nxt)]
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("variant", "flavor"), [("llama-gqa", "cpu"), ("qwen2-bias-tied", "cpu"), ("llama-gqa", "trt")])
def test_layerskip_greedy_equals_plain(tiny_bundles, variant, flavor):
    bundle = layerskip_bundle(tiny_bundles, variant, flavor)
    prompts, n = tiny_prompts(1), 16
    g = Generator(bundle, threads=2)
    want = [list(g.stream(p, n)) for p in prompts]
    got, st = run(engine_outputs(bundle, prompts, n, spec=LAYERSKIP))
    assert got == want
    assert st.spec_draft_tokens_total > 0 and st.spec_accepted_tokens_total > 0
    g.speculative = LAYERSKIP
    assert [list(g.stream(p, n)) for p in prompts] == want and g.drafted > 0


def test_a_draft_record_with_an_unknown_state_kind_is_one_line(tiny_bundles):
    """A draft graph record is read when --speculative layerskip uses it: a state kind this lineside does not know
    (a newer bundle) is one BundleError line, not a ValueError traceback."""
    from lineside.errors import BundleError

    b = open_bundle(layerskip_bundle(tiny_bundles))
    entry = dict(b.flavor("cpu").extra[DRAFT_GRAPHS]["1"])
    entry["state"] = [dict(entry["state"][0], update="banana")]
    target = OnnxRuntimeBackend(b, num_slots=1, threads=1, flavor="cpu")
    with pytest.raises(BundleError, match=r"layerskip draft graph record is incomplete or from a newer lineside.*"
                                          r"rebuild the bundle") as e:
        OnnxRuntimeBackend.draft_of(target, b, entry, threads=1)
    assert "\n" not in str(e.value) and "banana" in str(e.value)


async def _seeded_outputs(bundle, prompts, n, spec):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest
    from lineside.runtime.sampling import SamplingParams

    eng = LLMEngine(bundle, backend="onnxruntime", threads=2, num_slots=3, speculative=spec)
    await eng.start()
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    outs = await asyncio.gather(*(eng.submit(GenerationRequest(list(p), max_tokens=n, sampling=sampling)).result()
                                  for p in prompts))
    st = eng.stats()
    await eng.stop()
    return [o[1] for o in outs], st


def test_seeded_sampling_with_a_model_draft_gives_the_plain_tokens(tiny_bundles):
    """A seeded request is reproducible with a draft model too: its drafts are the draft's pick under the row's
    settings (no draw from the row's generator), verified by drawing as plain decoding does. A sampled draft
    spent the row's generator, so the text changed with whether a step speculated (the batch's width)."""
    bundle = layerskip_bundle(tiny_bundles)
    prompts, n = tiny_prompts(1), 24
    want, _ = run(_seeded_outputs(bundle, prompts, n, None))
    got, st = run(_seeded_outputs(bundle, prompts, n, LAYERSKIP))
    assert st.spec_draft_tokens_total > 0
    assert got == want
