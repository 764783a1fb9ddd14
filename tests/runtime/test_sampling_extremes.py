"""Extreme but valid sampling parameters never produce NaN probabilities (found by the server fuzz run)."""

from __future__ import annotations

import numpy as np
import pytest

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
