"""Extreme but valid sampling parameters never produce NaN probabilities (found by the server fuzz run)."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.errors import LinesideError
from lineside.runtime.sampling import Sampler, SamplingParams


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, repetition_penalty=5e-324, top_p=5e-324),
    SamplingParams(temperature=5e-324),
    SamplingParams(temperature=1.0, repetition_penalty=1e308, presence_penalty=1e308, frequency_penalty=-1e308),
    SamplingParams(temperature=0.0, repetition_penalty=5e-324),
])
def test_extreme_parameters_pick_a_valid_token(params):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32) * 5
    s = Sampler(params)
    for _ in range(5):
        tok = s(logits, history=[1, 2, 3, 4], prompt_len=2)
        assert 0 <= tok < 50


def test_overflowing_logits_keep_only_the_largest():
    s = Sampler(SamplingParams(temperature=1e-300, seed=1))
    logits = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    picks = {s(logits) for _ in range(40)}
    assert picks <= {1, 3} and picks == {1, 3}


@pytest.mark.parametrize("temperature", [1e-308, 5e-324])
def test_tiny_temperature_is_the_greedy_limit_not_overflow(temperature):
    """Dividing the logits by a denormal temperature overflowed every positive logit to +inf, and the sampler then
    drew uniformly among all of them (2.0 as often as 3.0); all-negative rows underflowed to -inf and fell back to
    the raw argmax, which ignores the penalties. The limit of softmax(x / T) as T → 0 is the argmax (ties shared)."""
    x = np.array([2.0, 3.0, -1.0, 0.5, 3.0], np.float32)
    s = Sampler(SamplingParams(temperature=temperature, seed=0))
    assert s.distribution(x) == pytest.approx([0, 0.5, 0, 0, 0.5])
    assert {s(x) for _ in range(40)} == {1, 4}
    # penalised: token 4's -0.5 becomes -1.0, so token 2 (-0.9) leads; the raw argmax would say 4
    neg = np.array([-2.0, -3.0, -0.9, -1.5, -0.5], np.float32)
    s = Sampler(SamplingParams(temperature=temperature, repetition_penalty=2.0, seed=0))
    assert s(neg, [4], prompt_len=1) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("row", [np.full(6, np.nan), np.full(6, -np.inf), np.array([np.nan, -np.inf] * 3)])
def test_a_row_with_no_number_in_it_is_an_error_not_token_0(temperature, row):
    """A model whose logits are all NaN (a numerical failure) gave token 0 every step, greedy or not: an answer
    of whatever token 0 is (<unk>, or an EOS that ends it empty) instead of an error saying what went wrong."""
    s = Sampler(SamplingParams(temperature=temperature, seed=0))
    with pytest.raises(LinesideError, match="NaN or -inf"):
        s(row.astype(np.float32))
    with pytest.raises(LinesideError, match="NaN or -inf"):
        s.step(row.astype(np.float32), logprobs=2)
    partial = row.astype(np.float32).copy()
    partial[4] = 0.5  # one number left: that is the token, as NaN counts as -inf
    assert s(partial) == 4


def test_the_fallback_never_lands_on_a_nan():
    """Extreme penalties leave no finite logit: the raw argmax decides, among numbers, never at a NaN's index."""
    x = np.array([np.nan, 1.0, 3.0, np.nan], np.float32)
    s = Sampler(SamplingParams(temperature=1.0, repetition_penalty=1e308, presence_penalty=1e308,
                               frequency_penalty=-1e308))
    assert s(x, history=[1, 2, 2], prompt_len=1) == 2
