"""Sampler logprobs against a direct numpy log-softmax: after penalties and the grammar mask, before temperature."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.runtime.sampling import LOGPROB_FLOOR, Sampler, SamplingParams, token_logprob


def _ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return np.log(e / e.sum())


@pytest.mark.parametrize("seed", range(5))
def test_greedy_logprobs_equal_log_softmax_and_top_is_sorted(seed):
    x = np.random.default_rng(seed).standard_normal(1000).astype(np.float32) * 4
    r = Sampler(SamplingParams()).step(x, logprobs=20)
    ref = _ref(x)
    assert r.token == int(np.argmax(x))
    assert r.logprob.logprob == pytest.approx(ref[r.token], abs=1e-12)
    ids = [i for i, _ in r.logprob.top]
    assert ids == list(np.argsort(-ref, kind="stable")[:20])
    assert [lp for _, lp in r.logprob.top] == pytest.approx(list(ref[ids]), abs=1e-12)
    assert r.logprob.top[0] == (r.token, r.logprob.logprob)  # the greedy token is the max of its top logprobs


def test_logprobs_are_before_temperature_and_after_penalties():
    x = np.array([2.0, 1.0, 0.5, -1.0], dtype=np.float32)
    hot = Sampler(SamplingParams(temperature=7.0, seed=1)).step(x, logprobs=4)
    assert hot.logprob.logprob == pytest.approx(_ref(x)[hot.token])  # temperature does not change them
    pen = Sampler(SamplingParams(repetition_penalty=2.0)).step(x, [0, 3], prompt_len=0, logprobs=2)
    ref = _ref(np.array([1.0, 1.0, 0.5, -2.0]))  # 2.0 / 2 and -1.0 * 2
    assert pen.token == 0 and pen.logprob.logprob == pytest.approx(ref[0])
    assert pen.logprob.top == ((0, pytest.approx(ref[0])), (1, pytest.approx(ref[1])))  # a tie keeps the lower id
    freq = Sampler(SamplingParams(frequency_penalty=0.5)).step(x, [9, 0, 0], prompt_len=1, logprobs=0)
    assert freq.logprob.logprob == pytest.approx(_ref(np.array([1.0, 1.0, 0.5, -1.0]))[freq.token])
    assert freq.logprob.top == ()


def test_mask_renormalizes_over_allowed_tokens_and_top_skips_masked():
    x = np.array([5.0, 1.0, 0.0, 2.0], dtype=np.float32)
    allowed = np.array([False, True, True, False])
    r = Sampler(SamplingParams()).step(x, allowed=allowed, logprobs=4)
    ref = _ref(np.array([1.0, 0.0]))
    assert r.token == 1 and r.logprob.logprob == pytest.approx(ref[0])
    assert [i for i, _ in r.logprob.top] == [1, 2]  # -inf entries are not reported (JSON has no -inf)


def test_no_logprobs_unless_asked_and_floor_for_impossible():
    x = np.array([0.0, 1.0], dtype=np.float32)
    assert Sampler(SamplingParams()).step(x).logprob is None
    assert token_logprob(np.array([0.0, -np.inf]), 1, 2).logprob == LOGPROB_FLOOR
    assert token_logprob(np.array([np.nan, 0.0]), 1, 1).logprob == pytest.approx(0.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_overflowed_to_inf_report_the_share_they_are_drawn_with(temperature):
    """A model row with +inf logits (an fp16 overflow) samples among those tokens only, each equally likely; their
    logprob is log(1 / count), not the floor for an impossible token, and they head the top list."""
    x = np.array([1.0, np.inf, 2.0, np.inf], dtype=np.float32)
    r = Sampler(SamplingParams(temperature=temperature, seed=3)).step(x, logprobs=3)
    assert r.token in (1, 3)
    assert r.logprob.logprob == pytest.approx(np.log(0.5))
    assert r.logprob.top == ((1, pytest.approx(np.log(0.5))), (3, pytest.approx(np.log(0.5))))


def test_min_tokens_hold_on_the_stop_tokens_is_in_the_logprobs_as_documented():
    """README: logprobs come after the masks, min_tokens' included: while it holds EOS back, EOS is out of the top
    list and the rest renormalise over what may be drawn; once it lets go, the model's own log-softmax."""
    x = np.array([3.0, 1.0, 0.5, -1.0], dtype=np.float32)  # token 0 is EOS
    s = Sampler(SamplingParams(min_tokens=2), stop_ids=[0])
    held = s.step(x, [9], prompt_len=1, logprobs=4)
    assert held.token == 1 and [i for i, _ in held.logprob.top] == [1, 2, 3]
    assert held.logprob.logprob == pytest.approx(_ref(x[1:])[0])
    free = s.step(x, [9, 1, 2], prompt_len=1, logprobs=4)
    assert free.token == 0 and free.logprob.logprob == pytest.approx(_ref(x)[0])
