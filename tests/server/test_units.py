"""The server's pure parts without a model: SSE chunk shapes, request conversion and hygiene, token
budgets, validation messages, metrics and the latency log, and `lineside serve` argument errors."""

from __future__ import annotations

import json

import pytest
import typer
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from lineside.errors import LinesideError
from lineside.runtime.request import check_prompt_ids
from lineside.server import request_mapping, sse
from lineside.server.errors import APIError, validation_message
from lineside.server.metrics import RequestRecord, ServerMetrics
from lineside.server.schemas import ChatCompletionRequest, CompletionRequest


def test_sse_chat_sequence_like_openai():
    w = sse.ChunkWriter(True, "chatcmpl-1", 123, model="m", include_usage=True)
    body = w.role(0) + w.text(0, "héllo") + w.finish(0, "stop") + w.usage(3, 2) + sse.DONE
    assert body.endswith("data: [DONE]\n\n") and body.count("\n\n") == 5
    ev = sse.parse(body)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ev[1]["choices"][0]["delta"] == {"content": "héllo"} and "héllo" in body  # UTF-8 kept, not \u escapes
    assert ev[2]["choices"][0]["delta"] == {} and ev[2]["choices"][0]["finish_reason"] == "stop"
    assert all(e["usage"] is None for e in ev[:3])
    assert ev[3]["choices"] == [] and ev[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert {e["object"] for e in ev[:4]} == {"chat.completion.chunk"} and {e["id"] for e in ev[:4]} == {"chatcmpl-1"}



def test_chunks_are_the_bytes_of_the_whole_object_encoded():
    """The chunk writer encodes only the choice per token; the bytes are those of the whole object encoded."""
    for chat, usage in ((True, True), (False, False), (True, False)):
        w = sse.ChunkWriter(chat, "id-\"1\"", 7, model="mödel", include_usage=usage, fingerprint="fp")
        choice = {"index": 0, "text": "a\"b\\ü\n", "logprobs": None, "finish_reason": None}
        whole = {**w.base, "choices": [choice], **({"usage": None} if usage else {})}
        assert w._chunk(choice) == sse.event(whole)

def test_sse_text_completion_and_error_event():
    w = sse.ChunkWriter(False, "cmpl-1", 1, model="m", include_usage=False)
    ev = sse.parse(w.text(1, "a") + w.finish(1, "length"))
    assert ev[0]["object"] == "text_completion" and ev[0]["choices"][0] == {
        "index": 1, "text": "a", "logprobs": None, "finish_reason": None}
    assert "usage" not in ev[0] and ev[1]["choices"][0]["finish_reason"] == "length"
    err = sse.parse(sse.error_event("too slow", "timeout_error", "request_timeout"))[0]
    assert err == {"error": {"message": "too slow", "type": "timeout_error", "code": "request_timeout", "param": None}}
    with pytest.raises(ValueError):
        sse.parse("event: x\n\n")


@pytest.mark.parametrize("raw,clean", [
    ("\ufeffhello", "hello"),
    ("a\u200bb\u2060c\u00add", "abcd"),
    ("\u200dword\u200c", "word"),
    ("x\u200dy", "xy"),  # joiner next to ASCII: an artefact
    ("👨\u200d👩\u200d👧", "👨\u200d👩\u200d👧"),  # emoji ZWJ sequence kept
    ("می\u200cخواهم", "می\u200cخواهم"),  # Persian ZWNJ kept
    ("plain ascii", "plain ascii"),
])
def test_clean_text(raw, clean):
    assert request_mapping.clean_text(raw, "prompt") == clean


def test_clean_text_refuses_lone_surrogate():
    with pytest.raises(APIError) as e:
        request_mapping.clean_text("a\ud800b", "prompt")
    assert e.value.status == 400 and e.value.code == "invalid_utf8"


def test_token_budget_numbers():
    assert request_mapping.token_budget(10, None, None, context=256, param="max_tokens", prompt_param="messages") == 246
    assert request_mapping.token_budget(10, None, 16, context=256, param="max_tokens", prompt_param="prompt") == 16
    assert request_mapping.token_budget(250, None, 16, context=256, param="max_tokens", prompt_param="prompt") == 6
    assert request_mapping.token_budget(10, 246, None, context=256, param="max_tokens", prompt_param="prompt") == 246
    with pytest.raises(APIError) as e:
        request_mapping.token_budget(10, 247, None, context=256, param="max_completion_tokens", prompt_param="messages")
    assert e.value.message.startswith("prompt (10 tokens) + max_completion_tokens (247) = 257 tokens exceeds")
    assert "at most 246" in e.value.message and e.value.param == "max_completion_tokens"
    with pytest.raises(APIError, match="300 tokens but the model's context is 256"):
        request_mapping.token_budget(300, None, None, context=256, param="max_tokens", prompt_param="messages")
    with pytest.raises(APIError, match="empty"):
        request_mapping.token_budget(0, 5, None, context=256, param="max_tokens", prompt_param="prompt")


def test_token_budget_names_the_tools_rendered_into_the_prompt():
    """Tools count toward the prompt (their schemas rendered with the messages): a 400 says so and offers cutting
    them, both when nothing is left to generate and when max_tokens asks too much; without tools, as before."""
    with pytest.raises(APIError) as e:
        request_mapping.token_budget(300, None, None, context=256, param="max_tokens", prompt_param="messages", tools=2)
    assert e.value.message == ("prompt ('messages' with the 2 tools rendered into the prompt) has 300 tokens but the "
                               "model's context is 256 tokens, which leaves no room to generate; shorten 'messages' "
                               "or send fewer or shorter tools")
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(APIError) as e:
        request_mapping.token_budget(200, 57, None, context=256, param="max_output_tokens", prompt_param="input",
                                     tools=1)
    assert e.value.message == ("prompt ('input' with the 1 tool rendered into the prompt) (200 tokens) + "
                               "max_output_tokens (57) = 257 tokens exceeds the model's context of 256 tokens; lower "
                               "max_output_tokens to at most 56 or shorten 'input' or send fewer or shorter tools")
    assert e.value.param == "max_output_tokens"
    with pytest.raises(APIError) as e:
        request_mapping.token_budget(300, None, None, context=256, param="max_tokens", prompt_param="messages")
    assert "tool" not in e.value.message and e.value.message.endswith("shorten the prompt")


def test_sampling_defaults_follow_openai():
    p = request_mapping.sampling_params(CompletionRequest(prompt="x"))
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.seed is None
    p = request_mapping.sampling_params(CompletionRequest(prompt="x", temperature=0, top_k=-1, min_p=0.1, seed=5,
                                                  repetition_penalty=1.2, presence_penalty=-1, frequency_penalty=2))
    assert (p.temperature, p.top_k, p.min_p, p.seed, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty) == (0, 0, 0.1, 5, 1.2, -1, 2)


def test_unsupported_parameters_are_refused():
    for kw, param in ((dict(max_tokens=0), "max_tokens"),  # 0 only with echo
                      (dict(best_of=2), "best_of"), (dict(suffix="s"), "suffix")):
        with pytest.raises(APIError) as e:
            request_mapping.check_completion(CompletionRequest(prompt="x", **kw))
        assert e.value.param == param and e.value.status == 400
    msg = [{"role": "user", "content": "x"}]
    for kw in (dict(functions=[{"name": "f"}]), dict(function_call={"name": "f"})):  # the deprecated forms
        with pytest.raises(APIError):
            request_mapping.check_chat(ChatCompletionRequest(messages=msg, **kw))
    request_mapping.check_chat(ChatCompletionRequest(messages=msg, response_format={"type": "text"}, n=1, logprobs=False))


def test_chat_messages_parts_and_refusal():
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "\ufeffa"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}])
    assert request_mapping.chat_messages(req) == [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "a\nb"},
                                          {"role": "assistant", "content": ""}]
    img = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    with pytest.raises(APIError, match="image_url"):
        request_mapping.chat_messages(img)
    with pytest.raises(APIError, match="no 'text' field"):
        request_mapping.chat_messages(ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text"}]}]))
    for function in ("x", [1], True, None, {"arguments": "{}"}, {"name": 5}, {"name": "f", "arguments": 3}):
        # an assistant turn's tool call with no {name, arguments} object: a 500 (TypeError/ValueError rendering it)
        bad = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": function}]}])
        with pytest.raises(APIError, match="a tool call is") as e:
            request_mapping.chat_messages(bad)
        assert e.value.status == 400 and e.value.param == "messages.1.tool_calls.0.function"
    for text in (None, 5, ["a"]):  # a 500 (TypeError joining the parts) on chat, prefill and streams
        bad = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": text}]}])
        with pytest.raises(APIError, match="'text' must be a string") as e:
            request_mapping.chat_messages(bad)
        assert e.value.status == 400 and e.value.param == "messages.0.content"


def test_stop_and_priority():
    assert request_mapping.stop_list(CompletionRequest(prompt="x", stop="\n")) == ["\n"]
    assert request_mapping.stop_list(CompletionRequest(prompt="x", stop=["a", "", "b"])) == ["a", "b"]
    with pytest.raises(APIError):
        request_mapping.stop_list(CompletionRequest(prompt="x", stop=[str(i) for i in range(17)]))
    assert request_mapping.priority({}) == ("normal", "realtime")
    assert request_mapping.priority({"x-priority": " HIGH ", "x-mode": "batch"}) == ("high", "batch")
    with pytest.raises(APIError, match="X-Mode"):
        request_mapping.priority({"x-mode": "now"})
    # behind the fleet gateway the class arrives in tracestate (SMG forwards it); own headers win
    carried = {"tracestate": "other=x, lineside=priority:LOW;mode:batch"}
    assert request_mapping.priority(carried) == ("low", "batch")
    assert request_mapping.priority({**carried, "x-priority": "high"}) == ("high", "batch")
    assert request_mapping.priority({"tracestate": "lineside=garbage"}) == ("normal", "realtime")
    with pytest.raises(APIError, match=r"X-Priority 'urgent' \(read from the tracestate header's lineside member\)"):
        request_mapping.priority({"tracestate": "lineside=priority:urgent"})
    with pytest.raises(APIError, match=r"X-Mode 'bulk' \(read from the tracestate"):
        request_mapping.priority({"tracestate": "lineside=mode:bulk", "x-priority": "high"})
    with pytest.raises(APIError, match=r"^X-Mode 'bulk' is not one of realtime, batch$"):  # its own header: no hint
        request_mapping.priority({"tracestate": "lineside=mode:batch", "x-mode": "bulk"})


def test_completion_prompt_forms():
    class Tok:
        def encode(self, text, add_special=None, max_tokens=None):  # the Tokenizer's signature
            return [1, *[ord(c) % 50 for c in text]]

    f = request_mapping.completion_prompts
    assert f(CompletionRequest(prompt="ab"), Tok(), 100) == [[1, 47, 48]]
    assert f(CompletionRequest(prompt=["a", "\u200bb"]), Tok(), 100) == [[1, 47], [1, 48]]
    assert f(CompletionRequest(prompt=[5, 6]), Tok(), 100) == [[5, 6]]
    assert f(CompletionRequest(prompt=[[5], [7, 8]]), Tok(), 100) == [[5], [7, 8]]
    with pytest.raises(APIError, match="out of vocabulary"):
        f(CompletionRequest(prompt=[[5], [700]]), Tok(), 100)
    with pytest.raises(APIError, match="at most 64"):
        f(CompletionRequest(prompt=["x"] * 65), Tok(), 100)


def test_token_id_prompts_are_refused_as_the_engine_refuses_them():
    """The server's token-id prompts go through the runtime's one prompt check: same line, as a 400 on 'prompt'."""
    for ids in ([5, 700], []):
        with pytest.raises(LinesideError) as runtime:
            check_prompt_ids(ids, 100)
        with pytest.raises(APIError) as server:
            request_mapping.completion_prompts(CompletionRequest(prompt=[[5], ids]), None, 100)
        assert server.value.message == str(runtime.value) and server.value.param == "prompt"
        assert server.value.status == 400 and server.value.code == "invalid_value"
    with pytest.raises(LinesideError, match="prompt has 8 tokens; this model's context is 8"):
        check_prompt_ids([1] * 8, 100, 8)
    check_prompt_ids([0, 99], 100, 3)


def _validation(model, data) -> RequestValidationError:
    try:
        model.model_validate(data)
    except ValidationError as e:
        return RequestValidationError([{**x, "loc": ("body", *x["loc"])} for x in e.errors()])
    raise AssertionError("valid")


def test_validation_messages_are_one_line_with_the_parameter():
    msg, param, code = validation_message(_validation(CompletionRequest, {"prompt": 5}))
    assert param == "prompt" and "matches none of the accepted types" in msg and code == "invalid_value"
    # a list mixing text and token ids: pydantic names only "a valid string"; the line says what a prompt may be
    msg, param, _ = validation_message(_validation(CompletionRequest, {"prompt": ["hi", [1, 2]]}))
    assert param == "prompt" and "a list of token-id lists (not a mix)" in msg and "\n" not in msg
    msg, param, _ = validation_message(_validation(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                                          "stop": [1]}))
    assert param == "stop" and "send a string or a list of strings" in msg
    msg, param, code = validation_message(_validation(ChatCompletionRequest, {}))
    assert msg == "missing required field 'messages'" and code == "missing_field"
    msg, param, _ = validation_message(_validation(ChatCompletionRequest, {"messages": [{"role": "robot"}]}))
    assert param == "messages.0.role" and "\n" not in msg
    msg, param, _ = validation_message(_validation(CompletionRequest, {"prompt": "x", "top_p": 0}))
    assert param == "top_p" and "greater than 0" in msg


