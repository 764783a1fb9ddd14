"""Speculative decoding on DeepSeek-V4 (whole-state tensors): a verification step advances the compressor
state, window and compressed entries over every token it feeds, so a row that keeps fewer gets its state put
back (saved before the step, restored, the kept tokens fed again). The state after a partly rejected step
equals plain decoding's, and greedy output with drafts equals plain output (engine and generate)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lineside.graph_io import StateUpdate
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from tests.runtime.fakes import ReferenceProposer


@pytest.fixture(scope="module")
def v4_bundle(v4, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle

    return build_bundle(v4.hf_dir("a"), tmp_path_factory.mktemp("v4spec") / "v4",
                        BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=64))


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[1, *rng.integers(3, 120, n).tolist()] for n in (9, 5, 13)]


def test_rewound_state_equals_plain_decoding(v4_bundle):
    from lineside.bundle import open_bundle
    from lineside.runtime.backend import StepBatch
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(v4_bundle)
    spec = OnnxRuntimeBackend(b, num_slots=2, threads=2)
    plain = OnnxRuntimeBackend(b, num_slots=2, threads=2)
    prompt = prompts()[0]
    for be in (spec, plain):
        be.forward(StepBatch.single(1, prompt, 0))
    fed = [7, 8, 9, 10]  # pending + 3 drafts; keep pending + 1 draft
    saved = spec.save_rows([1])
    spec.forward(StepBatch.single(1, fed, len(prompt), all_logits=True))
    whole = [s.input for s in spec.states if s.update == StateUpdate.REPLACE]
    assert whole and any(not np.array_equal(spec.arena[n][1], plain.arena[n][1]) for n in whole)
    spec.restore_rows(saved, 1)
    spec.forward(StepBatch.single(1, fed[:2], len(prompt)))
    for t in fed[:2]:
        plain.forward(StepBatch.single(1, [t], len(prompt) + fed.index(t)))
    for n in whole:
        np.testing.assert_allclose(spec.arena[n][1], plain.arena[n][1], rtol=1e-4, atol=1e-5)
    got = spec.forward(StepBatch.single(1, [11], len(prompt) + 2))
    np.testing.assert_allclose(got, plain.forward(StepBatch.single(1, [11], len(prompt) + 2)), rtol=1e-4, atol=1e-4)


def test_v4_greedy_with_drafts_equals_plain(v4_bundle):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.generate import Generator
    from lineside.runtime.request import GenerationRequest

    ps, n = prompts(), 20
    g = Generator(v4_bundle, threads=2)
    want = [list(g.stream(p, n)) for p in ps]
    refs = {tuple(p): w for p, w in zip(ps, want, strict=True)}

    async def engine(proposer):
        eng = LLMEngine(v4_bundle, backend="onnxruntime", threads=2, num_slots=3,
                        speculative=SpeculativeConfig(SpecMethod.NGRAM, 4, max_rows=8))
        eng.scheduler.proposer = proposer
        await eng.start()
        outs = await asyncio.gather(*(eng.submit(GenerationRequest(list(p), max_tokens=n)).result() for p in ps))
        st = eng.stats()
        await eng.stop()
        return [o[1] for o in outs], st

    got, st = asyncio.run(engine(ReferenceProposer(refs, 3, span=120, shift=5)))
    assert got == want
    assert 0 < st.spec_accepted_tokens_total < st.spec_draft_tokens_total
    g.speculative = SpeculativeConfig(SpecMethod.NGRAM, 4)
    assert [list(g.stream(p, n)) for p in ps[:1]] == want[:1]  # the real prompt-lookup proposer, one stream
