"""The bench arithmetic on hand-made timings (values worked out by hand, not by the code under test)."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.bench.metrics import (
    RequestRecord,
    e2e,
    good,
    itls,
    percentiles,
    summarize,
    throughput_timeline,
    tpot,
    ttft,
)


def rec(start, chunks, end, tokens=None, error=None, prompts=1):
    """A single-choice record; tokens defaults to one per chunk."""
    n = len(chunks) if tokens is None else tokens
    return RequestRecord(start=start, end=end, prompts=prompts, prompt_tokens=10, output_tokens=n,
                         chunk_times={0: list(chunks)}, choice_tokens={0: n}, error=error)


def test_ttft_tpot_itl_e2e_single_request():
    # sent at 1.0; tokens at 1.5, 1.6, 1.8, 2.1; response ends at 2.1
    r = rec(1.0, [1.5, 1.6, 1.8, 2.1], 2.1)
    assert ttft(r) == pytest.approx(0.5)
    assert e2e(r) == pytest.approx(1.1)
    # TPOT excludes the first token: (1.1 - 0.5) / (4 - 1) = 0.2
    assert tpot(r) == pytest.approx(0.2)
    assert itls(r) == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_uses_token_count_not_chunk_count():
    # 3 chunks but the server's usage says 7 tokens (several tokens per chunk): (2.0-0.4)/(7-1)
    r = rec(0.0, [0.4, 1.0, 2.0], 2.0, tokens=7)
    assert tpot(r) == pytest.approx(1.6 / 6)


def test_tpot_undefined_for_one_token():
    r = rec(0.0, [0.3], 0.35)
    assert tpot(r) is None
    assert itls(r) == []
    assert ttft(r) == pytest.approx(0.3)


def test_multi_choice_request_per_choice_tpot():
    # two prompts in one request: choice 0 tokens at .2 .4 .6; choice 1 at .3 .9 (ends later)
    r = RequestRecord(start=0.0, end=1.0, prompts=2, output_tokens=5,
                      chunk_times={0: [0.2, 0.4, 0.6], 1: [0.3, 0.9]}, choice_tokens={0: 3, 1: 2})
    assert ttft(r) == pytest.approx(0.2)  # first token of any choice
    # choice 0: (0.6-0.2)/2 = 0.2; choice 1: (0.9-0.3)/1 = 0.6; mean 0.4
    assert tpot(r) == pytest.approx(0.4)
    assert sorted(itls(r)) == pytest.approx([0.2, 0.2, 0.6])


def test_percentiles_linear_interpolation():
    vals = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    p = percentiles(vals)
    # numpy 'linear': position (n-1)*q -> p50 at 4.5 -> 5.5; p90 at 8.1 -> 9.1; p99 at 8.91 -> 9.91
    assert p["mean"] == pytest.approx(5.5)
    assert p["p50"] == pytest.approx(5.5)
    assert p["p90"] == pytest.approx(9.1)
    assert p["p99"] == pytest.approx(9.91)
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert percentiles([4.0])["p99"] == 4.0


def test_summary_throughputs_and_effective_throughput():
    a = rec(0.0, [0.5, 1.0, 1.5, 2.0], 2.0)          # 4 tokens, e2e 2
    b = rec(1.0, [1.2, 1.4], 1.4)                      # 2 tokens, e2e 0.4
    c = rec(2.0, [], 2.5, tokens=0, error="HTTP 500")  # failed
    s = summarize([a, b, c], duration=4.0)
    assert (s.requests, s.completed, s.failed) == (3, 2, 1)
    assert s.output_tokens == 6
    assert s.request_throughput == pytest.approx(2 / 4.0)
    assert s.output_throughput == pytest.approx(6 / 4.0)
    # effective throughput = sum(output tokens) / sum(E2E) = 6 / (2.0 + 0.4)
    assert s.effective_throughput == pytest.approx(6 / 2.4)
    assert s.ttft["p50"] == pytest.approx((0.5 + 0.2) / 2)
    assert s.e2e["mean"] == pytest.approx(1.2)
    # TPOTs: a (2.0-0.5)/3 = 0.5, b (0.4-0.2)/1 = 0.2
    assert s.tpot["mean"] == pytest.approx(0.35)
    assert s.itl["mean"] == pytest.approx((0.5 * 3 + 0.2) / 4)
    assert s.goodput is None


def test_summary_default_duration_is_first_send_to_last_end():
    s = summarize([rec(1.0, [1.5], 2.0), rec(2.0, [2.2], 5.0)])
    assert s.duration == pytest.approx(4.0)


def test_goodput_under_targets():
    fast = rec(0.0, [0.1, 0.15, 0.2], 0.2)    # ttft .1, tpot .05
    slow_first = rec(0.0, [0.9, 0.95], 0.95)  # ttft .9
    slow_steps = rec(0.0, [0.1, 0.5, 0.9], 0.9)  # tpot .4
    failed = rec(0.0, [], 1.0, tokens=0, error="boom")
    recs = [fast, slow_first, slow_steps, failed]
    assert [good(r, 0.5, 0.1) for r in recs] == [True, False, False, False]
    s = summarize(recs, duration=2.0, ttft_target=0.5, tpot_target=0.1)
    assert s.goodput == pytest.approx(1 / 2.0)
    s = summarize(recs, duration=2.0, ttft_target=0.5)  # TTFT target only
    assert s.goodput == pytest.approx(2 / 2.0)


def test_record_json_round_trip():
    r = RequestRecord(start=0.0, end=1.0, prompts=2, output_tokens=3,
                      chunk_times={0: [0.2, 0.4], 1: [0.3]}, choice_tokens={0: 2, 1: 1})
    back = RequestRecord.from_dict(__import__("json").loads(__import__("json").dumps(r.to_dict())))
    assert back == r


def test_throughput_timeline_bins():
    a = rec(0.0, [0.1, 0.2, 1.5], 1.5)
    b = rec(0.0, [2.5, 2.6], 2.6, tokens=4)  # 4 tokens over 2 chunks -> 2 per chunk
    t, rate = throughput_timeline([a, b], bin_s=1.0)
    np.testing.assert_allclose(t, [0.0, 1.0, 2.0])
    np.testing.assert_allclose(rate, [2.0, 1.0, 4.0])


def test_goodput_with_an_e2e_target_as_vllms_e2el():
    """vLLM's `--goodput e2el:MS` (a request good only if it ended within MS); goodput had only TTFT and TPOT."""
    quick = rec(0.0, [0.1, 0.2], 0.3)           # e2e .3
    long = rec(0.0, [0.1, 0.2, 0.3, 0.9], 0.9)  # e2e .9, ttft and tpot fine
    failed = rec(0.0, [], 0.1, tokens=0, error="boom")
    assert [good(r, 0.5, 0.5, 0.5) for r in (quick, long, failed)] == [True, False, False]
    s = summarize([quick, long, failed], duration=2.0, e2e_target=0.5)
    assert s.goodput == pytest.approx(1 / 2.0) and s.e2e_target == 0.5


def test_total_token_throughput_counts_prompt_and_output_tokens_of_completed_requests():
    """vLLM's "Total Token throughput" = (input + output tokens of the requests that succeeded) / duration."""
    a = rec(0.0, [0.5, 1.0, 1.5, 2.0], 2.0)          # 4 tokens
    b = rec(1.0, [1.2, 1.4], 1.4)                      # 2 tokens
    c = rec(2.0, [], 2.5, tokens=0, error="HTTP 500")  # failed: its prompt is in no count
    a.prompt_tokens, b.prompt_tokens, c.prompt_tokens = 30, 14, 1000
    s = summarize([a, b, c], duration=4.0)
    assert s.prompt_tokens == 44
    assert s.total_token_throughput == pytest.approx((44 + 6) / 4.0)  # 12.5 tok/s
    assert summarize([], duration=0.0).total_token_throughput == 0.0
