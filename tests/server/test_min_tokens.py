"""vLLM's min_tokens through the server, on the tiny Llama whose greedy first answer token is made an EOS id (as
Llama 3 lists several in generation_config): without min_tokens both endpoints end at once; with it EOS is masked
(ignore_eos or not), in greedy, sampled, batched and speculative requests, until min_tokens tokens are out, and a
structured output that is complete still ends the answer (vLLM lets the grammar win)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from tests.conftest import TINY_BUNDLE
from tests.server.conftest import metric, running_server

# A repetitive prompt (ngram speculation proposes from it); the first of each list whose greedy first answer
# token is a byte of the tokenizer (the random model's 300 rows outnumber the tokenizer's 259 tokens) is used.
PROMPTS = ["the cat sat on the mat, the cat sat on the", "one two one two one two one", "abcabcabcabcab", "xyzxyzx"]
CHATS = ["hi", "hello", "hey there", "ok", "yes"]


@pytest.fixture(scope="module")
def eos_first(tiny_dense, tiny_bundle, tmp_path_factory):
    """(bundle, prompt, chat messages): the tiny bundle rebuilt with the greedy first answer token after the
    prompt and after the messages added to its EOS ids."""
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import compute_logits
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(tiny_bundle)
    tok, be = Tokenizer.from_bundle(b), OnnxRuntimeBackend(b, num_slots=1, threads=1)

    def first_text_token(candidates):
        for ids, given in candidates:
            k = int(compute_logits(be, ids)[-1].argmax())
            if 3 <= k < 259:
                return k, given
        raise AssertionError("no candidate's greedy first token is a byte token; add candidates")

    k1, prompt = first_text_token((tok.encode(p), p) for p in PROMPTS)
    k2, msgs = first_text_token((tok.encode_chat(m), m) for m in ([{"role": "user", "content": c}] for c in CHATS))
    firsts = {k1, k2}
    be.close()
    d = tmp_path_factory.mktemp("eos-first")
    ck = shutil.copytree(tiny_dense("llama-gqa"), d / "ck")
    eos = sorted({2, *firsts})
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((ck / name).read_text())
        (ck / name).write_text(json.dumps({**cfg, "eos_token_id": eos}))
    options = {k: v for k, v in TINY_BUNDLE.items() if k != "variant"}
    return build_bundle(ck, d / "tiny-llama", BuildOptions(**options)), prompt, msgs


@pytest.fixture(scope="module")
def srv(eos_first):
    bundle, prompt, msgs = eos_first
    with running_server(bundle, num_slots=4, threads=1) as s:
        s.prompt, s.msgs = prompt, msgs
        yield s


def ask(server, endpoint: str, **body) -> dict:
    """One answer, with its token strings (logprobs) so special tokens, whose text is empty, still count."""
    if endpoint == "chat":
        body = {"messages": server.msgs, "logprobs": True, **body}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": server.prompt, "logprobs": 0, **body}
        path = "/v1/completions"
    r = httpx.post(server.url + path, json={"max_tokens": 8, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(answer: dict, i: int = 0) -> list[str]:
    lp = answer["choices"][i]["logprobs"]
    return [t["token"] for t in lp["content"]] if "content" in lp else lp["tokens"]


def text(answer: dict, i: int = 0) -> str:
    c = answer["choices"][i]
    return c["message"]["content"] if "message" in c else c["text"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_answer_whose_greedy_first_token_is_eos_goes_on_to_min_tokens(srv, endpoint):
    cut = ask(srv, endpoint)
    assert (cut["choices"][0]["finish_reason"], text(cut), cut["usage"]["completion_tokens"]) == ("stop", "", 1)
    for m in (1, 4, 8):
        out = ask(srv, endpoint, min_tokens=m)
        assert len(tokens(out)) >= m, out
        if out["choices"][0]["finish_reason"] == "stop":  # an EOS came only after min_tokens tokens
            assert out["usage"]["completion_tokens"] > m
    full = ask(srv, endpoint, min_tokens=8)
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 8
    assert tokens(ask(srv, endpoint, min_tokens=4)) == tokens(full)[:len(tokens(ask(srv, endpoint, min_tokens=4)))]


def test_streamed_chat_goes_on_to_min_tokens(srv):
    body = {"messages": srv.msgs, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "min_tokens": 6}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] >= 6


def test_sampled_and_batched_choices_each_reach_min_tokens(srv):
    """n=4 seeded samples in one batch, beside greedy requests with and without min_tokens: each obeys its own."""
    def sampled():
        return ask(srv, "completions", temperature=1.0, seed=11, n=4, min_tokens=5, max_tokens=6)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(sampled), pool.submit(ask, srv, "completions"),
                   pool.submit(ask, srv, "chat", min_tokens=3), pool.submit(ask, srv, "completions", min_tokens=8)]
        many, plain, chat, eight = (f.result() for f in futures)
    assert all(len(tokens(many, i)) >= 5 for i in range(4))
    assert plain["usage"]["completion_tokens"] == 1 and text(plain) == ""
    assert len(tokens(chat)) >= 3
    assert tokens(eight) == tokens(ask(srv, "completions", min_tokens=8))  # batched = alone


def test_benchmark_harness_min_tokens_with_ignore_eos(srv):
    """min_tokens = max_tokens with ignore_eos (what benchmark clients send to fix the length): max_tokens tokens,
    EOS never among them; vLLM masks EOS under min_tokens even with ignore_eos (its all_stop_token_ids)."""
    ignored = ask(srv, "completions", ignore_eos=True)
    fixed = ask(srv, "completions", ignore_eos=True, min_tokens=8)
    assert ignored["usage"]["completion_tokens"] == fixed["usage"]["completion_tokens"] == 8
    assert fixed["choices"][0]["finish_reason"] == "length"
    assert tokens(fixed)[0] != tokens(ignored)[0]  # the first greedy token is an EOS id: held back


def test_a_stop_string_in_the_first_min_tokens_does_not_end_the_answer(srv):
    full = ask(srv, "completions", min_tokens=8)
    first = text(full)[:1]
    assert first
    held = ask(srv, "completions", min_tokens=8, stop=[first])
    assert (text(held), held["choices"][0]["finish_reason"]) == (text(full), "length")


def test_structured_output_that_is_complete_ends_before_min_tokens(srv):
    """vLLM lets the grammar win: a choice or a boolean is complete after a few tokens and ends the answer there
    (rather than sample outside the grammar); a grammar that may go on loses only EOS to min_tokens."""
    choice = ask(srv, "completions", min_tokens=8, max_tokens=12, guided_choice=["yes", "no"])
    assert (text(choice), choice["choices"][0]["finish_reason"]) in {("yes", "stop"), ("no", "stop")}
    boolean = ask(srv, "chat", min_tokens=10, max_tokens=16, response_format={
        "type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}})
    assert json.loads(text(boolean)) in (True, False) and boolean["choices"][0]["finish_reason"] == "stop"
    free = ask(srv, "completions", min_tokens=6, max_tokens=12, guided_regex="[ab]{1,10}")
    assert 6 <= len(text(free)) <= 10 and set(text(free)) <= {"a", "b"}


def test_speculative_decoding_gives_the_same_tokens(eos_first, srv):
    """ngram proposals on a repetitive prompt: verification masks EOS as plain decoding does."""
    spec = SpeculativeConfig(SpecMethod.NGRAM, 4)
    with running_server(eos_first[0], num_slots=2, threads=1, speculative=spec) as fast:
        fast.prompt, fast.msgs = srv.prompt, srv.msgs
        got = [ask(fast, e, min_tokens=m, max_tokens=12) for e in ("completions", "chat") for m in (4, 12)]
        drafted = metric(httpx.get(fast.url + "/metrics").text, "lineside_spec_decode_num_draft_tokens_total")
    want = [ask(srv, e, min_tokens=m, max_tokens=12) for e in ("completions", "chat") for m in (4, 12)]
    assert [tokens(a) for a in got] == [tokens(a) for a in want]
    assert drafted > 0


@pytest.mark.parametrize("endpoint,extra,param", [
    ("completions", {"min_tokens": -1}, "min_tokens"),
    ("completions", {"min_tokens": "many"}, "min_tokens"),
    ("completions", {"min_tokens": 9}, "min_tokens"),  # > max_tokens 8
    ("chat", {"min_tokens": 4, "max_completion_tokens": 3}, "min_tokens"),
    ("completions", {"min_tokens": 17, "max_tokens": None}, "min_tokens"),  # > the default max_tokens, 16
    ("chat", {"min_tokens": 300, "max_tokens": None}, "min_tokens"),  # > what the context (256) leaves
])
def test_min_tokens_out_of_range_is_a_400_naming_it(srv, endpoint, extra, param):
    base = {"messages": srv.msgs} if endpoint == "chat" else {"prompt": srv.prompt}
    r = httpx.post(srv.url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions"),
                   json={**base, "max_tokens": 8, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"] and "min_tokens" in err["message"]
