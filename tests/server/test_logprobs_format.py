"""Logprobs in OpenAI's shapes and the request checks (top_logprobs > 20 is a 400 naming it)."""

from __future__ import annotations

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
                                            (False, 3, "top_logprobs"), ("yes", None, "logprobs")])  # 0 without logprobs is fine
def test_bad_chat_logprobs(lp, top, param):
    with pytest.raises(APIError) as e:
        chat_top_n(lp, top)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_good_values():
    assert chat_top_n(None, None) is None and chat_top_n(True, None) == 0 and chat_top_n(True, 20) == 20
    assert completion_top_n(None) is None and completion_top_n(0) == 0 and completion_top_n(5) == 5
    for bad in (6, -1, True, "2"):
        with pytest.raises(APIError) as e:
            completion_top_n(bad)
        assert e.value.param == "logprobs"
