"""Arrival schedules: burst exactly, Poisson and gamma statistically, all reproducible from the seed."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.bench import load
from lineside.errors import LinesideError


def test_burst_exact_times_and_prompt_counts():
    s = load.burst(per_second=3, duration=4, seed=7)
    assert s.pattern == "burst" and not s.closed_loop
    assert [a.time for a in s.arrivals] == [0.0] * 3 + [1.0] * 3 + [2.0] * 3 + [3.0] * 3
    counts = [a.prompts for a in s.arrivals]
    assert all(1 <= c <= 3 for c in counts)
    assert load.burst(per_second=3, duration=4, seed=7) == s  # same seed, same schedule
    assert [a.prompts for a in load.burst(3, 4, seed=8).arrivals] != counts  # equal with chance 3**-12
    many = load.burst(per_second=50, duration=40, seed=1)
    vals, freq = np.unique([a.prompts for a in many.arrivals], return_counts=True)
    assert list(vals) == [1, 2, 3]  # 1-3 prompts, roughly uniform over 2000 requests
    assert np.all(np.abs(freq / len(many.arrivals) - 1 / 3) < 0.05)


def test_burst_request_cap_and_custom_prompt_range():
    s = load.burst(per_second=4, duration=10, seed=0, prompts_per_request=(2, 2), max_requests=6)
    assert len(s.arrivals) == 6
    assert {a.prompts for a in s.arrivals} == {2}
    assert [a.time for a in s.arrivals] == [0, 0, 0, 0, 1, 1]


def test_poisson_statistics():
    rate, duration = 50.0, 200.0
    s = load.poisson(rate, duration, seed=3)
    t = np.array([a.time for a in s.arrivals])
    gaps = np.diff(np.concatenate([[0.0], t]))
    n = len(t)
    assert abs(n - rate * duration) < 4 * np.sqrt(rate * duration)  # Poisson count, 4 sigma
    assert np.all(gaps > 0) and t[-1] < duration
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.06)  # exponential: CV = 1
    assert load.poisson(rate, duration, seed=3) == s
    assert load.poisson(rate, duration, seed=4) != s


def test_gamma_burstiness_changes_spread_not_rate():
    rate = 20.0
    for shape, cv in ((0.25, 2.0), (4.0, 0.5)):
        s = load.gamma(rate, burstiness=shape, seed=11, max_requests=8000)
        t = np.array([a.time for a in s.arrivals])
        gaps = np.diff(np.concatenate([[0.0], t]))
        assert len(t) == 8000
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.06)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)  # CV = 1/sqrt(shape)


def test_concurrency_is_closed_loop():
    s = load.concurrency(4, duration=5)
    assert s.closed_loop and s.concurrency == 4 and s.arrivals == ()
    s = load.make_schedule("concurrency", rate=0, duration=0, seed=0, workers=2, max_requests=10)
    assert s.max_requests == 10


@pytest.mark.parametrize("call", [
    lambda: load.burst(0, 10),
    lambda: load.burst(2, 0),
    lambda: load.poisson(0.0, 10),
    lambda: load.poisson(1.0, 0),
    lambda: load.gamma(1.0, burstiness=0, duration=5),
    lambda: load.concurrency(0, duration=5),
    lambda: load.concurrency(2),
    lambda: load.burst(2, 5, prompts_per_request=(3, 1)),
    lambda: load.make_schedule("zipf", rate=1, duration=1, seed=0),
    lambda: load.make_schedule("burst", rate=2.5, duration=1, seed=0),
])
def test_bad_schedules_are_one_line_errors(call):
    with pytest.raises(LinesideError) as e:
        call()
    assert "\n" not in str(e.value)
