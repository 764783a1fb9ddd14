"""Speculative decoding: the proposer, the verification rule (greedy and sampled), the adaptive draft length,
and the scheduler/engine path on the fake backend (max_tokens, stop strings, mixed rows, KV positions)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lineside.errors import LinesideError
from lineside.runtime.engine import LLMEngine
from lineside.runtime.request import FinishReason, GenerationRequest
from lineside.runtime.sampling import Sampler, SamplingParams
from lineside.runtime.speculative.adaptive import DraftLength
from lineside.runtime.speculative.config import (
    MAX_SPEC_TOKENS,
    SpecMethod,
    SpeculativeConfig,
    parse_speculative,
)
from lineside.runtime.speculative.ngram import NgramProposer
from lineside.runtime.speculative.verify import verify
from tests.runtime.conftest import run
from tests.runtime.fakes import FakeBackend, submit_after

NGRAM = SpeculativeConfig(SpecMethod.NGRAM, 4)


# ---- proposer and config --------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(max_n=3, min_n=2)
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7, 4, 4, 5, 6, 7]
    assert p.propose(toks, 3) == [4, 4, 5]  # latest earlier "5 6 7" is followed by 4 4 5
    assert p.propose(toks, 1) == [4]
    assert p.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert p.propose([9, 9], 2) == []  # too short for a 2-gram with something after it
    assert p.propose([9, 9, 9], 2) == [9]  # the overlapping match: what followed is the last token
    assert NgramProposer(max_n=2, min_n=1).propose([3, 1, 2, 3], 2) == [1, 2]
    assert p.propose(toks, 0) == []


def test_parse_speculative_one_line_errors(tiny_bundle, tmp_path):
    assert parse_speculative(None) is None
    cfg = parse_speculative("ngram", 5)
    assert cfg == SpeculativeConfig(SpecMethod.NGRAM, 5)
    assert parse_speculative("layerskip:3") == SpeculativeConfig(SpecMethod.LAYERSKIP, 8, draft_layers=3)
    assert parse_speculative(f"draft:{tiny_bundle}", 2) == SpeculativeConfig(SpecMethod.DRAFT, 2,
                                                                              draft_bundle=tiny_bundle)
    assert parse_speculative("mtp").label == "mtp" and parse_speculative("layerskip:2").label == "layerskip:2"
    for method, k, words in (("medusa", 4, "not a known method"), ("ngram", 0, "between 1 and 16"),
                             ("ngram", MAX_SPEC_TOKENS + 1, "between 1 and 16"), ("layerskip", 4, "layerskip:N"),
                             ("layerskip:0", 4, "N ≥ 1"), ("layerskip:x", 4, "layerskip:N"),
                             ("layerskip:²", 4, "layerskip:N"), ("layerskip:-1", 4, "layerskip:N"),
                             ("draft:", 4, "draft:BUNDLE"), (f"draft:{tmp_path}", 4, "not a bundle directory"),
                             ("ngram:3", 4, "takes no argument"), (None, 4, "needs --speculative")):
        with pytest.raises(LinesideError, match=words) as e:
            parse_speculative(method, k)
        assert "\n" not in str(e.value)


# ---- verification rule ----------------------------------------------------------------------------
def onehot_logits(tokens: list[int], vocab: int = 8) -> np.ndarray:
    x = np.full((len(tokens), vocab), -5.0, dtype=np.float32)
    x[np.arange(len(tokens)), tokens] = 5.0
    return x


def test_greedy_verify_keeps_the_agreeing_prefix_and_adds_the_models_token():
    s = Sampler(SamplingParams())
    model = [3, 4, 5, 6]  # the argmax after history, +d1, +d1d2, +d1d2d3
    assert verify(s, onehot_logits(model), [3, 4, 5], [1], 1) == ([3, 4, 5], 6)  # all kept, bonus
    assert verify(s, onehot_logits(model), [3, 7, 5], [1], 1) == ([3], 4)  # first mismatch ends it
    assert verify(s, onehot_logits(model), [0, 4, 5], [1], 1) == ([], 3)


def test_verify_sees_the_drafts_in_the_penalty_history():
    s = Sampler(SamplingParams(repetition_penalty=100.0))
    x = np.zeros((2, 8), dtype=np.float32)
    x[:, 3], x[:, 4] = 2.0, 1.0  # 3 wins unless it was already generated
    assert verify(s, x, [3], [1], 1) == ([3], 4)  # after keeping 3, the penalty turns the bonus to 4


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical values at p = 0.001 (df = vocab - 1): a correct rule fails once in a thousand seeds,
# a wrong one (e.g. accepting the draft always, or sampling the residual from p unmodified) fails by far.
CHI2_999 = {1: 10.83, 3: 16.27, 4: 18.47, 9: 27.88}


def test_verify_holds_stop_tokens_back_until_min_tokens_at_every_position():
    """vLLM's min_tokens in the verify path: each position masks the stop tokens while the tokens generated before
    it (the kept drafts included) are fewer than min_tokens, so a proposed EOS is never kept early."""
    x = onehot_logits([2, 2, 2])  # the model's unmasked choice is EOS (2) everywhere; 6 is the runner-up
    x[:, 6] = 1.0
    held = Sampler(SamplingParams(min_tokens=2), stop_ids={2})
    assert verify(held, x, [6, 2], [1], 1) == ([6], 6)  # position 1 follows one generated token: EOS still held
    assert verify(held, x, [6, 6], [1], 1) == ([6, 6], 2)  # the bonus follows two: EOS allowed
    assert verify(Sampler(SamplingParams()), x, [6, 2], [1], 1) == ([], 2)
    sampled = Sampler(SamplingParams(temperature=1.0, seed=0, min_tokens=2), stop_ids={2})
    assert all(2 not in [*kept, tok] for kept, tok in (verify(sampled, x, [2, 2], [1], 1) for _ in range(100)))


def test_sampled_verify_keeps_the_models_distribution():
    """The first emitted token (accepted draft or residual sample) and the second (after a kept first draft)
    follow the model's p exactly, for a draft the model finds likely and one it finds unlikely."""
    p1 = np.array([0.1, 0.4, 0.2, 0.25, 0.05])
    p2 = np.array([0.3, 0.05, 0.15, 0.2, 0.3])
    logits = np.log(np.stack([p1, p2, p1])).astype(np.float32)
    n = 40000
    for draft in ([1, 4], [4, 0]):
        s = Sampler(SamplingParams(temperature=1.0, seed=7))
        first = np.zeros(5)
        second = np.zeros(5)
        for _ in range(n):
            kept, tok = verify(s, logits, draft, [9], 1)
            out = [*kept, tok]
            first[out[0]] += 1
            if len(out) > 1:
                second[out[1]] += 1
        assert chi_square(first, p1) < CHI2_999[4], (draft, first / n)
        assert chi_square(second, p2) < CHI2_999[4], (draft, second / second.sum())
        assert abs(first[draft[0]] / n - p1[draft[0]]) < 0.01


