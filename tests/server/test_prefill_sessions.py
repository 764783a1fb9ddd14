"""POST /v1/prefill end to end over HTTP on a tiny model whose tokenizer merges (a trained byte-level BPE with
ChatML markup), so chunk boundaries inside words, multi-byte characters and template markup really re-tokenize:
the greedy answer after progressive prefill equals the answer to the same prompt sent at once; bad input is an
OpenAI-shaped 4xx; session metrics show in /metrics and return to zero after the TTL (an injected clock)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.runtime.fakes import FakeClock
from tests.server.conftest import make_engine, metric, running_server

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAIN = ("the prefill session keeps the history while the technician talks; hello world, the line stops at "
         "station 12. Température élevée près du four. 温度过高，请检查。 the the the prefill prefill hello ") * 20


@pytest.fixture(scope="module")
def merging_bundle(tiny_dense, tmp_path_factory):
    """The tiny Llama with a 300-token BPE trained on shop-floor text (39 merges) and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lineside.build.pipeline import BuildOptions, build_bundle

    ckpt = tmp_path_factory.mktemp("merging") / "ckpt"
    shutil.copytree(tiny_dense("llama-gqa"), ckpt)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([TRAIN], trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == 300
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}))
    out = tmp_path_factory.mktemp("merging-bundle") / "tiny-merging"
    return build_bundle(ckpt, out, BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=256))


@pytest.fixture(scope="module")
def srv(merging_bundle):
    with running_server(merging_bundle, num_slots=3, threads=1, max_sessions=2) as s:
        yield s


def settle(client: httpx.Client, sid: str) -> dict:
    """Until the session has nothing pending (bounded: the tiny model computes a chunk in milliseconds)."""
    for _ in range(2000):
        r = client.get(f"/v1/prefill/{sid}")
        assert r.status_code == 200, r.text
        if r.json()["pending_tokens"] == 0:
            return r.json()
    raise AssertionError("session never settled")


GREEDY = {"max_tokens": 12, "temperature": 0}


def test_progressive_completion_equals_prompt_at_once(srv):
    # chunks split words ("tech|nician"), a multi-byte character ("é" and "温度" across chunks), digits
    chunks = ["the prefill ses", "sion keeps the hist", "ory while the tech", "nician talks: Températ", "ure élev",
              "ée, 温", "度过高 at station 1", "2"]
    text = "".join(chunks)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        cold = c.post("/v1/completions", json={"prompt": text, **GREEDY}).json()
        fed = ""
        for chunk in chunks:
            fed += chunk
            r = c.post("/v1/prefill", json={"prompt": fed, "session_id": "ocr-1"})
            assert r.status_code == 202, r.text
            body = r.json()
            assert body["object"] == "prefill.session" and body["cached_tokens"] + body["pending_tokens"] <= \
                body["prompt_tokens"]
            settle(c, "ocr-1")
        before = c.get("/metrics").text
        warm = c.post("/v1/completions", json={"prompt": text, **GREEDY}, headers={"X-Session-Id": "ocr-1"}).json()
        after = c.get("/metrics").text
        assert c.get("/v1/prefill/ocr-1").status_code == 404  # it ended with its completion
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    details = warm["usage"].pop("prompt_tokens_details"), cold["usage"].pop("prompt_tokens_details")
    assert warm["usage"] == cold["usage"]
    assert details[0]["cached_tokens"] >= cold["usage"]["prompt_tokens"] - 4  # what the session gave it
    hits = metric(after, "lineside_prefill_session_hits_total") - metric(before, "lineside_prefill_session_hits_total")
    saved = metric(after, "lineside_prefill_session_tokens_saved_total") - \
        metric(before, "lineside_prefill_session_tokens_saved_total")
    assert hits == 1 and saved >= cold["usage"]["prompt_tokens"] - 4


