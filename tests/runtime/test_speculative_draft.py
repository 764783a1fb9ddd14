"""Model proposers on real graphs: a draft bundle (``draft:BUNDLE``) with its own KV kept in step with the
target's accepted length, and one with another tokenizer refused in one line; greedy output with the draft
equals plain decoding token for token at MatMulNBits accuracy level 0 (engine and generate)."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.errors import LinesideError
from lineside.runtime.backend import StepBatch
from lineside.runtime.generate import Generator
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.sampling import Sampler, SamplingParams
from lineside.runtime.speculative.config import DraftRow, SpecMethod, SpeculativeConfig
from lineside.runtime.speculative.draft_model import DraftModelProposer
from lineside.runtime.speculative.proposers import make_proposer
from tests.runtime.conftest import run
from tests.runtime.test_speculative_model import engine_outputs, tiny_prompts

LEVEL0 = dict(quant="w4a16", accuracy_level=0, group_size=32, max_seq_len=128)


@pytest.fixture(scope="module")
def target(tiny_bundles):
    return tiny_bundles(variant="llama-gqa", **LEVEL0)


@pytest.fixture(scope="module")
def small_draft(dense_checkpoint, tmp_path_factory):
    """Another random Llama (one layer, another seed) with the target's byte tokenizer: mostly wrong guesses."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    ckpt = dense_checkpoint("draft-llama-1layer", "llama", seed=5, num_hidden_layers=1, max_position_embeddings=256)
    return build_bundle(ckpt, tmp_path_factory.mktemp("draft") / "draft", BuildOptions(**LEVEL0))


def draft_cfg(path, k=4):
    """A draft model as big as the target never pays off (the adaptive rule would not speculate): count it free."""
    return SpeculativeConfig(SpecMethod.DRAFT, k, max_rows=8, draft_bundle=path, draft_cost=0.0)


@pytest.mark.parametrize("which", ["same-model", "small-draft"])
def test_draft_bundle_greedy_equals_plain(target, small_draft, which):
    draft = target if which == "same-model" else small_draft
    prompts, n = tiny_prompts(), 16
    g = Generator(target, threads=2)
    want = [list(g.stream(p, n)) for p in prompts]
    got, st = run(engine_outputs(target, prompts, n, spec=draft_cfg(draft)))
    assert got == want
    assert st.spec_draft_tokens_total > 0
    if which == "same-model":  # the target drafting for itself: every draft kept
        assert st.spec_accepted_tokens_total == st.spec_draft_tokens_total
    else:
        assert st.spec_accepted_tokens_total < st.spec_draft_tokens_total
    g.speculative = draft_cfg(draft)
    assert [list(g.stream(p, n)) for p in prompts] == want
    assert g.drafted > 0


def test_draft_kv_follows_the_accepted_length(target, small_draft):
    """Propose, keep only part of it, propose again: the same drafts (and q) as a fresh proposer that only ever
    saw the accepted text — the rejected positions' KV never leaks into later proposals."""
    b = open_bundle(small_draft)
    used = DraftModelProposer(OnnxRuntimeBackend(b, num_slots=2, threads=2), 300)
    rng = np.random.default_rng(2)
    text = [1, *rng.integers(3, 259, 9).tolist()]
    params = SamplingParams(temperature=0.9)  # unseeded: a seeded row drafts its top token, q None
    first = used.propose_rows([DraftRow(1, text, 4, Sampler(params), 1)])[0]
    assert len(first.tokens) == 4 and first.probs is not None and len(first.probs) == 4
    accepted = [*text, first.tokens[0], 77]  # one draft kept, then the target's own token
    again = used.propose_rows([DraftRow(1, accepted, 3, Sampler(SamplingParams()), 1)])[0]
    fresh = DraftModelProposer(OnnxRuntimeBackend(b, num_slots=2, threads=2), 300)
    want = fresh.propose_rows([DraftRow(1, accepted, 3, Sampler(SamplingParams()), 1)])[0]
    assert again.tokens == want.tokens and again.probs is None  # greedy: deterministic
    # a sampled draft reports q = the draft's own distribution at that position
    s1, s2 = Sampler(params), Sampler(params)
    d = fresh.propose_rows([DraftRow(0, accepted, 1, s1, 1)])[0]
    be = OnnxRuntimeBackend(b, num_slots=1, threads=2)  # as the proposer runs: the text a prompt, its last token a step
    be.forward(StepBatch.single(0, accepted[:-1], 0))
    logits = be.forward(StepBatch.single(0, accepted[-1:], len(accepted) - 1))[0, -1]
    np.testing.assert_allclose(d.probs[0], s2.distribution(logits, accepted, 1), rtol=1e-5, atol=1e-7)