def test_sampled_verify_with_a_draft_distribution_keeps_the_models_distribution():
    """Drafts drawn from a draft model's q (not the model's p): accept min(1, p/q), residual max(0, p - q) —
    the first and second emitted tokens follow p, and the first draft is kept at the rule's rate Σ min(p, q)
    (0.45 here; the q = 1 rule, also lossless for any draft, keeps only Σ q·p = 0.145)."""
    p1 = np.array([0.1, 0.4, 0.2, 0.25, 0.05])
    p2 = np.array([0.3, 0.05, 0.15, 0.2, 0.3])
    q1 = np.array([0.5, 0.1, 0.1, 0.1, 0.2])  # far from p1: many rejections, residual mass matters
    q2 = np.array([0.05, 0.3, 0.3, 0.3, 0.05])
    logits = np.log(np.stack([p1, p2, p1])).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    draw = np.random.default_rng(19)  # the draft model's own draws
    n = 40000
    first, second = np.zeros(5), np.zeros(5)
    kept_first = 0
    for _ in range(n):
        drafts = [int(draw.choice(5, p=q1)), int(draw.choice(5, p=q2))]
        kept, tok = verify(s, logits, drafts, [9], 1, [q1, q2])
        kept_first += bool(kept)
        out = [*kept, tok]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi_square(first, p1) < CHI2_999[4], first / n
    assert chi_square(second, p2) < CHI2_999[4], second / second.sum()
    assert abs(kept_first / n - np.minimum(p1, q1).sum()) < 0.01


