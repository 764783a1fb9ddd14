"""/metrics and the latency log count what clients got: one request per HTTP request (n > 1 and several prompts
included: one response), its prompt and completion tokens as its usage says, its TTFT once."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.server.conftest import metric, running_server

COUNTED = ("lineside_time_to_first_token_seconds_count", "lineside_e2e_request_latency_seconds_count",
           "lineside_request_queue_time_seconds_count")


@pytest.fixture(scope="module")
def srv(tiny_bundle, tmp_path_factory):
    log = tmp_path_factory.mktemp("latency") / "latency.jsonl"
    with running_server(tiny_bundle, num_slots=4, threads=1, latency_log=log) as s:
        s.latency_log = log
        yield s


def _scrape(srv) -> str:
    return httpx.get(srv.url + "/metrics").text


def _requests(text: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("lineside_requests_total{"))


def _log_lines(srv) -> list[dict]:
    return [json.loads(x) for x in srv.latency_log.read_text().splitlines()] if srv.latency_log.exists() else []


@contextmanager
def _counted(srv) -> Iterator[threading.Event]:
    """An event the server sets when it counts a finished request (a metrics listener: a stream the client left is
    counted when the server notices, after the client is gone)."""
    seen = threading.Event()
    listeners = srv.app.state.lineside.metrics.listeners

    def listener(record) -> None:
        seen.set()

    listeners.append(listener)
    try:
        yield seen
    finally:
        listeners.remove(listener)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", [{"prompt": "count me once", "n": 3},
                                  {"prompt": ["first prompt", "the second, longer prompt"], "n": 2}])
def test_one_http_request_is_one_request_in_metrics_and_log(srv, body, stream):
    before, lines_before = _scrape(srv), len(_log_lines(srv))
    body = {**body, "max_tokens": 4, "temperature": 1.0, "seed": 3, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    usage = (json.loads(r.text.split("data: ")[-2]) if stream else r.json())["usage"]
    after = _scrape(srv)
    assert _requests(after) - _requests(before) == 1
    for name in COUNTED:
        assert metric(after, name) - metric(before, name) == 1, name
    assert metric(after, "lineside_prompt_tokens_total") - metric(before, "lineside_prompt_tokens_total") \
        == usage["prompt_tokens"]
    assert metric(after, "lineside_generation_tokens_total") - metric(before, "lineside_generation_tokens_total") \
        == usage["completion_tokens"]
    lines = _log_lines(srv)[lines_before:]
    assert len(lines) == 1, lines  # one line per request, under the id the client was given
    assert lines[0]["request_id"] == r.headers["x-request-id"]
    assert (lines[0]["prompt_tokens"], lines[0]["completion_tokens"]) == (usage["prompt_tokens"],
                                                                          usage["completion_tokens"])
    assert lines[0]["outcome"] == "length" and 0 < lines[0]["ttft_s"] <= lines[0]["e2e_s"]


def test_a_streamed_n_request_the_client_leaves_is_one_cancelled_request(srv):
    before = _scrape(srv)
    body = {"prompt": "leave early", "n": 2, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with _counted(srv) as counted:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # a token came: leave
        assert counted.wait(20), "the request the client left was never counted"
    after = _scrape(srv)
    assert metric(after, "lineside_requests_total", 'outcome="cancelled"') \
        - metric(before, "lineside_requests_total", 'outcome="cancelled"') == 1
    assert _requests(after) - _requests(before) == 1
    assert metric(after, "lineside_e2e_request_latency_seconds_count") \
        - metric(before, "lineside_e2e_request_latency_seconds_count") == 1
    assert metric(after, "lineside_time_to_first_token_seconds_count") \
        - metric(before, "lineside_time_to_first_token_seconds_count") == 1


def test_combined_record_takes_the_worst_outcome_and_the_choices_own_tpot():
    from lineside.server.metrics import RequestRecord, combined

    def rec(outcome, first, end, tokens):
        return RequestRecord("r", "chat", "normal", mode="realtime", stream=True, arrival=0.0, outcome=outcome,
                             prompt_tokens=5, completion_tokens=tokens, first_token=first, end=end)

    one = combined([rec("stop", 0.5, 1.5, 11), rec("error", 0.25, 2.25, 21), rec("cancelled", None, 3.0, 0)],
                   prompt_tokens=5)
    assert one.outcome == "error" and one.prompt_tokens == 5 and one.completion_tokens == 32
    assert one.ttft_s == 0.25 and one.e2e_s == 3.0 and one.extra["choices"] == 3
    assert one.tpot_s == pytest.approx((0.1 + 0.1) / 2)  # each choice's own, not 2.75 s over 31 tokens


@pytest.mark.parametrize("stream", [False, True])
def test_inter_token_latency_has_one_sample_per_gap_between_tokens(srv, stream):
    """vLLM's inter_token_latency_seconds (DESIGN names it): each gap between a choice's successive tokens."""
    before = _scrape(srv)
    body = {"prompt": "gaps", "max_tokens": 7, "ignore_eos": True, "n": 2, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    after = _scrape(srv)
    name = "lineside_inter_token_latency_seconds"
    assert metric(after, name + "_count") - metric(before, name + "_count") == 2 * (7 - 1)
    assert metric(after, name + "_bucket", 'le="+Inf"') == metric(after, name + "_count")
    assert metric(after, name + "_sum") > metric(before, name + "_sum")


def test_cpu_scale_latencies_land_in_a_finite_bucket():
    """A 7B model on a line PC's CPU takes minutes to first token behind a queue and tens of minutes end to end:
    such a request must land in a finite bucket near its value, or every quantile of it reads as the last bound
    (80 s TTFT, 60 s queue) however slow the server really is. vLLM's TTFT buckets reach 2560 s, E2E 7680 s."""
    from lineside.server.metrics import RequestRecord, ServerMetrics

    m = ServerMetrics()
    m.observe(RequestRecord("slow", "chat", "normal", mode="realtime", stream=True, arrival=0.0, outcome="length",
                            prompt_tokens=2000, completion_tokens=1000, first_token=300.0, end=1500.0,
                            queue_s=200.0))
    text = m.render().decode()
    for name, value in (("lineside_time_to_first_token_seconds", 300.0), ("lineside_request_queue_time_seconds", 200.0),
                        ("lineside_e2e_request_latency_seconds", 1500.0)):
        bounds = [float(line.split('le="')[1].split('"')[0]) for line in text.splitlines()
                  if line.startswith(name + "_bucket{") and 'le="+Inf"' not in line]
        upper = min((b for b in bounds if b >= value), default=None)
        assert upper is not None and upper <= 4 * value, (name, bounds)
        assert metric(text, name + "_bucket", f'le="{upper}"') == 1


