"""The degradation ladder on a fake clock: escalation, one-level-at-a-time recovery, backoff on flaps, pins."""

from __future__ import annotations

import datetime as dt

import pytest

from lineside.server.slo.cache import ResponseCache, cache_key, cacheable, reproducible
from lineside.server.slo.controller import Level, Reason, SloController
from lineside.server.slo.policy import SloPolicy, parse_policy
from lineside.server.slo.signals import RollingWindow, Signals, SignalSource, device_reading

NOON = dt.time(12, 0)


def slow(ttft: float) -> Signals:
    return Signals(ttft_p90_s=ttft)


def test_escalates_at_once_and_recovers_one_level_per_recover_after():
    c = SloController(SloPolicy(), now=0.0)
    assert c.evaluate(slow(0.5), now=1, local_time=NOON) == Level.NORMAL
    assert c.evaluate(slow(0.9), now=2, local_time=NOON) == Level.PROTECT_REALTIME
    assert c.reason == Reason.TTFT_P90
    assert c.evaluate(slow(2.0), now=3, local_time=NOON) == Level.FALLBACK
    # calm from t=10: nothing changes before 300 s have passed
    assert c.evaluate(slow(0.1), now=10, local_time=NOON) == Level.FALLBACK
    assert c.evaluate(slow(0.1), now=309.9, local_time=NOON) == Level.FALLBACK
    assert c.evaluate(slow(0.1), now=310, local_time=NOON) == Level.PROTECT_REALTIME
    assert c.reason == Reason.RECOVERED
    # the next step down waits another full recover_after
    assert c.evaluate(slow(0.1), now=609, local_time=NOON) == Level.PROTECT_REALTIME
    assert c.evaluate(slow(0.1), now=610, local_time=NOON) == Level.NORMAL
    assert [(int(t.old), int(t.new)) for t in c.history] == [(0, 1), (1, 2), (2, 1), (1, 0)]


def test_a_breach_during_the_calm_period_restarts_the_delay():
    c = SloController(SloPolicy(), now=0.0)
    c.evaluate(slow(1.0), now=0, local_time=NOON)
    c.evaluate(slow(0.1), now=10, local_time=NOON)
    c.evaluate(slow(1.0), now=200, local_time=NOON)  # back over: still level 1, calm resets
    assert c.evaluate(slow(0.1), now=210, local_time=NOON) == Level.PROTECT_REALTIME
    assert c.evaluate(slow(0.1), now=500, local_time=NOON) == Level.PROTECT_REALTIME
    assert c.evaluate(slow(0.1), now=510, local_time=NOON) == Level.NORMAL


def test_flapping_backs_off_exponentially_and_stability_resets_it():
    policy = SloPolicy(recover_after_s=100, flap_window_s=50, max_recover_after_s=350)
    c = SloController(policy, now=0.0)
    t = 0.0
    delays = []
    for _ in range(4):
        c.evaluate(slow(1.0), now=t, local_time=NOON)
        assert c.level == Level.PROTECT_REALTIME
        delays.append(c.recover_after_s)
        c.evaluate(slow(0.1), now=t + 1, local_time=NOON)
        t += 1 + c.recover_after_s
        assert c.evaluate(slow(0.1), now=t, local_time=NOON) == Level.NORMAL
        t += 10  # flaps: back over within flap_window_s
    assert delays == [100, 200, 350, 350]
    c.evaluate(slow(0.1), now=t + 100, local_time=NOON)  # stable for flap_window_s at level 0
    assert c.recover_after_s == 100


def test_an_immediate_recovery_still_backs_off_on_a_signal_oscillating_around_the_threshold():
    """recover_after_s: 0 multiplied by backoff_factor stayed 0: the level flipped 0 <-> 1 on every tick forever."""
    c = SloController(SloPolicy(recover_after_s=0, flap_window_s=300, tick_s=1), now=0.0)
    levels = [c.evaluate(slow(0.9 if t % 2 == 0 else 0.7), now=t, local_time=NOON) for t in range(200)]
    assert levels[:2] == [Level.PROTECT_REALTIME, Level.NORMAL]  # the first recovery is immediate, as asked
    assert len(c.history) <= 12 and c.recover_after_s > 0  # then each flap doubles the delay