def test_sampled_verify_with_top_k_and_temperature_matches_plain_sampling():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 25)).astype(np.float32) * 2
    params = SamplingParams(temperature=0.7, top_k=10, seed=11)
    want = Sampler(params).distribution(logits[0], [1], 1)
    s = Sampler(params)
    draft = int(np.argsort(-want)[2])  # the third most likely token
    counts = np.zeros(25)
    for _ in range(30000):
        kept, tok = verify(s, logits, [draft], [1], 1)
        counts[(kept or [tok])[0]] += 1
    assert counts[want == 0].sum() == 0  # nothing outside top-k ever comes out
    keep = want > 0
    assert keep.sum() == 10
    assert chi_square(counts[keep], want[keep]) < CHI2_999[9]


class _ScriptedDraft:
    """A draft backend whose step i's logits are ``rows[i]`` (one row, own KV)."""

    def __init__(self, rows):
        self.rows, self.calls, self.max_seq_len, self.vocab_size = rows, 0, 64, rows[0].shape[0]

    def reset_slot(self, slot):
        pass

    def forward(self, batch):
        if batch.input_ids.shape[1] > 1:  # the catch-up prefill: its logits are not read
            return np.zeros((1, 1, self.vocab_size), np.float32)
        self.calls += 1
        return self.rows[self.calls - 1][None, None]


def test_top_k_one_draft_reports_q_at_every_position_when_the_draft_ties_at_one():
    """top_k 1 with a temperature samples among tokens tied at the top: a draft model whose top is unique at one
    position and tied at the next drew deterministically, then from q. Its q list had one entry for two drafts,
    so verification read q of the wrong draft, or past the list (IndexError: the engine step failed)."""
    from lineside.runtime.speculative.config import DraftRow
    from lineside.runtime.speculative.draft_model import DraftModelProposer

    unique = np.array([0.0, 3.0, 1.0, 0.0], np.float32)
    tied = np.array([0.0, 2.0, 2.0, 0.0], np.float32)
    params = SamplingParams(temperature=0.8, top_k=1)  # unseeded: a seeded row reports no q
    proposer = DraftModelProposer(_ScriptedDraft([unique, tied]), 4)
    d = proposer.propose_rows([DraftRow(0, [3, 0, 1], 2, Sampler(params), 1)])[0]
    assert d.tokens[0] == 1 and d.tokens[1] in (1, 2)
    assert d.probs is not None and len(d.probs) == 2 and list(d.probs[0]) == [0, 1, 0, 0]
    target = np.stack([unique, tied, unique])  # the target as the draft: the first draft is kept, q read for both
    kept, _ = verify(Sampler(params), target, d.tokens, [3, 0, 1], 1, d.probs)
    assert kept == d.tokens


# ---- adaptive draft length ------------------------------------------------------------------------
def test_draft_length_drops_to_zero_below_the_verify_cost_and_comes_back():
    dl = DraftLength(8, verify_cost=2.0)
    assert dl.k == 8  # optimistic start
    for _ in range(6):
        dl.observe(dl.k or 1, 0)  # every first draft rejected
    assert dl.k == 0 and dl.expected_tokens(8) < 2.0
    for _ in range(6):
        dl.observe(1, 1)  # shadow guesses at k = 0 keep matching
    assert dl.k == 8 and dl.expected_tokens(8) >= 2.0
    mixed = DraftLength(4, verify_cost=2.0)
    for _ in range(30):
        mixed.observe(4, 1)  # one kept then a rejection: a = 0.5, E(4) = 1.94 < 2
    assert mixed.k == 0
    costly = DraftLength(4, verify_cost=1.2, draft_cost=0.3)  # a model proposer: no shadow guesses at k = 0
    assert costly.k > 0
    while costly.k:
        costly.observe(costly.budget(cheap=False), 0)
    probes = []
    for step in range(300):
        if costly.budget(cheap=False):
            probes.append(step)
            costly.observe(1, 0)  # every probe fails: the interval doubles 16, 32, 64, 128, ...
    assert [b - a for a, b in zip(probes, probes[1:], strict=False)][:3] == [32, 64, 128]
    for _ in range(8):
        k = costly.budget(cheap=False)
        costly.observe(max(k, 1), max(k, 1))  # the text starts to match: back to speculating
    assert costly.k == 4
    free = DraftLength(4)  # a verification that costs no more than a decode step always speculates
    for _ in range(30):
        free.observe(4, 0)
    assert free.k == 4


