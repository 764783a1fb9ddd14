"""LoRA adapters and speculative decoding together (each is tested alone elsewhere): a batch that mixes base-model
and adapter requests — greedy, seeded n > 1, logprobs, a regex, a json_schema streamed, a stop string — sent at
once to a server speculating with prompt lookup or with the layerskip draft (the base model's first layer, drafting
for adapter rows too) answers each exactly as a server without speculation answers it alone, and the adapter's
answers stay the adapter's (prefix reuse never crosses adapters). The adapter path itself is checked against peft
in tests/runtime/test_lora_engine.py; here the plain server is the reference."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from lineside.bundle import open_bundle
from lineside.runtime.adapters import serving_config
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from tests.server.conftest import running_server

SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["up", "down"]}},
          "required": ["a", "b"]}
SHARED = "The quick brown fox jumps over the lazy dog, again and again and again. "  # base and adapter, same prompt
SAMPLED = 3  # the seeded n=2 request
REQUESTS = [  # (path, body): temperature 0 unless the body samples with a seed
    ("/v1/completions", {"prompt": SHARED, "max_tokens": 16}),
    ("/v1/completions", {"model": "line-a", "prompt": SHARED, "max_tokens": 16}),
    ("/v1/completions", {"model": "line-a", "prompt": "zzzzzzzzzzzzzzzz", "max_tokens": 24, "logprobs": 2}),
    ("/v1/completions", {"model": "line-a", "prompt": SHARED, "max_tokens": 12, "n": 2, "seed": 5,
                         "temperature": 0.9}),
    ("/v1/completions", {"model": "line-a", "prompt": "zzzzzzzzzzzzzzzz", "max_tokens": 24, "guided_regex": "z{2,6}a"}),
    ("/v1/completions", {"prompt": "abcabcabcabcabcabc", "max_tokens": 20, "guided_regex": "(abc)+ [0-9]{2}"}),
    ("/v1/chat/completions", {"model": "line-a", "messages": [{"role": "user", "content": "json please"}],
                              "max_tokens": 40, "stream": True,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": SCHEMA}}}),
    ("/v1/completions", {"model": "line-a", "prompt": "abcabcabcabc", "max_tokens": 24, "stop": ["Azz"]}),
]


@pytest.fixture(scope="module")
def lora_draft_bundle(tiny_bundles, peft_adapter, tmp_path_factory):
    """The tiny Llama (accuracy level 0: verification is exact) with LoRA graphs, a 1-layer draft and "line-a"."""
    from lineside.build.lora_commands import add

    src = tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=128, accuracy_level=0,
                       max_lora_rank=8, draft_layers=(1,))
    dst = tmp_path_factory.mktemp("lora-spec") / "tiny-llama"
    shutil.copytree(src, dst)
    add(dst, peft_adapter("llama-gqa", "qv"), name="line-a")
    return dst


def _engine(bundle_dir, spec: SpeculativeConfig | None):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(bundle_dir)
    lora = serving_config(b, [], max_loras=2, max_rank=None)
    be = OnnxRuntimeBackend(b, num_slots=4, threads=1, lora=lora.slots)
    return LLMEngine(b, backend=be, num_slots=4, max_waiting=64, lora=lora, speculative=spec)


def _answer(url: str, path: str, body: dict) -> dict:
    """Per choice: text, finish_reason, stop_reason and logprob tokens (joined from the deltas when streamed)."""
    body = {"temperature": 0, **body}
    out: dict[int, list] = {}
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            text = c["text"] if "text" in c else c["message"]["content"]
            out[c["index"]] = [text, c["finish_reason"], c["stop_reason"], (c["logprobs"] or {}).get("tokens")]
        return out
    with httpx.stream("POST", url + path, json=body, timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                e = out.setdefault(c["index"], ["", None, None, None])
                e[0] += c["delta"].get("content") or ""
                e[1], e[2] = c["finish_reason"] or e[1], c.get("stop_reason") or e[2]
    return out


@pytest.fixture(scope="module")
def alone(lora_draft_bundle):
    """Each request's answer from a server without speculation, one request at a time."""
    with running_server(_engine(lora_draft_bundle, None)) as srv:
        return [_answer(srv.url, path, body) for path, body in REQUESTS]


@pytest.mark.parametrize("spec", [SpeculativeConfig(SpecMethod.NGRAM, 4),
                                  SpeculativeConfig(SpecMethod.LAYERSKIP, 4, max_rows=8, draft_layers=1,
                                                    draft_cost=0.0)], ids=["ngram", "layerskip"])
def test_a_mixed_adapter_batch_speculates_to_the_plain_answers(lora_draft_bundle, alone, spec):
    assert alone[0][0][0] != alone[1][0][0]  # the adapter changes the answer to the shared prompt
    assert json.loads(alone[6][0][0]).keys() == {"a", "b"} and alone[6][0][1] == "stop"
    assert alone[4][0][0].endswith("a") and alone[7][0][:3] == ["zz", "stop", "Azz"]  # the regex and the stop string took effect
    with running_server(_engine(lora_draft_bundle, spec)) as srv:
        got: list[dict | None] = [None] * len(REQUESTS)

        def run(i: int) -> None:
            got[i] = _answer(srv.url, *REQUESTS[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(REQUESTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got += [_answer(srv.url, *REQUESTS[2])]  # alone too: a lone adapter row always gets drafts to verify
        stats = srv.state.engine.stats()
    assert stats.spec_draft_tokens_total > 0 and stats.spec_accepted_tokens_total > 0  # it did speculate
    for i, (want, answer) in enumerate(zip([*alone, alone[2]], got, strict=True)):
        if i == SAMPLED and spec.method == SpecMethod.LAYERSKIP:  # a model's drafts keep the distribution, not the
            assert answer is not None and answer.keys() == {0, 1}  # draws (README: only prompt lookup's are the plain ones)
            continue
        assert answer == want, (REQUESTS[i], want, answer)