def test_a_latency_log_that_cannot_be_written_does_not_fail_requests(tiny_bundle, caplog):
    """The disk under --latency-log fills up (here /dev/full): requests are answered and counted as before, and
    the log says once what is wrong, instead of every finished request turning into a 500 or a cut stream."""
    body = {"prompt": "disk full", "max_tokens": 3, "ignore_eos": True}  # each ends at its length, whatever it samples
    with running_server(tiny_bundle, num_slots=2, threads=1, latency_log="/dev/full") as s:
        plain = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        streamed = httpx.post(s.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        again = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        text = _scrape(s)
    assert plain.status_code == again.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert metric(text, "lineside_requests_total", 'outcome="length"') == 3
    said = [r.getMessage() for r in caplog.records if "/dev/full" in r.getMessage()]
    assert len(said) == 1 and "latency log" in said[0], said


def test_latency_log_follows_logrotate(tmp_path):
    """logrotate renames the log and expects a new file (its default, without copytruncate): the next line goes to a
    new file at --latency-log, as logging.WatchedFileHandler does, not into the rotated file, which a later
    rotation compresses and deletes."""
    from lineside.server.metrics import RequestRecord, ServerMetrics

    log = tmp_path / "latency.jsonl"
    m = ServerMetrics(log)

    def finish(rid: str) -> None:
        m.observe(RequestRecord(rid, "chat", "normal", mode="realtime", stream=False, arrival=0.0, outcome="stop",
                                completion_tokens=1, first_token=0.1, end=0.2))

    def ids(path) -> list[str]:
        return [json.loads(x)["request_id"] for x in path.read_text().splitlines()]

    finish("before")
    log.rename(tmp_path / "latency.jsonl.1")
    finish("after")
    finish("after, too")
    assert ids(tmp_path / "latency.jsonl.1") == ["before"] and ids(log) == ["after", "after, too"]
    log.unlink()  # removed by hand: a new file too
    finish("deleted")
    m.close()
    assert ids(log) == ["deleted"]


def test_slow_token_gaps_land_in_a_finite_bucket():
    """Between tokens a CPU-served request can wait seconds (a 7B model's step at 8 rows) or minutes (a batch job
    preempted for realtime work, rebuilding its KV): TPOT and the inter-token gaps past 2.5 s all fell into +Inf,
    so every quantile of a stalled server read 2.5 s. vLLM's TPOT and inter-token buckets reach 80 s."""
    from lineside.server.metrics import RequestRecord, ServerMetrics

    m = ServerMetrics()
    m.observe(RequestRecord("slow", "chat", "normal", mode="batch", stream=True, arrival=0.0, outcome="length",
                            prompt_tokens=10, completion_tokens=3, first_token=1.0, end=9.0, itl=[3.0, 5.0]))
    m.observe(RequestRecord("stalled", "chat", "normal", mode="batch", stream=True, arrival=0.0, outcome="length",
                            prompt_tokens=10, completion_tokens=2, first_token=1.0, end=61.0, itl=[60.0]))
    text = m.render().decode()
    for name, values in (("lineside_time_per_output_token_seconds", (4.0, 60.0)),
                         ("lineside_inter_token_latency_seconds", (3.0, 5.0, 60.0))):
        bounds = [float(line.split('le="')[1].split('"')[0]) for line in text.splitlines()
                  if line.startswith(name + "_bucket{") and 'le="+Inf"' not in line]
        for value in values:
            upper = min((b for b in bounds if b >= value), default=None)
            assert upper is not None and upper <= 2 * value, (name, value, bounds)


def test_a_prompt_that_never_ran_is_not_counted_as_processed():
    """A request cancelled while it waited (no slot, no token) counted its prompt in lineside_prompt_tokens_total,
    which vLLM counts as prompt tokens processed; one admitted (a queue time) or answered counts it."""
    from lineside.server.metrics import RequestRecord, ServerMetrics

    m = ServerMetrics()
    base = dict(mode="realtime", stream=True, arrival=0.0, end=1.0, prompt_tokens=100)
    m.observe(RequestRecord("waited", "chat", "normal", outcome="cancelled", **base))
    assert metric(m.render().decode(), "lineside_prompt_tokens_total") == 0
    m.observe(RequestRecord("ran", "chat", "normal", outcome="cancelled", queue_s=0.2, **base))
    m.observe(RequestRecord("done", "chat", "normal", outcome="stop", queue_s=0.0, first_token=0.5,
                            completion_tokens=3, **base))
    text = m.render().decode()
    assert metric(text, "lineside_prompt_tokens_total") == 200 and metric(text, "lineside_requests_total",
                                                                          'outcome="cancelled"') == 2


@pytest.mark.parametrize(("headers", "status"), [
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415),  # curl -d without -H
    ({"Content-Type": "application/json", "Content-Encoding": "gzip"}, 415),
    ({"Content-Type": "application/json", "X-Request-Id": "two words"}, 400),
], ids=["form", "gzip", "request-id"])
def test_every_refused_generation_request_is_counted_invalid(srv, headers, status):
    """A request refused before its body is read is a refused request as a malformed body's 400 is, whichever layer
    refuses it (the browser guard's 415, the request-id check)."""
    before = _scrape(srv)
    r = httpx.post(srv.url + "/v1/chat/completions", content=b'{"messages": []}', headers=headers, timeout=30)
    assert r.status_code == status, r.text
    after = _scrape(srv)
    assert metric(after, "lineside_requests_total", 'outcome="invalid"') \
        - metric(before, "lineside_requests_total", 'outcome="invalid"') == 1
    assert _requests(after) - _requests(before) == 1


def test_an_empty_request_id_header_is_an_absent_one(srv):
    """A proxy that forwards an unset variable sends ``X-Request-Id:`` empty (or blank): that was a 400 for every
    request through it, health probes included. It is served under an id the server makes, echoed and logged."""
    before, lines_before = _scrape(srv), len(_log_lines(srv))
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "no id", "max_tokens": 2},
                   headers={"X-Request-Id": ""}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"].startswith("req-") and r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    assert [line["request_id"] for line in _log_lines(srv)[lines_before:]] == [r.headers["x-request-id"]]
    assert metric(_scrape(srv), "lineside_requests_total", 'outcome="length"') \
        - metric(before, "lineside_requests_total", 'outcome="length"') == 1
    probe = httpx.get(srv.url + "/health/ready", headers={"X-Request-Id": ""}, timeout=30)
    assert probe.status_code == 200 and probe.headers["x-request-id"].startswith("req-"), probe.text
    bad = httpx.get(srv.url + "/health", headers={"X-Request-Id": "two words"}, timeout=30)
    assert bad.status_code == 400 and "leave the header out" in bad.json()["error"]["message"]