def test_draft_length_follows_acceptance_when_each_token_costs():
    """With a per-token verification cost the best k grows with the acceptance instead of jumping 0 ↔ max."""
    def settled(kept_per_step: int, k: int = 8) -> DraftLength:
        dl = DraftLength(k, verify_cost=1.0, verify_token_cost=0.25)
        for _ in range(40):
            dl.observe(k, kept_per_step)  # n < k kept, then a rejection: a = n / (n + 1)
        return dl

    copy, often, mixed, poor = settled(8), settled(3), settled(1), settled(0)
    assert copy.k == 8 and 1 < often.k < 8 and 0 < mixed.k < often.k and poor.k == 0
    assert mixed.speedup(mixed.k) > 1.0 > mixed.speedup(8)  # long drafts at a = 0.5 would lose
    flat = DraftLength(8, verify_cost=2.5)
    for _ in range(40):
        flat.observe(8, 1)
    assert flat.k == 0  # a flat cost knows no short draft: at a = 0.5 it stops speculating altogether


def test_wide_steps_do_not_speculate_past_max_rows(tiny_bundle):
    reqs = reqs_for(PROMPTS, 10)
    reqs[-1] = GenerationRequest(prompt_ids=list(PROMPTS[-1]), max_tokens=30)  # runs on alone after the others
    spec, st, be = run(generate(tiny_bundle, reqs, spec=SpeculativeConfig(SpecMethod.NGRAM, 4, max_rows=1),
                                slots=5, wrong=1000))
    assert all(len(new) == 1 or max(new) == 1 for _, _, new in be.calls)  # several rows: one token each
    assert st.spec_accepted_tokens_total > 0  # the last row alone still speculates


# ---- scheduler and engine on the fake backend -----------------------------------------------------
class ScriptProposer:
    """Proposes the fake backend's own greedy continuation, with every ``wrong``-th proposed token corrupted:
    so steps keep all, some or none of their drafts."""

    cheap = True

    def __init__(self, be: FakeBackend, wrong: int = 3):
        self.be, self.wrong, self.count = be, wrong, 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        seq, out = list(tokens), []
        for _ in range(k):
            t = int(np.argmax(self.be.logits(seq)))
            self.count += 1
            if self.count % self.wrong == 0:
                t = 3 + (t + 1) % 200
            out.append(t)
            seq.append(t)
        return out


async def generate(bundle, reqs, *, spec: SpeculativeConfig | None, slots=3, wrong=3, **kw):
    be = FakeBackend(slots, max_seq_len=kw.pop("max_seq_len", 128))
    eng = LLMEngine(bundle, backend=be, speculative=spec, **kw)
    if spec is not None:
        eng.scheduler.proposer = ScriptProposer(be, wrong)
    await eng.start()
    outs = await asyncio.gather(*(eng.submit(r).result() for r in reqs))
    st = eng.stats()
    await eng.stop()
    return outs, st, be


def reqs_for(prompts, n, **kw):
    return [GenerationRequest(prompt_ids=list(p), max_tokens=n + i, **kw) for i, p in enumerate(prompts)]


PROMPTS = [[1, 5 + i] + list(range(10 + i, 10 + i + 3 * i)) for i in range(5)]