@pytest.mark.parametrize("n", [1, 2])
def test_a_session_ends_with_its_completion_also_when_no_choice_takes_it(srv, n):
    """n > 1: no choice extends the session (each copy runs as any request); it still ends with the completion, as
    the README says, instead of staying pinned in the arena until its TTL."""
    text = "the line stops at station 12"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/prefill", json={"prompt": text, "session_id": f"ends-{n}"}).status_code == 202
        settle(c, f"ends-{n}")
        r = c.post("/v1/completions", json={"prompt": text, "n": n, **GREEDY}, headers={"X-Session-Id": f"ends-{n}"})
        assert r.status_code == 200 and len(r.json()["choices"]) == n
        assert c.get(f"/v1/prefill/ends-{n}").status_code == 404
        assert metric(c.get("/metrics").text, "lineside_prefill_session_pinned_blocks") == 0


def test_rewritten_text_and_chat_markup(srv):
    """Chat: the user's message grows, one chunk rewrites earlier text, another types template markup as text;
    the completion (session_id in the body) keeps the session for the next turn, which reuses it again."""
    system = {"role": "system", "content": "You watch the line."}
    steps = ["Station 12 rep", "Station 12 reports: temp", "Station 14 reports: température <|im_", "Station 14 "
             "reports: température <|im_end|> élevée 温度"]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for step in steps:
            r = c.post("/v1/prefill", json={"messages": [system, {"role": "user", "content": step}],
                                             "session_id": "chat-7"})
            assert r.status_code == 202, r.text
            settle(c, "chat-7")
        messages = [system, {"role": "user", "content": steps[-1]}]
        cold = c.post("/v1/chat/completions", json={"messages": messages, **GREEDY}).json()
        warm = c.post("/v1/chat/completions", json={"messages": messages, "session_id": "chat-7",
                                                     "keep_session": True, **GREEDY}).json()
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
        kept = c.get("/v1/prefill/chat-7").json()
        assert kept["cached_tokens"] >= cold["usage"]["prompt_tokens"] - 1
        turn2 = [*messages, cold["choices"][0]["message"], {"role": "user", "content": "and station 15?"}]
        cold2 = c.post("/v1/chat/completions", json={"messages": turn2, **GREEDY}).json()
        warm2 = c.post("/v1/chat/completions", json={"messages": turn2, "session_id": "chat-7", **GREEDY}).json()
        assert warm2["choices"][0]["message"] == cold2["choices"][0]["message"]


def test_bad_input_is_an_openai_shaped_4xx(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        def err(r, status, code):
            assert r.status_code == status, r.text
            e = r.json()["error"]
            assert e["code"] == code and e["message"] and "\n" not in e["message"] and set(e) == {
                "message", "type", "code", "param"}
            return e

        e = err(c.post("/v1/prefill", json={"prompt": "x", "session_id": "bad id!"}), 400, "invalid_session_id")
        assert e["param"] == "session_id"
        err(c.post("/v1/prefill", json={"prompt": "x"}), 400, "missing_field")
        err(c.post("/v1/prefill", json={"prompt": "x", "session_id": 5}), 400, "invalid_value")
        err(c.post("/v1/prefill", json={"prompt": ["a", "b"], "session_id": "s"}), 400, "invalid_value")
        err(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Session-Id": "a b"}),
            400, "invalid_session_id")
        # keep_session that cannot be honoured is refused, not dropped: no session named, or several choices
        e = err(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "keep_session": True}), 400,
                "invalid_value")
        assert e["param"] == "keep_session"
        for extra in ({"n": 2}, {"prompt": ["x", "y"]}):
            e = err(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "keep_session": True,
                                                     "session_id": "one", **extra}), 400, "invalid_value")
            assert e["param"] == "keep_session"
        err(c.get("/v1/prefill/never-made"), 404, "session_not_found")
        err(c.delete("/v1/prefill/never-made"), 404, "session_not_found")
        err(c.post("/v1/prefill", json={"prompt": "the " * 300, "session_id": "long"}), 400,
            "context_length_exceeded")
        for i in range(2):  # the server's cap is 2 (below its 3 slots: none is released for room)
            assert c.post("/v1/prefill", json={"prompt": f"line {i}", "session_id": f"cap-{i}"}).status_code == 202
        r = c.post("/v1/prefill", json={"prompt": "one more", "session_id": "cap-9"})
        err(r, 429, "too_many_sessions")
        assert int(r.headers["retry-after"]) >= 1
        for i in range(2):
            assert c.delete(f"/v1/prefill/cap-{i}").json()["deleted"] is True
        srv.state.draining = True
        try:
            err(c.post("/v1/prefill", json={"prompt": "late", "session_id": "late"}), 409, "draining")
        finally:
            srv.state.draining = False


