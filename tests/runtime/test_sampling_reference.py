"""The sampler's filtered distribution against transformers' logits processors chained in vLLM's order, and its
seeded draws against that distribution (chi-square with a fixed seed: deterministic).

vLLM's order: repetition penalty (multiplicative, prompt + output tokens), frequency / presence penalties
(additive, output tokens only, counts), the grammar mask, then temperature, top-k, top-p, min-p. transformers
has no frequency / presence processor; the reference applies OpenAI's formula itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lineside.runtime.sampling import Sampler, SamplingParams


def _reference(logits, history, prompt_len, p: SamplingParams, allowed=None) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, processed logits before temperature) from transformers' processors, in float64."""
    s = torch.tensor(logits, dtype=torch.float64)[None]
    ids = torch.tensor([history], dtype=torch.long)
    if p.repetition_penalty != 1.0 and history:
        s = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, s)
    if history[prompt_len:]:
        tok, count = np.unique(history[prompt_len:], return_counts=True)
        s[0, tok] -= torch.tensor(p.presence_penalty + p.frequency_penalty * count, dtype=torch.float64)
    if allowed is not None:
        s[0, ~torch.tensor(allowed)] = -torch.inf
    processed = s[0].numpy().copy()
    s = TemperatureLogitsWarper(p.temperature)(ids, s)
    if p.top_k:
        s = TopKLogitsWarper(p.top_k)(ids, s)
    if p.top_p < 1.0:
        s = TopPLogitsWarper(p.top_p)(ids, s)
    if p.min_p > 0:
        s = MinPLogitsWarper(p.min_p)(ids, s)
    return torch.softmax(s, -1)[0].numpy(), processed


def _case(rng: np.random.Generator, vocab: int, trial: int):
    scale = (1.0, 8.0, 0.05, 3.0)[trial % 4]  # ordinary, very peaked, very flat, wide
    x = rng.standard_normal(vocab) * scale
    if trial % 3 == 0:
        x = np.round(x, 1)  # ties
    allowed = None
    if trial % 5 == 0:  # a grammar mask: -inf entries
        allowed = rng.random(vocab) < 0.7
        allowed[rng.integers(vocab)] = True
    history = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(0, 12)))]
    prompt_len = int(rng.integers(0, len(history) + 1))
    params = SamplingParams(
        temperature=float(rng.choice([0.3, 1.0, 1.7])), top_k=int(rng.choice([0, 2, 5, 40, vocab + 5])),
        top_p=float(rng.choice([1.0, 0.99, 0.9, 0.5, 0.1])), min_p=float(rng.choice([0.0, 0.05, 0.3, 1.0])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])), presence_penalty=float(rng.choice([0.0, 0.5, -0.5])),
        frequency_penalty=float(rng.choice([0.0, 0.3, -1.0])))
    return x.astype(np.float32), history, prompt_len, params, allowed


@pytest.mark.parametrize("vocab,trials", [(7, 200), (1000, 200), (50_000, 8)])
def test_filtered_distribution_matches_transformers_in_vllms_order(vocab, trials):
    """Same probabilities token for token, except where top-p's cut falls inside a group of tied tokens: the
    sampler keeps the lower ids (a stable sort, as its argmax), torch's sort any of them; the kept count and the
    probabilities are the same either way."""
    rng = np.random.default_rng(vocab)
    for trial in range(trials):
        x, history, prompt_len, params, allowed = _case(rng, vocab, trial)
        got = Sampler(params).distribution(x, history, prompt_len, allowed=allowed)
        want, processed = _reference(x, history, prompt_len, params, allowed)
        assert not isinstance(got, int)
        assert np.sort(got) == pytest.approx(np.sort(want), abs=1e-9), (trial, params)
        differ = np.nonzero(~np.isclose(got, want, atol=1e-9))[0]
        assert len(set(processed[differ].tolist())) <= 1, (trial, params)  # only one tie group may differ


P = np.log([0.5, 0.25, 0.125, 0.0625, 0.0625])
TIES = np.array([1.0, 3.0, 3.0, 2.0])
MASKED = np.array([1.0, -np.inf, 3.0, -np.inf])


