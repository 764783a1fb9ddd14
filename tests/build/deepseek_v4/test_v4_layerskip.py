"""Layerskip on DeepSeek-V4: `build --draft-layers N` writes the first N layers + the hyper-connection head
collapse + final norm + LM head beside the full graph, reading the same weight data. Its logits are
transformers' model cut to its first N layers; drafting on the target's own state leaves that state exactly
as it was (the window and compressor state are put back); greedy output with `layerskip:N` is plain
decoding's, token for token (W4A16, accuracy level 0)."""

from __future__ import annotations

import asyncio

import numpy as np
import onnx
import pytest

from lineside.bundle import DRAFT_GRAPHS, FlavorEntry, open_bundle
from lineside.runtime.backend import StepBatch
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.speculative.config import DraftRow, SpecMethod, SpeculativeConfig
from tests.build.deepseek_v4.helpers import V4Runner, fake_quant_model, reference, rel_err, token_ids

DRAFT = 2  # of schedule a's 3 layers: sliding, then compressed sparse (compressor + indexer state)
MAX_SEQ = 64
LAYERSKIP = SpeculativeConfig(SpecMethod.LAYERSKIP, 3, max_rows=8, draft_layers=DRAFT, draft_cost=0.0)


@pytest.fixture(scope="module")
def v4_draft_bundle(v4, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle

    return build_bundle(v4.hf_dir("a"), tmp_path_factory.mktemp("v4skip") / "v4",
                        BuildOptions(quant="w4a16", group_size=64, accuracy_level=0, flavors=("cpu",),
                                     max_seq_len=MAX_SEQ, draft_layers=(DRAFT,)))


def test_v4_draft_graph_is_the_first_layers_then_the_head(v4_draft_bundle):
    """The draft graph = transformers' DeepseekV4ForCausalLM with only its first N layers (model.layers cut,
    the same hc_head, norm and lm_head after them), the same RTN-rounded weights, float32."""
    b = open_bundle(v4_draft_bundle)
    flavor, tol = "cpu", 1e-4
    entry = b.flavor(flavor).extra[DRAFT_GRAPHS][str(DRAFT)]
    assert entry["graph"] == f"graphs/{flavor}/draft-{DRAFT}.onnx" and entry["inputs"] == \
        ["input_ids", "past_lengths", "logits_positions"]
    assert {s["input"].split(".")[1] for s in entry["state"]} == {str(i) for i in range(DRAFT)}
    assert [rel for rel in b.manifest.files if rel.endswith(".data") and f"/{flavor}/" in rel] == \
        [f"graphs/{flavor}/model.onnx.data"]
    m = onnx.load(str(v4_draft_bundle / entry["graph"]), load_external_data=False)
    ext = [t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert ext and all({e.key: e.value for e in t.external_data}["location"] == "model.onnx.data" for t in ext)
    assert 0 < entry["weight_fraction"] < 1

    model = fake_quant_model("a", 64, flavor)
    model.model.layers = model.model.layers[:DRAFT]
    model.config.num_hidden_layers = DRAFT
    ids = token_ids()
    ref, gap = reference(model, ids)
    assert gap > 1e-4  # the indexer's top-k does not cut inside a tie
    runner = V4Runner(v4_draft_bundle / entry["graph"], FlavorEntry.from_json_dict(entry), max_seq=MAX_SEQ)
    logits, _ = runner.prefill(ids)
    assert rel_err(logits[0], ref) < tol
    full, _ = reference(fake_quant_model("a", 64, flavor), ids)
    assert rel_err(full, ref) > 1e-2  # the cut is not the whole model


def _prompt() -> list[int]:
    return [1, *np.random.default_rng(5).integers(3, 120, 11).tolist()]


def test_v4_draft_leaves_the_targets_state_as_it_was(v4_draft_bundle):
    """The draft runs on the target's own state for its layers; afterwards every state tensor is bit for bit
    what it was (with the restore disabled the draft's tokens stay in the window and compressor state)."""
    from lineside.runtime.sampling import Sampler, SamplingParams
    from lineside.runtime.speculative.proposers import make_proposer

    b = open_bundle(v4_draft_bundle)
    target = OnnxRuntimeBackend(b, num_slots=2, threads=2, flavor="cpu")
    proposer = make_proposer(LAYERSKIP, b, target, threads=2)
    assert proposer.restores_state
    prompt = _prompt()
    target.forward(StepBatch.single(1, prompt[:-1], 0))
    before = {k: v.copy() for k, v in target.arena.items()}
    row = DraftRow(1, prompt, 3, Sampler(SamplingParams()), len(prompt))
    assert len(proposer.propose_rows([row])[0].tokens) == 3
    assert all(np.array_equal(target.arena[k], v) for k, v in before.items())
    proposer.restores_state = False
    proposer.propose_rows([row])
    changed = [k for k, v in before.items() if not np.array_equal(target.arena[k], v)]
    assert changed and all(int(k.split(".")[1]) < DRAFT for k in changed)


def test_v4_layerskip_greedy_equals_plain(v4_draft_bundle):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.generate import Generator
    from lineside.runtime.request import GenerationRequest

    rng = np.random.default_rng(12)
    prompts, n = [_prompt(), [1, *rng.integers(3, 120, 6).tolist()]], 16
    g = Generator(v4_draft_bundle, threads=2)
    want = [list(g.stream(p, n)) for p in prompts]

    async def engine():
        eng = LLMEngine(v4_draft_bundle, backend="onnxruntime", threads=2, num_slots=2, speculative=LAYERSKIP)
        await eng.start()
        outs = await asyncio.gather(*(eng.submit(GenerationRequest(list(p), max_tokens=n)).result() for p in prompts))
        st = eng.stats()
        await eng.stop()
        return [o[1] for o in outs], st

    got, st = asyncio.run(engine())
    assert got == want
    assert 0 < st.spec_accepted_tokens_total < st.spec_draft_tokens_total  # kept and rejected drafts both
    g.speculative = LAYERSKIP
    drafted = accepted = 0
    for p, w in zip(prompts, want, strict=True):
        assert list(g.stream(p, n)) == w
        drafted, accepted = drafted + g.drafted, accepted + g.accepted
    assert drafted > accepted > 0


def test_v4_draft_of_every_layer_is_one_line(v4, tmp_path):
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.errors import LinesideError

    with pytest.raises(LinesideError, match=r"--draft-layers 3: a draft needs 1 to 2 of the model's 3 layers"):
        build_bundle(v4.hf_dir("a"), tmp_path / "v4", BuildOptions(quant="fp32", flavors=("cpu",), draft_layers=(3,)))
    assert not (tmp_path / "v4").exists()
