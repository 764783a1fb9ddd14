"""Prompt sources: seeded synthetic lengths (exact with a tokenizer), JSONL parsing and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from lineside.bench import prompts as P
from lineside.errors import LinesideError


@pytest.fixture(scope="module")
def word_tokenizer():
    """A tiny word-level tokenizer: one token per known word, punctuation split off."""
    vocab = {w: i for i, w in enumerate(sorted(set(P._WORDS)) + ["[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_synthetic_lengths_seeded_and_in_range():
    a = P.synthetic(200, (16, 64), seed=5)
    assert a == P.synthetic(200, (16, 64), seed=5)
    assert a != P.synthetic(200, (16, 64), seed=6)
    lens = np.array([p.tokens for p in a])
    assert lens.min() >= 16 and lens.max() <= 64
    assert abs(lens.mean() - 40) < 4  # uniform on [16, 64]: mean 40, sd of the mean ~1
    assert all(len(p.text.split()) == p.tokens for p in a)  # no tokenizer: one word per token


def test_synthetic_exact_token_count_with_tokenizer(word_tokenizer):
    for p in P.synthetic(30, (5, 40), seed=1, tokenizer=word_tokenizer):
        assert len(word_tokenizer.encode(p.text, add_special_tokens=False).ids) == p.tokens


def test_parse_range():
    assert P.parse_range("128:512", "x", 512) == (128, 512)
    assert P.parse_range("64", "x", 512) == (64, 64)
    for bad in ("0:4", "9:3", "a:b", "1:2:3", "", "1:513", "513"):
        with pytest.raises(LinesideError):
            P.parse_range(bad, "--prompt-len", 512)


def test_jsonl_forms(tmp_path, word_tokenizer):
    f = tmp_path / "p.jsonl"
    lines = [{"prompt": "the city of light"}, {"text": "water power", "max_tokens": 7},
             {"messages": [{"role": "user", "content": "hello robot"}]}, "plain string line"]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ps = P.from_jsonl(f, word_tokenizer)
    assert [p.text for p in ps] == ["the city of light", "water power", "hello robot", "plain string line"]
    assert ps[0].tokens == 4 and ps[1].max_tokens == 7
    assert ps[2].messages == ({"role": "user", "content": "hello robot"},)


@pytest.mark.parametrize("content, msg", [
    ("{not json}\n", ":1: not valid JSON"),
    ('{"prompt": "a"}\n[1, 2]\n', ":2: expected an object"),
    ('{"other": 1}\n', "no \"prompt\""),
    ("\n\n", "holds no prompts"),
    ('{"prompt": ["a", "b"]}\n', ':1: "prompt" must be a string, got list'),
    ('{"text": 3}\n', ':1: "text" must be a string, got int'),
    ('{"messages": "hello"}\n', ':1: "messages" must be a list'),
    ('{"messages": ["hello"]}\n', ':1: "messages" must be a list'),
    ('{"prompt": "a"}\n{"prompt": "b", "max_tokens": "x"}\n', ':2: "max_tokens" must be an integer'),
    ('{"prompt": "a", "max_tokens": -3}\n', ':1: "max_tokens" must be an integer'),
    (b"\xff\xfe{}\n", "not UTF-8"),  # a UTF-16 editor's save
])
def test_jsonl_errors_name_the_line(tmp_path, content, msg):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
    with pytest.raises(LinesideError, match=msg.replace("[", r"\[")):
        P.from_jsonl(f)


def test_jsonl_bom_and_content_parts(tmp_path):
    """A Windows editor's UTF-8 BOM is not part of the first line; a message's list-of-parts content is its text."""
    f = tmp_path / "p.jsonl"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                       {"type": "image_url", "image_url": {"url": "x"}},
                                                       {"type": "text", "text": "robot"}]}]}
    f.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"prompt": "first"}) + "\n" + json.dumps(parts) + "\n").encode())
    ps = P.from_jsonl(f)
    assert [p.text for p in ps] == ["first", "hello robot"]


def test_missing_files_are_user_errors(tmp_path):
    with pytest.raises(LinesideError, match="does not exist"):
        P.from_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(LinesideError, match="no tokenizer.json"):
        P.load_tokenizer(tmp_path)


def test_a_pipe_is_a_prompts_file_and_an_empty_one_says_what_to_write(tmp_path):
    """`--prompts-file <(jq ...)` reads a FIFO; /dev/null (exists, not a regular file) is empty, not missing."""
    import os
    import threading

    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"prompt": "from a pipe"}\n'))
    writer.start()
    assert [p.text for p in P.from_jsonl(fifo)] == ["from a pipe"]
    writer.join()
    with pytest.raises(LinesideError, match=r"holds no prompts; write one JSON object per line, \{\"prompt\""):
        P.from_jsonl(os.devnull)
    with pytest.raises(LinesideError, match="is a directory"):
        P.from_jsonl(tmp_path)


def test_pool_wraps_around():
    pool = P.PromptPool([P.Prompt("a"), P.Prompt("b"), P.Prompt("c")])
    assert [p.text for p in pool.take(2)] == ["a", "b"]
    assert [p.text for p in pool.take(3)] == ["c", "a", "b"]


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def test_jsonl_lines_carry_chat_tools(tmp_path):
    """An agent's requests carry tools: a line's "tools" and "tool_choice" go with its prompt (they were dropped)."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "find it"}], "tools": [TOOL],
                             "tool_choice": "required"}) + "\n" + json.dumps({"prompt": "plain"}) + "\n")
    a, b = P.from_jsonl(f)
    assert a.tools == (TOOL,) and a.tool_choice == "required" and a.text == "find it"
    assert b.tools == () and b.tool_choice is None


@pytest.mark.parametrize("extra,msg", [
    ({"tools": {"name": "lookup"}}, '"tools" must be a list of'),
    ({"tools": [{"type": "function"}]}, '"tools" must be a list of'),
    ({"tools": [TOOL], "tool_choice": "always"}, '"tool_choice" must be "none", "auto", "required"'),
    ({"tool_choice": "required"}, '"tool_choice" .required. needs "tools" on the same line'),
])
def test_jsonl_tool_errors_name_the_line(tmp_path, extra, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", **extra}) + "\n")
    with pytest.raises(LinesideError, match=":2: " + msg.replace("(", r"\(")):
        P.from_jsonl(f)


@pytest.mark.parametrize("data", [b"garbage\n", b"\xff\xfe not UTF-8", b'{"version": "1.0"}'])
def test_a_file_that_is_no_tokenizer_is_one_line(tmp_path, data):
    """`--tokenizer config.json` (the wrong file of a checkpoint) or a broken download: the tokenizers library's
    bare Exception ("expected value at line 1 column 1") was a traceback; one line naming the file instead."""
    path = tmp_path / "tokenizer.json"
    path.write_bytes(data)
    with pytest.raises(LinesideError) as e:
        P.load_tokenizer(path)
    msg = str(e.value)
    assert str(path) in msg and "not a tokenizer" in msg and "\n" not in msg, msg