def test_a_draft_with_fewer_logit_rows_reads_the_targets_tokens(target, dense_checkpoint, tmp_path_factory):
    """One tokenizer, two embedding sizes (R1-Distill-Qwen-1.5B: 151936 rows, -7B: 152064): a token the target
    emits or is prompted with past the draft's rows was fed to the draft's Gather, an onnxruntime traceback."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    ckpt = dense_checkpoint("draft-llama-vocab280", "llama", seed=6, vocab_size=280, num_hidden_layers=1,
                            max_position_embeddings=256)
    draft = build_bundle(ckpt, tmp_path_factory.mktemp("draft280") / "draft280", BuildOptions(**LEVEL0))
    prompts, n = [[1, 290, 17, 299, 5, 290, 17], *tiny_prompts()], 16
    g = Generator(target, threads=2)
    want = [list(g.stream(p, n)) for p in prompts]
    got, st = run(engine_outputs(target, prompts, n, spec=draft_cfg(draft)))
    assert got == want and st.spec_draft_tokens_total > 0
    used = DraftModelProposer(OnnxRuntimeBackend(open_bundle(draft), num_slots=1, threads=2), 300)
    (d,) = used.propose_rows([DraftRow(0, [1, 290, 17, 299], 3, Sampler(SamplingParams()), 1)])
    assert len(d.tokens) == 3 and all(t < 280 for t in d.tokens)


def test_draft_with_another_tokenizer_is_one_line(target, dense_checkpoint, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle

    ckpt = dense_checkpoint("draft-other-vocab", "llama", vocab_size=200, max_position_embeddings=256)
    other = build_bundle(ckpt, tmp_path_factory.mktemp("other") / "other", BuildOptions(**LEVEL0))
    be = OnnxRuntimeBackend(open_bundle(target), num_slots=1, threads=1)
    with pytest.raises(LinesideError, match="tokenizer differs") as e:
        make_proposer(draft_cfg(other), open_bundle(target), be)
    assert "\n" not in str(e.value)
    for spec, words in ((SpeculativeConfig(SpecMethod.MTP), "no MTP module"),
                        (SpeculativeConfig(SpecMethod.LAYERSKIP, draft_layers=1), "--draft-layers 1")):
        with pytest.raises(LinesideError, match=words) as e:
            make_proposer(spec, open_bundle(target), be)
        assert "\n" not in str(e.value)


def test_qwen2_draft_and_seeded_sampling(tiny_bundles):
    """Qwen2 drafting for itself keeps every greedy token plain decoding gives; with sampling, a seeded request
    repeats exactly with a draft model's proposals (q drawn and verified on the request's own generator)."""
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest

    qwen = tiny_bundles(variant="qwen2-bias-tied", quant="w4a16", accuracy_level=0, group_size=32, max_seq_len=128,
                        flavors=("cpu",), draft_layers=(1,))
    prompts, n = tiny_prompts(2), 12
    g = Generator(qwen, threads=2)
    want = [list(g.stream(p, n)) for p in prompts]
    got, st = run(engine_outputs(qwen, prompts, n, spec=draft_cfg(qwen)))
    assert got == want and st.spec_accepted_tokens_total == st.spec_draft_tokens_total > 0

    async def sampled(bundle, draft):
        eng = LLMEngine(bundle, backend="onnxruntime", threads=2, num_slots=2, speculative=draft_cfg(draft))
        await eng.start()
        req = GenerationRequest(prompts[0], max_tokens=n, sampling=SamplingParams(temperature=0.8, seed=5))
        out = await eng.submit(req).result()
        st = eng.stats()
        await eng.stop()
        return out[1], st

    a, st = run(sampled(qwen, qwen))
    b, _ = run(sampled(qwen, qwen))
    assert a == b and st.spec_draft_tokens_total > 0