@pytest.mark.parametrize("x,kw,kept", [
    (P, dict(top_p=0.75), [0, 1]),  # the cumulative sum reaches top_p exactly: the tokens up to it, no more
    (P, dict(top_p=0.75 + 1e-9), [0, 1, 2]),
    (P, dict(top_p=0.9375), [0, 1, 2, 3]),  # the cut inside a tie: the lower id (transformers: either)
    (P, dict(top_p=1e-9), [0]),  # at least one token
    (np.log([0.5, 0.3, 0.2]), dict(top_p=0.8), [0, 1]),
    (P, dict(top_k=6), [0, 1, 2, 3, 4]),  # top_k past the vocabulary: off
    (P, dict(top_k=4), [0, 1, 2, 3, 4]),  # the k-th value is tied: all of the tie stays, as transformers / vLLM
    (TIES, dict(top_k=2), [1, 2]),
    (TIES, dict(top_k=1), [1, 2]),  # top_k 1 with two tokens tied at the top: both stay (it took the lower id)
    (P, dict(top_k=1), [0]),
    (MASKED, dict(top_k=3), [0, 2]),
    (MASKED, dict(top_p=0.999), [0, 2]),
    (P, dict(min_p=1.0), [0]),
    (TIES, dict(min_p=1.0), [1, 2]),  # min_p 1: every token as likely as the most likely
    (P, dict(min_p=0.25), [0, 1]),  # p >= min_p * max is kept
])
def test_kept_tokens_at_the_boundaries(x, kw, kept):
    params = SamplingParams(temperature=1.0, **kw)
    x = x.astype(np.float32)
    got = Sampler(params).distribution(x)
    got = np.eye(len(x))[got] if isinstance(got, int) else got  # one token left: the token itself
    assert list(np.nonzero(got)[0]) == kept
    want, _ = _reference(x, [], 0, params)
    assert np.count_nonzero(want) == len(kept)


def test_top_k_one_samples_among_the_tokens_tied_at_the_top():
    """top_k 1 with a temperature keeps every token tied with the top logit and samples among them, as
    transformers' TopKLogitsWarper and vLLM's top-k (``logits < kth`` masked) do; it was argmax, the lowest id every
    time. Also with the logits as the model gives them (float32, the greedy shortcut) and speculation's ``draw``."""
    x = TIES.astype(np.float32)
    s = Sampler(SamplingParams(temperature=0.7, top_k=1, seed=5))
    draws = [s(x) for _ in range(200)]
    assert set(draws) == {1, 2} and 60 < draws.count(1) < 140
    # speculation's draw samples among them too, unseeded; a seeded row drafts the most likely token and draws
    # nothing (its one draw is verification's, as in plain decoding: sampling.Sampler.draw)
    unseeded = Sampler(SamplingParams(temperature=0.7, top_k=1))
    assert {unseeded.draw(x)[0] for _ in range(100)} == {1, 2}
    assert s.draw(x) == (1, None)
    assert Sampler(SamplingParams(temperature=0.0, top_k=1, seed=5))(x) == 1  # greedy: the lowest id, as vLLM's


@pytest.mark.parametrize("kw,n_kept", [(dict(temperature=1.0), 7), (dict(temperature=1.3, top_k=5, top_p=0.8, min_p=0.45), 3)])
def test_seeded_draws_follow_the_distribution(kw, n_kept):
    """Pearson's chi-square over 20,000 draws, seed fixed: the statistic is below the 0.1% critical value for
    the kept tokens' degrees of freedom, and nothing outside them is ever drawn."""
    x = np.log(np.array([0.3, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02], np.float32))
    s = Sampler(SamplingParams(seed=20240611, **kw))
    p = s.distribution(x)
    draws = np.bincount([s(x) for _ in range(20_000)], minlength=x.shape[0])
    kept = p > 0
    assert kept.sum() == n_kept
    assert draws[~kept].sum() == 0
    expected = p[kept] * draws.sum()
    chi2 = float(((draws[kept] - expected) ** 2 / expected).sum())
    critical = {2: 13.816, 6: 22.458}[n_kept - 1]
    assert chi2 < critical


@pytest.mark.parametrize("penalty", [12.0, 50.0, 1e6])
def test_repetition_penalties_past_10_match_transformers(penalty):
    """The server takes any repetition_penalty > 0, as vLLM does: past 10 the distribution is still transformers'
    (a seen token's positive logit divided by it, a negative one multiplied), and no NaN comes of a large one."""
    rng = np.random.default_rng(int(penalty))
    x = (rng.standard_normal(200) * 3.0).astype(np.float32)
    history = [int(t) for t in rng.integers(0, 200, size=60)]
    params = SamplingParams(temperature=1.0, repetition_penalty=penalty)
    got = Sampler(params).distribution(x, history, 30)
    want, _ = _reference(x, history, 30, params)
    assert not isinstance(got, int) and np.isfinite(got).all()
    assert got == pytest.approx(want, abs=1e-12)