def test_api_key_and_metrics_return_to_zero_after_ttl(tiny_bundle):
    clock = FakeClock()
    engine = make_engine(tiny_bundle, num_slots=2, clock=clock, session_ttl=30.0)
    with running_server(engine, api_key="k3y") as s, httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/v1/prefill", json={"prompt": "abc", "session_id": "a"}).status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        for sid in ("a", "b"):
            r = c.post("/v1/prefill", json={"prompt": "the line stopped at station " + sid * 40, "session_id": sid},
                       headers=auth)
            assert r.status_code == 202 and r.json()["expires_in"] == pytest.approx(30, abs=1)
        for sid in ("a", "b"):
            for _ in range(2000):
                if c.get(f"/v1/prefill/{sid}", headers=auth).json()["pending_tokens"] == 0:
                    break
        m = c.get("/metrics", headers=auth).text
        assert metric(m, "lineside_prefill_sessions") == 2 and metric(m, "lineside_prefill_session_pinned_blocks") > 0
        clock.advance(31)
        m = c.get("/metrics", headers=auth).text
        assert metric(m, "lineside_prefill_sessions") == 0 and metric(m, "lineside_prefill_session_pinned_blocks") == 0
        assert metric(m, "lineside_prefill_sessions_expired_total") == 2
        assert metric(m, "lineside_kv_cache_usage_ratio") == 0


def test_prompt_stream_client(srv):
    """The package's client: feed chunks (bytes split inside a UTF-8 character too), then complete, streamed."""
    from lineside.client import PromptStream

    text = "Température élevée près du four, station 12"
    raw = text.encode()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        cold = c.post("/v1/completions", json={"prompt": text, **GREEDY}).json()["choices"][0]["text"]
    with PromptStream(srv.url, None, "client-1") as s:
        for i in range(0, len(raw), 7):  # 7-byte pieces cut "é" in half
            s.feed(raw[i:i + 7])
        assert s.text == text
        streamed = "".join(s.complete(stream=True, **GREEDY))
    assert streamed == cold
    with PromptStream(srv.url, None, "client-2") as s:
        s.feed("abandoned prompt")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/v1/prefill/client-2").status_code == 404  # leaving without complete() deletes it


def test_prompt_stream_client_openai_base_url_and_bad_bytes(srv):
    """The client takes the URL an OpenAI client is given (".../v1/"), as `lineside bench --url` does; bytes that
    are not UTF-8, or that end inside a character when the answer is asked for, are one clear ValueError (not a
    codec's traceback, nor a prompt cut silently)."""
    from lineside.client import PromptStream

    text = "hello world, the line stops"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        cold = c.post("/v1/completions", json={"prompt": text, **GREEDY}).json()["choices"][0]["text"]
    with PromptStream(srv.url + "/v1/", None, "client-v1") as s:
        assert s.feed(text)["session_id"] == "client-v1"
        assert s.complete(**GREEDY)["choices"][0]["text"] == cold
    with PromptStream(srv.url, None, "client-bad") as s:
        with pytest.raises(ValueError, match="not UTF-8"):
            s.feed(b"caf\xff")
        s.feed("Temp")
        s.feed("érature".encode()[:1])  # the first byte of "é" alone
        with pytest.raises(ValueError, match="end inside a UTF-8 character"):
            s.complete(**GREEDY)
        s.feed("érature".encode()[1:])  # the rest: now it completes
        assert s.text == "Température"
        assert s.complete(**GREEDY)["choices"][0]["text"]


def test_prompt_stream_update_drops_the_bytes_of_a_character_it_replaced(srv):
    """update() rewrites the whole prompt: the first bytes of a character fed before it belonged to the old text, so
    they neither block complete() nor get glued to the next piece fed."""
    from lineside.client import PromptStream

    text = "Température élevée"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        cold = c.post("/v1/completions", json={"prompt": text, **GREEDY}).json()["choices"][0]["text"]
    with PromptStream(srv.url, None, "client-upd") as s:
        s.feed(b"caf\xc3")  # "café" cut inside its "é"
        s.update("Température")
        s.feed(" élevée".encode())
        assert s.text == text
        assert s.complete(**GREEDY)["choices"][0]["text"] == cold