def test_a_pin_holds_a_floor_in_its_window_and_wraps_midnight():
    policy = parse_policy({"pins": [{"start": "22:00", "end": "06:00", "level": 1}], "recover_after_s": 0})
    c = SloController(policy, now=0.0)
    assert c.evaluate(slow(0.1), now=1, local_time=dt.time(23, 30)) == Level.PROTECT_REALTIME
    assert c.reason == Reason.PINNED
    assert c.evaluate(slow(0.1), now=2, local_time=dt.time(5, 59)) == Level.PROTECT_REALTIME
    assert c.evaluate(slow(2.0), now=3, local_time=dt.time(5, 59)) == Level.FALLBACK  # signals still escalate
    assert c.evaluate(slow(0.1), now=4, local_time=dt.time(5, 59)) == Level.PROTECT_REALTIME  # to the pin
    assert c.evaluate(slow(0.1), now=5, local_time=dt.time(5, 59)) == Level.PROTECT_REALTIME
    assert c.evaluate(slow(0.1), now=6, local_time=dt.time(6, 0)) == Level.NORMAL


def test_memory_and_other_signals_name_the_reason():
    c = SloController(SloPolicy(), now=0.0)
    c.evaluate(Signals(memory_ratio=0.9), now=1, local_time=NOON)
    assert (c.level, c.reason) == (Level.PROTECT_REALTIME, Reason.MEMORY)
    assert c.evaluate(Signals(memory_ratio=0.84), now=2, local_time=NOON) == Level.PROTECT_REALTIME
    unknown = SloController(SloPolicy(), now=0.0)
    assert unknown.evaluate(Signals(), now=1, local_time=NOON) == Level.NORMAL  # unknown signals never degrade


def test_rolling_window_p90_forgets_old_samples_and_needs_min_samples():
    w = RollingWindow(window_s=10, min_samples=3)
    w.add(0, 5.0)
    w.add(1, 5.0)
    assert w.p90(1) is None
    w.add(2, 5.0)
    assert w.p90(2) == pytest.approx(5.0)
    for t in range(11, 21):
        w.add(t, 0.1)
    assert w.p90(20) == pytest.approx(0.1)  # the 5 s samples left the window
    source = SignalSource(window_s=10, min_samples=1, clock=lambda: 3.0, device=lambda: (0.5, 0.7))
    source.observe(ttft_s=0.2, queue_s=0.01)
    read = source.read({"kv_usage": 0.25})
    assert (read.ttft_p90_s, read.queue_wait_p90_s, read.kv_usage, read.memory_ratio, read.gpu_load) == (
        pytest.approx(0.2), pytest.approx(0.01), 0.25, 0.5, 0.7)


def test_device_reading_from_nvml_and_jetson_answers():
    nvml = {"gpu": True, "devices": [{"memory_total_bytes": 100, "memory_used_bytes": 90, "gpu_load_percent": 65.0}]}
    assert device_reading(nvml) == (pytest.approx(0.9), pytest.approx(0.65))
    jetson = {"gpu": True, "kind": "jetson", "memory_total_bytes": 1000, "memory_available_bytes": 250,
              "gpu_load_percent": 40}
    assert device_reading(jetson) == (pytest.approx(0.75), pytest.approx(0.4))
    assert device_reading({"gpu": False, "reason": "none"}) == (None, None)


def test_response_cache_is_bounded_expires_and_counts():
    now = [0.0]
    cache = ResponseCache(max_entries=2, ttl_s=10, clock=lambda: now[0])
    cache.put("a", {"x": 1})
    cache.put("b", {"x": 2})
    assert cache.get("a") == {"x": 1}  # a is now the most recent
    cache.put("c", {"x": 3})  # evicts b
    assert cache.get("b") is None and len(cache) == 2
    now[0] = 10.5
    assert cache.get("a") is None  # expired
    assert (cache.hits, cache.misses) == (1, 2)