@pytest.mark.parametrize("wrong", [2, 3, 1000])
def test_fake_greedy_with_drafts_equals_plain_and_never_overshoots(tiny_bundle, wrong):
    plain, _, _ = run(generate(tiny_bundle, reqs_for(PROMPTS, 9), spec=None))
    spec, st, be = run(generate(tiny_bundle, reqs_for(PROMPTS, 9), spec=NGRAM, wrong=wrong))
    assert [o[1] for o in spec] == [o[1] for o in plain]
    for i, o in enumerate(spec):
        assert o[2].completion_tokens <= 9 + i
    assert st.spec_draft_tokens_total > 0 and 0 < st.spec_accepted_tokens_total <= st.spec_draft_tokens_total
    assert any(max(new) > 1 for _, _, new in be.calls)  # multi-token verification steps ran
    assert any(max(new) > 1 and min(new) == 1 for _, _, new in be.calls) or wrong == 1000


def test_requests_without_speculation_share_steps_with_speculating_ones(tiny_bundle):
    reqs = reqs_for(PROMPTS, 10)
    for r in reqs[::2]:
        r.speculative = False
    plain, _, _ = run(generate(tiny_bundle, reqs_for(PROMPTS, 10), spec=None))
    spec, st, be = run(generate(tiny_bundle, reqs, spec=NGRAM, slots=5, wrong=1000))
    assert [o[1] for o in spec] == [o[1] for o in plain]
    mixed = [new for _, _, new in be.calls if len(new) > 1 and max(new) > 1 and min(new) == 1]
    assert mixed  # one step carried rows with and without drafts
    assert st.spec_accepted_tokens_total == st.spec_draft_tokens_total  # a perfect proposer


def test_min_tokens_rejects_proposed_eos_and_equals_plain_decoding(tiny_bundle):
    """vLLM's min_tokens with speculation: the proposer offers the model's unmasked greedy continuation, EOS
    right after each script; verification masks it at every position below min_tokens, so the batch gets
    exactly the tokens plain decoding gives (and the proposals of EOS are dropped)."""
    scripts = {(1, 40, 41): "abc", (1, 50, 51): "abcdef", (1, 60, 61): "a"}

    def reqs():
        return [GenerationRequest(prompt_ids=list(p), max_tokens=12, sampling=SamplingParams(min_tokens=m))
                for p, m in zip(scripts, (5, 8, 0), strict=True)]

    async def main(spec):
        be = FakeBackend(3)
        eng = LLMEngine(tiny_bundle, backend=be, speculative=spec)
        for prompt, text in scripts.items():
            be.scripts[prompt] = eng.tokenizer.encode(text, add_special=False)
        if spec is not None:
            eng.scheduler.proposer = ScriptProposer(be, 1000)
        await eng.start()
        outs = await asyncio.gather(*(eng.submit(r).result() for r in reqs()))
        st = eng.stats()
        await eng.stop()
        return outs, st

    plain, _ = run(main(None))
    spec, st = run(main(NGRAM))
    assert [o[1] for o in spec] == [o[1] for o in plain]
    assert [len(o[1]) for o in spec] == [5, 8, 1] and all(2 not in o[1] for o in spec)
    assert all(o[2].finish_reason == "stop" for o in spec)
    assert st.spec_accepted_tokens_total < st.spec_draft_tokens_total  # the early EOS proposals were rejected


def test_stop_string_and_max_tokens_drop_accepted_tokens_past_them(tiny_bundle):
    """A perfect proposer offers 4 tokens per step; the stop string and max_tokens still cut exactly."""
    be = FakeBackend(2)
    prompt = [1, 40, 41]
    from lineside.bundle import open_bundle
    from lineside.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_bundle(open_bundle(tiny_bundle))
    be.scripts[tuple(prompt)] = tok.encode("abcdefghijklmnop", add_special=False)

    async def main(spec, **kw):
        eng = LLMEngine(tiny_bundle, backend=be, speculative=spec)
        if spec is not None:
            eng.scheduler.proposer = ScriptProposer(be, 1000)
        await eng.start()
        out = await eng.submit(GenerationRequest(prompt_ids=prompt, **kw)).result()
        st = eng.stats()
        await eng.stop()
        return out, st

    for kw in (dict(max_tokens=6), dict(max_tokens=16, stop=["fg"]), dict(max_tokens=1), dict(max_tokens=3)):
        (text, ids, last), st = run(main(NGRAM, **kw))
        (ptext, pids, plast), _ = run(main(None, **kw))
        assert (text, ids, last.finish_reason, last.completion_tokens) == \
            (ptext, pids, plast.finish_reason, plast.completion_tokens), kw
    assert text == "abc"
    (text, _, last), st = run(main(NGRAM, max_tokens=16, stop=["fg"]))
    assert text == "abcde" and last.finish_reason == FinishReason.STOP and st.spec_accepted_tokens_total > 0