def test_bench_chunked_pattern_feeds_then_completes(srv):
    """`lineside bench --pattern chunked`'s client: each prompt goes through /v1/prefill in pieces, then its
    streamed completion names the session (one hit per request)."""
    from lineside.bench.client import ClientConfig
    from lineside.bench.load import make_schedule
    from lineside.bench.prompts import Prompt, PromptPool
    from lineside.bench.runner import run

    schedule = make_schedule("chunked", rate=50.0, duration=0.0, seed=1, max_requests=2)  # the server's cap is 2
    assert schedule.pattern == "chunked" and len(schedule.arrivals) == 2
    prompts = [Prompt("the technician reports station 12 is hot, " * 3 + str(i)) for i in range(3)]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        before = metric(c.get("/metrics").text, "lineside_prefill_session_hits_total")
        for endpoint in ("completions", "chat"):
            cfg = ClientConfig(base_url="", endpoint=endpoint, max_tokens=4, chunks=3, chunk_interval=0.0)
            res = run(srv.url, schedule, PromptPool(prompts), cfg, deadline=60)
            assert [r.error for r in res.records] == [None] * 2 and all(r.output_tokens for r in res.records)
        after = metric(c.get("/metrics").text, "lineside_prefill_session_hits_total")
    assert after - before >= 3  # (nearly) every completion started from its session


def test_bench_cli_chunked(srv, tmp_path):
    from typer.testing import CliRunner

    from tests.bench.test_bench_end_to_end import cli_app

    out = tmp_path / "report"
    r = CliRunner().invoke(cli_app(), ["bench", "--url", srv.url, "--pattern", "chunked", "--chunks", "3",
                                     "--chunk-interval", "0", "--rate", "20", "--num-requests", "2", "--duration",
                                     "0", "--max-tokens", "3", "--prompt-len", "12:24", "--warmup", "0",
                                     "--no-plots", "--out", str(out)])
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["pattern"] == "chunked" and meta["chunks"] == 3 and meta["chunk_interval"] == 0


def test_x_session_id_header_alone_names_the_prefill_session(srv):
    """The README's headers (X-Session-Id among them) apply to /v1/prefill too: a body without session_id takes the
    header's, as the completion routes do, instead of a 400 saying the field is missing."""
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/prefill", json={"prompt": "the line stops at station 12"}, headers={"X-Session-Id": "hdr-1"})
        assert r.status_code == 202, r.text
        assert r.json()["session_id"] == "hdr-1"
        assert c.delete("/v1/prefill/hdr-1").json()["deleted"] is True
        r = c.post("/v1/prefill", json={"prompt": "x"}, headers={"X-Session-Id": "bad id!"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id", r.text


def test_a_kept_session_counts_the_prompt_it_kept(srv):
    """keep_session: the session now caches the completion's prompt, so GET shows that prompt's length as
    prompt_tokens (never fewer tokens than it caches), also for a session the completion made."""
    text = "the prefill session keeps the history"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/prefill", json={"prompt": text, "session_id": "kept-1"}).status_code == 202
        settle(c, "kept-1")
        for sid in ("kept-1", "kept-new"):
            r = c.post("/v1/completions", json={"prompt": text + " while the technician talks", "keep_session": True,
                                                 "session_id": sid, **GREEDY})
            assert r.status_code == 200, r.text
            info = c.get(f"/v1/prefill/{sid}").json()
            assert info["prompt_tokens"] == r.json()["usage"]["prompt_tokens"], info
            assert info["cached_tokens"] + info["pending_tokens"] <= info["prompt_tokens"]
            assert c.delete(f"/v1/prefill/{sid}").status_code == 200


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream"),
    ({"n": 2}, "n"),
    ({"keep_session": True}, "keep_session"),
])
@pytest.mark.parametrize("chat", [False, True])
def test_a_prefill_refuses_what_only_a_completion_does(srv, extra, param, chat):
    """``stream: true``, ``n`` > 1 and ``keep_session: true`` ask for what only the completion does (a stream, several
    choices, keeping its KV); a prefill answers 202 JSON at once and made no stream, no choice and no promise, which
    the client only learnt later, if ever. Now a 400 naming the field and where to send it, and no session made."""
    prompt = {"messages": [{"role": "user", "content": "hello world"}]} if chat else {"prompt": "hello world"}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/prefill", json={**prompt, "session_id": "misled", **extra})
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["param"] == param and "completion" in e["message"] and "\n" not in e["message"]
        assert c.get("/v1/prefill/misled").status_code == 404