def test_validation_message_counts_other_fields_not_the_first_problem_or_union_members():
    """An empty or non-object body is one problem, not '(and 1 more problem)'; a union field failing in each of its
    members is one more problem, not one per member."""
    for body in (None, [1], "hi"):
        msg, param, _ = validation_message(_validation(CompletionRequest, body))
        assert param is None and "more problem" not in msg, msg
    msg, param, _ = validation_message(_validation(CompletionRequest, {"prompt": 5, "top_p": 0}))
    assert param == "top_p" and msg.endswith("(and 1 more problem)"), msg
    msg, _, _ = validation_message(_validation(CompletionRequest, {"prompt": "x", "top_p": 0, "n": 0}))
    assert msg.endswith("(and 1 more problem)"), msg


def test_metrics_observe_and_latency_log(tmp_path):
    log = tmp_path / "sub" / "lat.jsonl"
    m = ServerMetrics(log)
    rec = RequestRecord("r1", "chat", "high", mode="realtime", stream=True, arrival=10.0, outcome="length", prompt_tokens=7,
                        completion_tokens=5, first_token=10.1, end=10.5, queue_s=0.02)
    assert rec.ttft_s == pytest.approx(0.1) and rec.tpot_s == pytest.approx(0.1) and rec.e2e_s == pytest.approx(0.5)
    m.observe(rec)
    m.reject("queue_full")
    m.update_engine({"running": 2, "waiting": 3, "kv_usage": 0.25})
    text = m.render().decode()
    assert 'lineside_requests_total{outcome="length"} 1.0' in text
    assert 'lineside_requests_total{outcome="queue_full"} 1.0' in text
    assert "lineside_prompt_tokens_total 7.0" in text and "lineside_generation_tokens_total 5.0" in text
    assert "lineside_num_requests_waiting 3.0" in text and "lineside_kv_cache_usage_ratio 0.25" in text
    assert 'lineside_time_to_first_token_seconds_bucket{le="0.1"} 1.0' in text
    assert "lineside_request_queue_time_seconds_count 1.0" in text
    m.close()
    line = json.loads(log.read_text())
    assert line["request_id"] == "r1" and line["outcome"] == "length" and line["priority"] == "high"
    assert line["ttft_s"] == pytest.approx(0.1) and line["e2e_s"] == pytest.approx(0.5) and line["queue_s"] == 0.02
    assert ServerMetrics().registry is not m.registry  # own registries: two apps never collide