def test_verification_steps_respect_the_context(tiny_bundle):
    reqs = [GenerationRequest(prompt_ids=[1, *range(10, 30)], max_tokens=100)]
    plain, _, _ = run(generate(tiny_bundle, reqs, spec=None, max_seq_len=32))
    reqs = [GenerationRequest(prompt_ids=[1, *range(10, 30)], max_tokens=100)]
    spec, _, be = run(generate(tiny_bundle, reqs, spec=NGRAM, max_seq_len=32, wrong=1000))
    assert spec[0][1] == plain[0][1] and len(spec[0][1]) == 32 - 21
    assert all(p + n <= 32 for _, past, new in be.calls for p, n in zip(past, new, strict=True))


def test_seeded_sampling_with_prompt_lookup_drafts_gives_the_plain_tokens(tiny_bundle):
    """A deterministic proposer's draft is kept exactly when the token plain decoding draws at its position
    (from the row's generator, one draw per emitted token) equals it: so a seeded request gets plain decoding's
    tokens whether its rows speculate or not — alone, or beside other rows past ``max_rows`` (onnxruntime's GQA
    graph speculates only in 1-row steps), and with n > 1."""
    def reqs():
        return reqs_for(PROMPTS, 12, sampling=SamplingParams(temperature=0.8, seed=5))

    a, st, _ = run(generate(tiny_bundle, reqs(), spec=NGRAM, wrong=3, slots=5))
    b, _, _ = run(generate(tiny_bundle, reqs(), spec=None, slots=5))
    assert [o[1] for o in a] == [o[1] for o in b]
    assert 0 < st.spec_accepted_tokens_total < st.spec_draft_tokens_total


def test_whole_state_backend_that_cannot_rewind_refuses_speculation_in_one_line(tiny_bundle):
    from lineside.graph_io import StateUpdate

    class Replace:
        update = StateUpdate.REPLACE

    be = FakeBackend(2)
    be.states = [Replace()]
    with pytest.raises(LinesideError, match="whole-state") as e:
        LLMEngine(tiny_bundle, backend=be, speculative=NGRAM)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mix_with_drafts_keeps_every_invariant(tiny_bundle, seed):
    """Random arrivals, priorities, modes, cancels, tight KV (preemption, prefix reuse) with a proposer that is
    right two times in three: every request ends once, nothing leaks, and every greedy request that ran to the
    end got exactly the tokens it gets alone without speculation."""
    import random

    from tests.runtime.fakes import FakeClock
    from tests.runtime.test_engine_rules import alone

    rnd = random.Random(seed)
    base = list(range(20, 44))
    specs = [dict(prompt_ids=[1, *base[:rnd.choice([0, 8, 16, 24])], *[rnd.randrange(3, 259) for _ in range(3)]],
                  max_tokens=rnd.randrange(1, 20), priority=rnd.choice(["high", "normal", "low"]),
                  mode=rnd.choice(["realtime", "batch"]), request_id=f"r{i}") for i in range(16)]
    cancel_after = {f"r{i}": rnd.randrange(0, 4) for i in rnd.sample(range(16), 3)}
    arrivals = [rnd.randrange(0, 200) for _ in specs]

    async def main():
        clock = FakeClock()
        be = FakeBackend(3, clock=clock, step_s=0.001)
        eng = LLMEngine(tiny_bundle, backend=be, clock=clock, prefill_chunk=5, kv_block_size=4, kv_blocks=20,
                        aging_s=0.02, speculative=NGRAM)
        eng.scheduler.proposer = ScriptProposer(be, 3)
        await eng.start()

        outs = await asyncio.gather(*(submit_after(eng, s, y, cancel_after)
                                       for s, y in zip(specs, arrivals, strict=True)))
        st = eng.stats()
        await eng.stop()
        return outs, st

    outs, st = run(main())
    assert st.running == st.waiting == 0 and st.kv_blocks_reserved == 0
    assert sum(st.requests.values()) == 16 and st.spec_accepted_tokens_total > 0
    for spec, (ids, last) in zip(specs, outs, strict=True):
        if last.finish_reason in ("length", "stop"):
            solo = run(alone(tiny_bundle, GenerationRequest(**spec)))
            assert ids == solo[1], spec["request_id"]
            assert last.completion_tokens <= spec["max_tokens"]
        else:
            assert last.finish_reason == "cancelled"


