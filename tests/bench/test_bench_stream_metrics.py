"""The bench client's numbers from scripted SSE streams on an injected clock (httpx MockTransport, no server, no
sleeps): multi-token chunks, missing usage, streams cut before [DONE], error events. Every expected value is worked
out by hand from the script, against vLLM `bench serve`'s definitions (vllm/benchmarks/serve.py calculate_metrics,
vllm/benchmarks/lib/endpoint_request_func.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lineside.bench.client import ClientConfig, TokenSource, send
from lineside.bench.metrics import itls, summarize, tpot, ttft
from lineside.bench.prompts import Prompt


class Clock:
    """A clock the stream script moves; the client reads it for every timestamp."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _chunk(text: str, index: int = 0, finish: str | None = None, chat: bool = False) -> dict:
    choice = {"index": index, "delta": {"content": text}} if chat else {"index": index, "text": text}
    return {"choices": [{**choice, "finish_reason": finish}]}


def _send(script, clock: Clock, *, endpoint: str = "completions", prompts: int = 1, count_tokens=None,
          status: int = 200, content_type: str = "text/event-stream"):
    """Send one request whose answer is `script`: (time, event) pairs, the clock set to each time before its
    event (a dict sent as an SSE event, bytes as they are) reaches the client. A request with several chat prompts gets the same script on every call."""

    def handler(request: httpx.Request) -> httpx.Response:
        async def body():
            for at, event in script:
                clock.now = at
                yield event if isinstance(event, bytes) else _sse(event)
        return httpx.Response(status, headers={"content-type": content_type}, content=body())

    cfg = ClientConfig(base_url="http://fake", endpoint=endpoint, model="m", max_tokens=16, clock=clock,
                       count_tokens=count_tokens)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, cfg, [Prompt(text=f"p{i}") for i in range(prompts)], 0.0)

    return asyncio.run(go())


def words(text: str) -> int:
    """A whitespace tokenizer: each word one token (what the hand computations below count)."""
    return len(text.split())


MULTI = [  # sent at 0; 6 tokens in 3 chunks (2 + 1 + 3, as speculative decoding or a detokenizer holdback sends)
    (0.5, _chunk(" a b")),
    (0.6, _chunk(" c")),
    (0.9, _chunk(" d e f")),
    (1.0, _chunk("", finish="length")),
]


def test_multi_token_chunks_with_usage_are_vllms_numbers():
    clock = Clock()
    rec = _send([*MULTI, (1.0, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}),
                 (1.0, DONE)], clock)
    assert rec.ok and rec.output_tokens == 6 and rec.token_source == TokenSource.USAGE
    assert ttft(rec) == pytest.approx(0.5)
    # ITL: one sample per streamed chunk, as vLLM (its itl list gets one gap per chunk, a k-token chunk is one)
    assert itls(rec) == pytest.approx([0.1, 0.3])
    # TPOT from the usage count, not the 3 chunks: (1.0 - 0.5) / (6 - 1)
    assert tpot(rec) == pytest.approx(0.1)
    assert rec.prompt_tokens == 3


def test_without_usage_output_tokens_are_the_texts_tokens_when_a_tokenizer_is_known():
    """A server that ignores stream_options.include_usage: vLLM counts the generated text's tokens with the
    tokenizer (its chunks may carry several); one per chunk said 3 tokens here and a TPOT of 0.25 s."""
    clock = Clock()
    rec = _send([*MULTI, (1.0, DONE)], clock, count_tokens=words)
    assert rec.ok and rec.output_tokens == 6 and rec.token_source == TokenSource.TOKENIZER
    assert tpot(rec) == pytest.approx(0.5 / 5)


def test_without_usage_or_tokenizer_chunks_are_counted_and_said_so():
    clock = Clock()
    rec = _send([*MULTI, (1.0, DONE)], clock)
    assert rec.ok and rec.output_tokens == 3 and rec.token_source == TokenSource.CHUNKS


def test_list_prompt_choices_are_counted_by_tokenizer_and_the_total_by_usage():
    """/v1/completions with two prompts: usage is the request's total; each choice's TPOT needs its own count."""
    clock = Clock()
    script = [(0.2, _chunk(" a b", 0)), (0.3, _chunk(" x", 1)), (0.4, _chunk(" c d", 0)), (0.7, _chunk(" y z", 1)),
              (0.7, {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 7}}), (0.8, DONE)]
    rec = _send(script, clock, prompts=2, count_tokens=words)
    assert rec.output_tokens == 7 and rec.choice_tokens == {0: 4, 1: 3}
    # choice 0: (0.4 - 0.2) / 3; choice 1: (0.7 - 0.3) / 2; mean of the two
    assert tpot(rec) == pytest.approx((0.2 / 3 + 0.4 / 2) / 2)


def test_a_stream_cut_before_done_is_a_failed_request():
    """The body ended (cleanly, as a proxy or a crashed worker may end it) after two chunks, with no
    finish_reason and no [DONE]: its short E2E must not enter the latencies as a success."""
    clock = Clock()
    rec = _send([(0.5, _chunk(" a")), (0.6, _chunk(" b"))], clock)
    assert not rec.ok
    assert "before [DONE]" in rec.error and "cut" in rec.error


def test_a_stream_that_finished_every_choice_without_done_is_complete():
    clock = Clock()
    rec = _send([(0.5, _chunk(" a")), (0.6, _chunk(" b", finish="stop"))], clock)
    assert rec.ok, rec.error
    assert rec.output_tokens == 2


def test_an_answer_that_is_not_an_event_stream_is_one_clear_error():
    clock = Clock()
    body = json.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}).encode()
    rec = _send([(0.3, body)], clock, content_type="application/json")
    assert not rec.ok and "not an SSE stream" in rec.error and "application/json" in rec.error


def test_chat_calls_of_one_request_each_need_their_end():
    clock = Clock()
    script = [(0.1, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}), (0.4, _chunk(" a", chat=True)),
              (0.5, _chunk(" b", chat=True, finish="stop")), (0.5, DONE)]
    rec = _send(script, clock, endpoint="chat", prompts=2)
    assert rec.ok and rec.output_tokens == 4 and len(rec.chunk_times) == 2
    assert ttft(rec) == pytest.approx(0.4)  # the role-only delta carries no token


def test_summary_of_a_run_with_a_cut_and_an_error_event_by_hand():
    """Three requests on one clock: a good one, one cut off mid-stream, one whose stream sends an error event.
    Only the good one enters latencies and throughput; the two others are failed."""
    clock = Clock()
    good = _send([*MULTI, (1.0, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}),
                  (1.0, DONE)], clock)
    cut = _send([(0.2, _chunk(" a")), (0.25, _chunk(" b"))], clock)
    err = _send([(0.3, _chunk(" a")), (0.4, {"error": {"message": "engine died"}})], clock)
    s = summarize([good, cut, err], duration=2.0)
    assert (s.requests, s.completed, s.failed) == (3, 1, 2)
    assert s.output_tokens == 6 and s.output_throughput == pytest.approx(3.0)
    assert s.request_throughput == pytest.approx(0.5)
    assert s.ttft["mean"] == pytest.approx(0.5) and s.e2e["p99"] == pytest.approx(1.0)
    assert s.itl["mean"] == pytest.approx(0.2)  # (0.1 + 0.3) / 2: the failed requests' gaps are left out
    assert "engine died" in err.error