def test_a_prefill_accepts_the_completions_other_fields(srv):
    """A prefill body may be the completion's own (README): what only shapes the answer (max_tokens, sampling, stop,
    logprobs, a format) is accepted and left for the completion, as are stream false, n 1 and keep_session false."""
    extra = {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["x"], "logprobs": True,
             "top_logprobs": 2, "response_format": {"type": "json_object"}, "stream": False, "n": 1,
             "keep_session": False, "presence_penalty": 0.5}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/prefill", json={"messages": [{"role": "user", "content": "hello"}], "session_id": "kind",
                                        **extra})
        assert r.status_code == 202, r.text
        assert c.delete("/v1/prefill/kind").status_code == 200


def test_past_the_slots_a_new_session_ends_the_least_recently_used(merging_bundle):
    """--max-sessions above --num-slots (README): each session with KV holds a slot; a new one with work to do takes
    the slot of the least recently used idle session, which ends at once as if expired — GET and DELETE 404
    session_not_found, a completion naming it runs as any request (the same answer, no error), a prefill naming it
    again starts it anew — and /metrics counts it evicted."""
    texts = {sid: f"the line stopped at station {i} while the technician talks" for i, sid in enumerate("abc")}
    with running_server(merging_bundle, num_slots=2, threads=1, max_sessions=4) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        cold = c.post("/v1/completions", json={"prompt": texts["a"] + " hello", **GREEDY}).json()
        for sid in ("a", "b"):
            assert c.post("/v1/prefill", json={"prompt": texts[sid], "session_id": sid}).status_code == 202
            settle(c, sid)
        settle(c, "b")  # b used last: a is the least recently used
        assert c.post("/v1/prefill", json={"prompt": texts["c"], "session_id": "c"}).status_code == 202
        settle(c, "c")
        assert c.get("/v1/prefill/a").json()["error"]["code"] == "session_not_found"
        assert c.delete("/v1/prefill/a").status_code == 404
        assert c.get("/v1/prefill/b").status_code == 200
        assert metric(c.get("/metrics").text, "lineside_prefill_sessions_evicted_total") == 1
        r = c.post("/v1/completions", json={"prompt": texts["a"] + " hello", **GREEDY}, headers={"X-Session-Id": "a"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == cold["choices"][0]["text"]
        r = c.post("/v1/prefill", json={"prompt": texts["a"], "session_id": "a"})
        assert r.status_code == 202 and r.json()["session_id"] == "a"
        assert settle(c, "a")["cached_tokens"] > 0


@pytest.mark.parametrize("scoring", [{"prompt_logprobs": 2}, {"echo": True, "logprobs": 2}])
def test_a_scoring_completion_keeps_its_session_and_scores_as_without_one(srv, scoring):
    """Scoring needs every prompt position computed, so a completion with prompt_logprobs (or echo + logprobs) takes
    nothing from its session's KV and runs as any request: its scores and answer are those without a session. With
    keep_session the session then keeps that prompt's KV, and the next turn takes it (usage's cached_tokens)."""
    text = "the prefill session keeps the history while the technician talks"
    sid = "score-" + "-".join(scoring)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        alone = c.post("/v1/completions", json={"prompt": text, **scoring, **GREEDY}).json()
        assert c.post("/v1/prefill", json={"prompt": text[:30], "session_id": sid}).status_code == 202
        settle(c, sid)
        r = c.post("/v1/completions", json={"prompt": text, "session_id": sid, "keep_session": True, **scoring,
                                             **GREEDY})
        assert r.status_code == 200, r.text
        kept = r.json()
        for key in ("text", "logprobs", "prompt_logprobs"):
            assert kept["choices"][0].get(key) == alone["choices"][0].get(key), key
        info = settle(c, sid)
        assert info["prompt_tokens"] == kept["usage"]["prompt_tokens"] and info["cached_tokens"] > 0, info
        turn = c.post("/v1/completions", json={"prompt": text + " about station 12", "session_id": sid, **GREEDY})
        assert turn.status_code == 200, turn.text
        assert turn.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= info["cached_tokens"] - 4
        assert c.get(f"/v1/prefill/{sid}").status_code == 404  # it ended with that turn


@pytest.mark.parametrize("chat", [False, True])
def test_a_session_named_on_a_server_without_sessions_runs_as_usual_with_n(merging_bundle, chat):
    """--max-sessions 0 (as a DeepSeek-V4 bundle, which keeps none): a completion naming a session runs as any request
    (README), also with n > 1 — where the route ends the session no choice can take, and there is none to end:
    the same choices as without the name, not a 400 telling the client to send it to the completion endpoint."""
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "station 12 reports"}]})
                  if chat else ("/v1/completions", {"prompt": "station 12 reports"}))
    with running_server(merging_bundle, num_slots=2, threads=1, max_sessions=0) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        plain = c.post(path, json={**body, "n": 2, **GREEDY})
        named = c.post(path, json={**body, "n": 2, "session_id": "none-here", **GREEDY})
        assert c.post("/v1/prefill", json={**body, "session_id": "x"}).json()["error"]["code"] == \
            "sessions_unsupported"
    assert plain.status_code == 200 and named.status_code == 200, named.text
    assert [ch.get("text", ch.get("message")) for ch in named.json()["choices"]] == \
        [ch.get("text", ch.get("message")) for ch in plain.json()["choices"]]


