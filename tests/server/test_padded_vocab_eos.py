"""A bundle whose EOS id lies among the model's padding rows (past the tokenizer's tokens, inside the embedding's:
Qwen2's vocabulary is 151936 rows for 151665 tokens), as the tiny Llama rebuilt with eos_token_id 276 (its
tokenizer has 259 tokens, its embedding 300 rows): structured outputs and logprobs answer 200 with valid output;
llguidance refused the EOS id and every such request was a 500."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.conftest import TINY_BUNDLE
from tests.server.conftest import running_server

PAD_EOS = 276


@pytest.fixture(scope="module")
def srv(tiny_dense, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle

    d = tmp_path_factory.mktemp("pad-eos")
    ck = shutil.copytree(tiny_dense("llama-gqa"), d / "ck")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((ck / name).read_text())
        (ck / name).write_text(json.dumps({**cfg, "eos_token_id": PAD_EOS}))
    options = {k: v for k, v in TINY_BUNDLE.items() if k != "variant"}
    bundle = build_bundle(ck, d / "tiny-llama", BuildOptions(**options))
    with running_server(bundle, num_slots=2, threads=1) as s:
        assert PAD_EOS in s.state.engine.eos_ids and s.state.engine.vocab_size == 300
        yield s


def post(srv, path: str, **body) -> dict:
    r = httpx.post(srv.url + path, json={"max_tokens": 24, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
          "required": ["ok", "n"]}


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_answers_valid_json(srv, temperature):
    out = post(srv, "/v1/chat/completions", messages=[{"role": "user", "content": "status?"}], max_tokens=40,
               temperature=temperature, seed=3, response_format={
                   "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    got = json.loads(out["choices"][0]["message"]["content"])
    assert set(got) == {"ok", "n"} and isinstance(got["ok"], bool) and got["n"] <= 9
    assert out["choices"][0]["finish_reason"] == "stop"


def test_guided_choice_and_regex_on_completions(srv):
    choice = post(srv, "/v1/completions", prompt="pick", guided_choice=["left", "right"])
    assert choice["choices"][0]["text"] in {"left", "right"}
    regex = post(srv, "/v1/completions", prompt="code", guided_regex="ST-[0-9]{2}")
    assert regex["choices"][0]["text"][:3] == "ST-" and len(regex["choices"][0]["text"]) == 5


def test_logprobs_on_both_endpoints(srv):
    """ignore_eos: the greedy answer's EOS ids (the padding 276 among them) are sampled on as tokens; padding ids,
    chosen or among the alternatives (random rows outnumber the tokens), have no bytes."""
    chat = post(srv, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                logprobs=True, top_logprobs=5, ignore_eos=True)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] == 6 and all(len(e["top_logprobs"]) == 5 for e in content)
    pads = [a for e in content for a in [e, *e["top_logprobs"]] if not a["bytes"]]
    assert pads and all(a["token"] == "" for a in pads)
    comp = post(srv, "/v1/completions", prompt="the cat", max_tokens=6, logprobs=3, ignore_eos=True)
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == comp["usage"]["completion_tokens"] == 6
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"])


def test_constrained_logprobs_list_no_padding_ids(srv):
    """Under a grammar the alternatives are allowed tokens: none is a padding id (no bytes) until the grammar is
    complete, where EOS ids (</s> and the padding 276) may follow."""
    out = post(srv, "/v1/chat/completions", messages=[{"role": "user", "content": "pick"}], max_tokens=12,
               logprobs=True, top_logprobs=20, guided_regex="[a-c]{4}")
    content = out["choices"][0]["logprobs"]["content"]
    assert out["choices"][0]["message"]["content"] in {a + b + c + d for a in "abc" for b in "abc" for c in "abc"
                                                       for d in "abc"}
    for e in content[:4]:
        alts = [a for a in e["top_logprobs"] if a["logprob"] > -1e30]
        assert alts and all(bytes(a["bytes"]).decode() in "abc" and a["bytes"] for a in alts), e
