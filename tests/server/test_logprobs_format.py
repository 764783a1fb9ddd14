"""Logprobs in OpenAI's shapes and the request checks (top_logprobs > 20 is a 400 naming it)."""

from __future__ import annotations

import json

import pytest

from lineside.runtime.sampling import TokenLogprob
from lineside.server.errors import APIError
from lineside.server.logprobs import LogprobFormatter, chat_top_n, completion_top_n, token_text

BYTES = {0: b"Hi", 1: b" \xf0\x9f", 2: b"\x98\x80", 3: b"!"}
FMT = LogprobFormatter(BYTES.__getitem__)
LPS = [TokenLogprob(0, -0.1, ((0, -0.1), (3, -2.5))), TokenLogprob(1, -0.7, ((1, -0.7), (2, -1.0), (3, -3.0)))]


def test_chat_entries_carry_bytes_and_cut_top():
    e = FMT.chat(LPS, top_n=1)
    assert e[0] == {"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                    "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}
    assert e[1]["token"] == "bytes:\\x20\\xf0\\x9f" and e[1]["bytes"] == [32, 0xF0, 0x9F]
    assert FMT.chat(LPS, top_n=0)[1]["top_logprobs"] == []


def test_completion_block():
    b = FMT.completion(LPS, top_n=2, offset=5)
    assert b["tokens"] == ["Hi", "bytes:\\x20\\xf0\\x9f"] and b["token_logprobs"] == [-0.1, -0.7]
    assert b["top_logprobs"][1] == {"bytes:\\x20\\xf0\\x9f": -0.7, "bytes:\\x98\\x80": -1.0}
    assert b["text_offset"] == [5, 7]
    assert token_text("é".encode()) == "é"


@pytest.mark.parametrize("lp, top, param", [(True, 21, "top_logprobs"), (True, -1, "top_logprobs"),
                                            (False, 3, "top_logprobs"), ("yes", None, "logprobs"),
                                            (1, None, "logprobs"), (0, 2, "logprobs")])  # a boolean, as OpenAI's  # 0 without logprobs is fine
def test_bad_chat_logprobs(lp, top, param):
    with pytest.raises(APIError) as e:
        chat_top_n(lp, top)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_good_values():
    assert chat_top_n(None, None) is None and chat_top_n(True, None) == 0 and chat_top_n(True, 20) == 20
    assert completion_top_n(None) is None and completion_top_n(0) == 0 and completion_top_n(5) == 5
    assert completion_top_n(20) == 20  # vLLM's bound (a vLLM client's 10 was a 400 at OpenAI's 5)
    for bad in (21, -1, True, "2"):
        with pytest.raises(APIError) as e:
            completion_top_n(bad)
        assert e.value.param == "logprobs"


def test_text_offsets_index_the_text_when_a_character_spans_tokens():
    """text_offset is where each token starts in the choice's text. It added up the tokens' display strings, and a
    token holding part of a character is shown as ``bytes:\\x98\\x80`` (15 characters), so for emoji or CJK text
    the offsets ran far past the text's end; it now counts the characters the tokens before it decoded to, across
    stream chunks too (a character's bytes may be split between two events)."""
    from lineside.runtime.request import TokenEvent
    from lineside.server import sse
    from lineside.server.outputs import ChoiceOutput, OutputOptions

    ids = [0, 1, 2, 3]
    text = b"".join(BYTES[t] for t in ids).decode()  # "Hi 😀!"
    assert FMT.completion([TokenLogprob(t, -1.0, ()) for t in ids], top_n=0)["text_offset"] == [0, 2, 3, 4]
    assert [text[i] for i in (0, 2, 3, 4)] == ["H", " ", "😀", "!"]
    options = OutputOptions(chat=False, top_logprobs=0, formatter=FMT)
    streamed, writer = ChoiceOutput(options), sse.ChunkWriter(False, "cmpl-1", 0, model="m", include_usage=False)
    offsets = []
    for part in ([0, 1], [2, 3]):  # the emoji's bytes split between two events
        event = TokenEvent("", part, None, 1, 2, logprobs=[TokenLogprob(t, -1.0, ()) for t in part])
        for chunk in streamed.chunks(writer, 0, event):
            offsets += json.loads(chunk.removeprefix("data: "))["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [0, 2, 3, 4]


def test_completion_top_logprobs_carry_the_sampled_token():
    """OpenAI's completions: "The API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements" (vLLM's completions likewise); a sampled token outside the top n was missing. Chat's
    top_logprobs stay the top n: the chosen token has its own entry there."""
    sampled = [TokenLogprob(3, -3.0, ((0, -0.1), (1, -0.7), (2, -1.0)))]
    assert FMT.completion(sampled, top_n=2)["top_logprobs"] == [{"Hi": -0.1, "bytes:\\x20\\xf0\\x9f": -0.7, "!": -3.0}]
    assert FMT.completion(sampled, top_n=0)["top_logprobs"] == [{"!": -3.0}]
    assert FMT.completion(LPS, top_n=1)["top_logprobs"] == [{"Hi": -0.1}, {"bytes:\\x20\\xf0\\x9f": -0.7}]
    assert [e["token"] for e in FMT.chat(sampled, top_n=2)[0]["top_logprobs"]] == ["Hi", "bytes:\\x20\\xf0\\x9f"]