@pytest.mark.parametrize("chat", [False, True])
def test_keep_session_on_a_server_without_sessions_is_a_400_not_dropped(merging_bundle, chat):
    """--max-sessions 0: keep_session asks for what the server cannot do; it was silently dropped (the next turn then
    recomputed the whole prompt unawares). A 400 naming keep_session, counted invalid; naming a session alone still
    runs (above)."""
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "station 12 reports"}]})
                  if chat else ("/v1/completions", {"prompt": "station 12 reports"}))
    with running_server(merging_bundle, num_slots=2, threads=1, max_sessions=0) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post(path, json={**body, "session_id": "s1", "keep_session": True, **GREEDY})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "sessions_unsupported" and err["param"] == "keep_session"
        assert "\n" not in err["message"] and "leave keep_session out" in err["message"]
        assert metric(c.get("/metrics").text, "lineside_requests_total", 'outcome="invalid"') == 1


@pytest.mark.parametrize("wrap", [lambda text, ids: [text], lambda text, ids: [ids]])
def test_a_list_of_one_prompt_is_one_prompt(srv, wrap):
    """/v1/completions takes its prompt as a list of one (LangChain's OpenAI LLM always sends it so), and that one
    body goes to both calls (README): the prefill took only a bare string or ids and refused ``[text]`` as "a list
    of prompts". Now the one prompt is unwrapped, and the completion sending the same body takes its KV."""
    text = "the prefill session keeps the history while the technician talks"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        ids = c.post("/tokenize", json={"prompt": text}).json()["tokens"]
        body = {"prompt": wrap(text, ids), "session_id": "one-listed", **GREEDY}
        cold = c.post("/v1/completions", json={**body, "session_id": "none-such"}).json()
        r = c.post("/v1/prefill", json=body)
        assert r.status_code == 202, r.text
        assert r.json()["prompt_tokens"] == len(ids)
        settle(c, "one-listed")
        warm = c.post("/v1/completions", json=body).json()
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, warm["usage"]


@pytest.mark.parametrize("prompt, says", [
    ([], "empty"), ([[]], "empty"), (["a b", "c d"], "not a list of 2 prompts"), ([[5, 6], [7]], "not a list of 2 prompts"),
])
def test_a_prefill_of_no_prompt_or_several_says_which(srv, prompt, says):
    """An empty list is no prompt (was told it was "a list of prompts"); two prompts are refused as before."""
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/prefill", json={"prompt": prompt, "session_id": "which"})
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["param"] == "prompt" and says in e["message"] and "\n" not in e["message"], e
        assert c.get("/v1/prefill/which").status_code == 404