def _cli() -> typer.Typer:
    from lineside.server.commands import register

    app = typer.Typer(pretty_exceptions_enable=False)
    register(app)

    @app.callback()
    def _root() -> None:
        pass

    return app


@pytest.mark.parametrize("args,needle", [
    (["serve", "/no/such/bundle"], "not a bundle directory"),
    (["serve", ".", "--backend", "gpu"], "--backend"),
    (["serve", ".", "--num-slots", "0"], "--num-slots"),
    (["serve", ".", "--request-timeout", "0"], "--request-timeout"),
    (["serve", ".", "--port", "70000"], "--port"),
])
def test_serve_cli_errors_are_one_line(args, needle, capsys):
    from lineside.cli import run_app

    code = run_app(_cli(), args)  # what `lineside` does with them: ranges are usage errors (exit 2), the rest 1
    err = capsys.readouterr().err.strip()
    assert code in (1, 2) and needle in err and len(err.splitlines()) == 1, err


def test_serve_tensorrt_without_a_trt_graph_fails_before_serving(tiny_bundle, capsys):
    """--backend tensorrt on a cpu-only bundle is one line before the socket opens, not 'serving on ...', the
    startup log and the error (twice) once the engine fails to load."""
    import socket

    from lineside.cli import run_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = run_app(_cli(), ["serve", str(tiny_bundle), "--backend", "tensorrt", "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "no 'trt' graph" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("missing", ["gpu", "engine"])
def test_serve_tensorrt_that_cannot_run_fails_before_serving(trt_bundle, monkeypatch, capsys, missing):
    """--backend tensorrt with no GPU (driver, TensorRT: the same probe) or no engine for this GPU: one line before
    the socket opens, not after 'serving on ...' and the startup log."""
    import socket

    from lineside.cli import run_app
    from lineside.errors import BackendUnavailable
    from lineside.runtime.tensorrt import env as trt_env
    from lineside.runtime.tensorrt import key as keymod

    def no_gpu():
        raise BackendUnavailable(trt_env.NO_GPU.format(err="cudaErrorNoDevice"))

    monkeypatch.setattr(keymod, "machine_key", no_gpu if missing == "gpu" else
                        lambda: keymod.MachineKey("Orin", "8.7", "10.3.0", "12.6"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = run_app(_cli(), ["serve", str(trt_bundle("fp16").path), "--backend", "tensorrt", "--port", str(port)])
    err = capsys.readouterr().err.strip()
    needle = "no CUDA GPU found" if missing == "gpu" else "no TensorRT engine"
    assert code == 1 and needle in err and len(err.splitlines()) == 1, err


def test_ignore_eos_reaches_the_engine_request():
    """vLLM's ``ignore_eos`` (what ``lineside bench --ignore-eos`` sends) keeps the engine going past EOS; a
    string is a 400 like every other strictly typed field."""
    from lineside.runtime.request import Mode, Priority

    def engine_request(body):
        return request_mapping.engine_request([1, 2], 8, body, stops=[], priority=Priority.NORMAL,
                                              mode=Mode.REALTIME, timeout=None, request_id="r")

    assert engine_request(CompletionRequest(prompt="x", ignore_eos=True)).ignore_eos is True
    assert engine_request(CompletionRequest(prompt="x")).ignore_eos is False
    assert engine_request(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                                ignore_eos=True)).ignore_eos is True
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", ignore_eos="yes")


def test_logit_bias_naming_one_token_twice_takes_the_last_bias_not_their_sum():
    """"2" and "02" are the same token id: vLLM keeps the last bias given (its dict of int keys); summed, the
    token got 180, past the -100..100 OpenAI defines."""
    req = CompletionRequest(prompt="hi", logit_bias={"2": 100.0, "5": 1.0, "02": 80.0})
    assert request_mapping.logit_bias(req, vocab_size=10) == ((2, 80.0), (5, 1.0))


@pytest.mark.parametrize("value, kept", [(150.0, 100.0), (-1e9, -100.0), (100.0, 100.0), (-100.0, -100.0),
                                         (3.5, 3.5)])
def test_logit_bias_past_100_is_clamped_to_it_as_vllm_does(value, kept):
    """OpenAI defines biases from -100 to 100; vLLM (its "clamp ... per OpenAI API spec") and llama.cpp's server take
    a larger one rather than refuse the request, so a client that bans a token with -1e9 works against them."""
    req = CompletionRequest(prompt="hi", logit_bias={"3": value})
    assert request_mapping.logit_bias(req, vocab_size=10) == ((3, kept),)


def test_a_chat_answer_is_settled_for_its_next_turn_and_a_completion_is_not():
    """The idle recompute of an answer's KV (scheduler.py) is spent where a next turn extends it: chat, not a
    one-off completion."""
    from lineside.runtime.request import Mode, Priority
    from lineside.server.request_mapping import engine_request
    from lineside.server.schemas import ChatCompletionRequest, CompletionRequest

    common = dict(stops=[], priority=Priority.NORMAL, mode=Mode.REALTIME, timeout=None, request_id="r")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert engine_request([1, 2], 4, chat, **common).settle_answer
    assert not engine_request([1, 2], 4, CompletionRequest(prompt="hi"), **common).settle_answer