class _TableBackend(FakeBackend):
    """A 4-token model: the next token's distribution depends on the last token only (``table[last]``), so every
    position's p is known exactly."""

    def __init__(self, num_slots: int, table: np.ndarray):
        super().__init__(num_slots)
        self.table = table

    def logits(self, seq: list[int]) -> np.ndarray:
        x = np.full(self.vocab_size, -np.inf, dtype=np.float32)
        x[3:7] = np.log(self.table[min(max(seq[-1] - 3, 0), 3)])
        return x


P_TABLE = np.array([[0.1, 0.4, 0.2, 0.3], [0.35, 0.05, 0.3, 0.3], [0.25, 0.25, 0.4, 0.1], [0.2, 0.3, 0.1, 0.4]])
Q_TABLE = np.array([[0.6, 0.1, 0.1, 0.2], [0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7], [0.4, 0.4, 0.1, 0.1]])


def test_engine_sampling_with_a_draft_model_keeps_the_models_joint_distribution(tiny_bundle):
    """Through the engine (scheduler, step runner, a draft model's q per row): requests with seeds 0..N-1 whose
    two drafts per step come from a model far from the target emit every token with the target's law p(t | last)
    (chi-square at p = 0.001 on fixed seeds: deterministic, it cannot flake). A rule that keeps drafts too often,
    samples rejections from p instead of the residual, or reads another row's or position's q fails it by far."""
    from lineside.runtime.speculative.draft_model import DraftModelProposer

    n = 3000

    async def main():
        be = _TableBackend(16, P_TABLE)
        eng = LLMEngine(tiny_bundle, backend=be, speculative=SpeculativeConfig(SpecMethod.NGRAM, 2, max_rows=16),
                        max_waiting=n)
        proposer = DraftModelProposer(_TableBackend(16, Q_TABLE), be.vocab_size, cost=0.0)
        eng.scheduler.proposer = eng._model_proposer = proposer
        await eng.start()
        reqs = [GenerationRequest(prompt_ids=[1, 3], max_tokens=4, sampling=SamplingParams(temperature=1.0, seed=s))
                for s in range(n)]
        outs = await asyncio.gather(*(eng.submit(r).result() for r in reqs))
        st = eng.stats()
        await eng.stop()
        return [o[1] for o in outs], st

    outs, st = run(main())
    assert st.spec_draft_tokens_total >= 2 * n and 0 < st.spec_accepted_tokens_total < st.spec_draft_tokens_total
    pairs = np.zeros((3, 4, 4))  # [i, a, b]: token i + 1 was a, token i + 2 b
    for ids in outs:
        assert len(ids) == 4
        for i in range(3):
            pairs[i, ids[i] - 3, ids[i + 1] - 3] += 1
    for i in range(3):  # the 2nd token: a draft or a residual sample; the 3rd: after a kept draft too; the 4th
        for a in range(4):
            assert chi_square(pairs[i, a], P_TABLE[a]) < CHI2_999[3], (i, a, pairs[i, a] / pairs[i, a].sum())