def test_only_greedy_or_seeded_sampling_is_cacheable():
    from lineside.runtime.request import GenerationRequest, Priority
    from lineside.runtime.sampling import SamplingParams

    assert reproducible(SamplingParams(temperature=0.0))
    assert reproducible(SamplingParams(temperature=0.8, seed=3))
    assert not reproducible(SamplingParams(temperature=0.8))
    assert not cacheable(GenerationRequest([1, 2], session_id="s"))

    def key(**fields):
        return cache_key(model="m", endpoint="chat", requests=[GenerationRequest([1, 2], max_tokens=4, **fields)], n=1)

    one, other = key(sampling=SamplingParams(seed=1)), key(sampling=SamplingParams(seed=2))
    assert one != other and hash(one) is not None
    # ids and scheduling are not keyed; everything else is, a field added later included
    assert key(request_id="a", priority=Priority.HIGH, timeout_s=3.0) == key(request_id="b")
    assert key(stop_token_ids=[5]) != key() != key(ignore_eos=True)


def test_a_level_2_pin_is_a_floor_even_while_a_level_1_threshold_is_crossed():
    # the pin holds level 2 all day; a TTFT between level 1's and level 2's thresholds must not hold it at 1
    policy = parse_policy({"pins": [{"start": "00:00", "end": "23:59:59", "level": 2}]})
    c = SloController(policy, now=0.0)
    assert c.evaluate(slow(1.0), now=1, local_time=NOON) == Level.FALLBACK
    assert c.evaluate(slow(1.0), now=2, local_time=NOON) == Level.FALLBACK
    c = SloController(policy, now=0.0)
    assert c.evaluate(slow(0.1), now=1, local_time=NOON) == Level.FALLBACK
    assert c.evaluate(slow(1.0), now=400, local_time=NOON) == Level.FALLBACK  # and it is not left


def test_response_cache_is_bounded_by_the_bytes_of_its_answers():
    """512 long logprob answers must not take a gigabyte: past max_bytes of JSON the least recently used go, and
    an answer bigger than the whole bound is not kept."""
    import json

    now = [0.0]
    cache = ResponseCache(max_entries=512, ttl_s=10, clock=lambda: now[0], max_bytes=1000)
    answer = {"text": "é" * 140}  # 280 bytes of UTF-8 in its JSON
    size = len(json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode())
    for key in "abc":
        cache.put(key, answer)
    assert cache.bytes == 3 * size and len(cache) == 3
    assert cache.get("a") == answer  # a is the most recent now
    cache.put("d", answer)  # a fourth goes past 1000 bytes: b, the least recently used, goes
    assert cache.get("b") is None and cache.get("a") == answer and len(cache) == 3
    assert cache.bytes == 3 * size <= 1000
    cache.put("a", {"text": "x"})  # replacing an answer counts its bytes once
    assert cache.bytes == 2 * size + len(b'{"text":"x"}')
    cache.put("huge", {"text": "x" * 2000})  # bigger than the whole bound: not kept, nothing else dropped
    assert cache.get("huge") is None and len(cache) == 3
    got = cache.get("c")
    got["text"] = "changed"  # a caller's change does not reach the kept answer
    assert cache.get("c") == answer
    now[0] = 10.5
    assert cache.get("c") is None and cache.bytes == size + len(b'{"text":"x"}')  # expired: its bytes freed


def test_slo_policy_sizes_the_cache_in_mib(tmp_path):
    from lineside.server.slo.policy import load_policy

    (tmp_path / "p.json").write_text('{"cache": {"max_mb": 0.5}}')
    assert load_policy(tmp_path / "p.json").cache.max_mb == 0.5
    (tmp_path / "bad.json").write_text('{"cache": {"max_mb": 0}}')
    with pytest.raises(Exception, match="max_mb"):
        load_policy(tmp_path / "bad.json")
