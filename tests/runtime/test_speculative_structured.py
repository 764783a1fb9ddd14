"""Speculative decoding under a grammar: drafts are cut where the grammar rejects one, each kept draft advances
the matcher (rolled back after the step), and constrained greedy output with drafts equals constrained output
without them at MatMulNBits accuracy level 0 — as do logprobs — while every output still matches its grammar."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import numpy as np
import pytest

from lineside.runtime.engine import LLMEngine
from lineside.runtime.generate import Generator
from lineside.runtime.request import FinishReason, GenerationRequest
from lineside.runtime.sampling import Sampler, SamplingParams
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from lineside.runtime.speculative.verify import verify_drafts
from lineside.runtime.structured import Constraint, GrammarCompiler
from tests.runtime.conftest import run
from tests.runtime.fakes import ReferenceProposer
from tests.tiny_tokenizer import write_byte_tokenizer

VOCAB, EOS = 300, 2
SCHEMA = {"type": "object", "properties": {
    "station": {"type": "string", "pattern": "^ST-[0-9]{2}$"},
    "defect": {"enum": ["scratch", "dent", "crack"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["station", "defect", "count", "tags", "ok"]}
REGEX = r"(ab|cd|ef){2,6}-[0-9]{3}"
CASES = [(Constraint.json_schema(SCHEMA), lambda s: jsonschema.validate(json.loads(s), SCHEMA)),
         (Constraint.regex(REGEX), lambda s: re.fullmatch(REGEX, s) or pytest.fail(f"{s!r} does not match")),
         (Constraint.choice(["press", "lathe", "robot arm"]),
          lambda s: s in ("press", "lathe", "robot arm") or pytest.fail(s))]
SPEC = SpeculativeConfig(SpecMethod.NGRAM, 4, max_rows=8)
MAX_TOKENS = 150  # room for the longest JSON the schema allows, one byte per token


@pytest.fixture(scope="module")
def byte_grammar(tmp_path_factory):
    from lineside.runtime.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, VOCAB)
    tok = Tokenizer(d, {"bos_token_id": 1, "eos_token_ids": [EOS]})
    return tok, GrammarCompiler.for_tokenizer(tok, VOCAB, [EOS])


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text)[1:]  # without BOS


def test_verify_masks_every_position_and_leaves_the_matcher_where_it_was(byte_grammar):
    tok, gc = byte_grammar
    m = gc.matcher(Constraint.regex("ab(c|d)x"))
    a, b, c, d, z = (_ids(tok, ch)[0] for ch in "abcdz")
    logits = np.zeros((4, VOCAB), dtype=np.float32)
    logits[0, a], logits[1, b] = 5.0, 5.0
    logits[2, z], logits[2, d], logits[2, c] = 9.0, 4.0, 3.0  # z is the model's pick, the grammar forbids it
    v = verify_drafts(Sampler(SamplingParams()), logits, [a, b, c], [1], 1, matcher=m, logprobs=2)
    assert (v.kept, v.token) == ([a, b], d)  # masked argmax at position 2 is d: the draft c is rejected
    assert [lp.token for lp in v.logprobs] == [a, b, d]
    assert {t for t, _ in v.logprobs[2].top} == {d, c} and v.logprobs[2].top[0][0] == d  # z is masked out
    assert m.allowed().nonzero()[0].tolist() == [a]  # rolled back to the start
    # all drafts kept: the bonus token is masked by the state after them
    logits[2, c] = 6.0
    logits[3, z], logits[3, _ids(tok, "x")[0]] = 9.0, 1.0
    v = verify_drafts(Sampler(SamplingParams()), logits, [a, b, c], [1], 1, matcher=m)
    assert (v.kept, v.token) == ([a, b, c], _ids(tok, "x")[0])
    assert m.validate([a, b, c]) == 3


def test_sampled_verification_never_emits_a_forbidden_token(byte_grammar):
    tok, gc = byte_grammar
    rng = np.random.default_rng(3)
    pattern = "[a-c]{8}"
    for seed in range(20):
        m = gc.matcher(Constraint.regex(pattern))
        s = Sampler(SamplingParams(temperature=1.5, seed=seed))
        drafts = _ids(tok, "abcabc")[:int(rng.integers(1, 6))]
        v = verify_drafts(s, rng.normal(size=(len(drafts) + 1, VOCAB)).astype(np.float32), drafts, [1], 1, matcher=m)
        assert re.fullmatch("[a-c]+", tok.decode([*v.kept, v.token]))


def _engine(bundle, spec, proposer=None):
    eng = LLMEngine(bundle, backend="onnxruntime", threads=2, num_slots=4, speculative=spec)
    if proposer is not None:
        eng.scheduler.proposer = proposer
    return eng


async def _outputs(eng, reqs):
    await eng.start()
    try:
        handles = [eng.submit(r) for r in reqs]
        events = await asyncio.gather(*(_events(h) for h in handles))
        return events, eng.stats()
    finally:
        await eng.stop()


async def _events(handle):
    return [ev async for ev in handle]


def _requests(prompts, *, logprobs=None, sampling=None):
    return [GenerationRequest(prompt_ids=list(p), max_tokens=MAX_TOKENS, constraint=c, logprobs=logprobs,
                              sampling=sampling or SamplingParams())
            for p in prompts for c, _ in CASES]


def _tokens(events):
    return [t for ev in events for t in ev.token_ids]


@pytest.fixture(scope="module")
def level0(tiny_bundles):
    return tiny_bundles(quant="w4a16", accuracy_level=0, group_size=32, max_seq_len=256)


@pytest.fixture(scope="module")
def prompts(level0):
    g = Generator(level0, threads=2)
    tok = g.tokenizer
    return [tok.encode("station ST-04 reported a dent, station ST-04 reported"), tok.encode("abcdabcd-12")]


def test_constrained_greedy_with_drafts_equals_plain(level0, prompts):
    plain, _ = run(_outputs(_engine(level0, None), _requests(prompts, logprobs=2)))
    for got in plain:
        assert got[-1].finish_reason == FinishReason.STOP
    texts = ["".join(ev.text for ev in evs) for evs in plain]
    for (_c, check), text in zip(CASES * len(prompts), texts, strict=True):
        check(text)
    refs = {}
    for p, i in zip([p for p in prompts for _ in CASES], range(len(plain)), strict=True):
        refs.setdefault(tuple(p), _tokens(plain[i]))  # the JSON row's continuation: drafts for every row of p
    for proposer in (ReferenceProposer(refs, 3), None):  # corrupted reference drafts, then prompt lookup
        got, st = run(_outputs(_engine(level0, SPEC, proposer), _requests(prompts, logprobs=2)))
        assert [_tokens(e) for e in got] == [_tokens(e) for e in plain]
        assert st.spec_accepted_tokens_total > 0
        for g_evs, p_evs in zip(got, plain, strict=True):  # logprobs exact too: the same numbers as 1-token steps
            g_lp = [lp for ev in g_evs for lp in ev.logprobs]
            p_lp = [lp for ev in p_evs for lp in ev.logprobs]
            assert [lp.token for lp in g_lp] == [lp.token for lp in p_lp]
            np.testing.assert_allclose([lp.logprob for lp in g_lp], [lp.logprob for lp in p_lp], atol=1e-4)
            assert [[t for t, _ in lp.top] for lp in g_lp] == [[t for t, _ in lp.top] for lp in p_lp]
    # no logprobs asked: the same tokens still
    got, st = run(_outputs(_engine(level0, SPEC, ReferenceProposer(refs, 1000)), _requests(prompts)))
    assert [_tokens(e) for e in got] == [_tokens(e) for e in plain] and st.spec_accepted_tokens_total > 0


def test_generator_speculates_under_a_grammar_with_the_plain_tokens(level0, prompts):
    plain, spec = Generator(level0, threads=2), Generator(level0, threads=2, speculative=SPEC)
    gc = GrammarCompiler.for_tokenizer(plain.tokenizer, plain.backend.vocab_size, plain.eos_ids)
    drafted = 0
    for c, check in CASES:
        want = list(plain.stream(prompts[0], MAX_TOKENS, matcher=gc.matcher(c)))
        got = list(spec.stream(prompts[0], MAX_TOKENS, matcher=gc.matcher(c)))
        assert got == want
        check(plain.tokenizer.decode(got))
        drafted += spec.drafted
    assert drafted > 0


def test_sampled_constrained_rows_with_drafts_match_their_grammar(level0, prompts):
    hot = SamplingParams(temperature=1.0, seed=11)
    got, st = run(_outputs(_engine(level0, SPEC), _requests(prompts, sampling=hot) + _requests(prompts, sampling=hot)))
    for (_c, check), evs in zip(CASES * len(prompts) * 2, got, strict=True):
        assert evs[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if evs[-1].finish_reason == FinishReason.STOP:
            check("".join(ev.text for ev in evs))
    assert st.spec_draft_tokens_total > 0


def test_a_sampled_draft_the_grammar_forbids_is_rejected_by_the_rule_not_dropped(byte_grammar):
    """A draft model draws from its own q, blind to the grammar: here q = ½ 'a' (allowed) + ½ 'c' (forbidden)
    and the masked p = ½ 'a' + ½ 'b'. Dropping the forbidden draft and sampling p there instead gives 'a' ¾ of
    the time (½ kept + ½ · ½ sampled); scored as a draft with p = 0 it is rejected and the residual
    max(0, p - q) = 'b' comes out, so the first token follows p."""
    from lineside.runtime.speculative.config import Draft
    from lineside.runtime.step_plan import StepPlan
    from lineside.runtime.step_runner import run_step
    from tests.runtime.test_speculative import CHI2_999, chi_square

    tok, gc = byte_grammar
    a, b, c = (_ids(tok, ch)[0] for ch in "abc")
    q = np.zeros(VOCAB)
    q[[a, c]] = 0.5
    draws = np.random.default_rng(5)  # the draft model's own draws

    class Row:  # what the step runner reads of a decoding sequence
        slot, pending, computed, adapter_slot, logprobs, samples, prompt = 0, 7, 3, 0, None, True, [1, 5, 6]

        def __init__(self):
            self.tokens, self.matcher = [*self.prompt, 7], gc.matcher(Constraint.regex("[ab]x"))
            self.sampler = Sampler(SamplingParams(temperature=1.0, seed=len(counts)))

    class Backend:
        def forward(self, batch):
            x = np.full((1, batch.input_ids.shape[1], VOCAB), -30.0, dtype=np.float32)
            x[0, :, [a, b]] = 0.0
            return x

    class Proposer:
        cheap = False

        def propose_rows(self, rows):
            return [Draft([int(draws.choice(VOCAB, p=q))], [q])]

    counts: list[int] = []
    for _ in range(4000):
        row = Row()
        out = run_step(Backend(), StepPlan(decode=[row], draft_budget={row: 1}), Proposer())
        counts.append([*out.accepted.get(row, []), out.sampled[row]][0])
    freq = np.array([counts.count(a), counts.count(b)], dtype=float)
    assert freq.sum() == len(counts)
    assert chi_square(freq, np.array([0.5, 0.5])) < CHI2_999[1]
