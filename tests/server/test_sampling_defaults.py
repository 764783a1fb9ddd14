"""The model's recommended sampling (generation_config.json) for the fields a request leaves out, as vLLM's
`--generation-config auto`: read only where the file differs from transformers' defaults, checked in one line,
and never over what the request says."""

from __future__ import annotations

import json

import httpx
import pytest

from lineside.errors import LinesideError
from lineside.runtime.sampling_defaults import SamplingDefaults, read_sampling_defaults
from lineside.server import request_mapping
from lineside.server.schemas import ChatCompletionRequest
from tests.cli.cli_run import run_cli
from tests.server.conftest import make_engine, running_server

R1_DISTILL = {"_from_model_config": True, "bos_token_id": 151646, "eos_token_id": 151643, "do_sample": True,
              "temperature": 0.6, "top_p": 0.95, "transformers_version": "4.39.3"}  # its generation_config.json


def _read(tmp_path, config) -> SamplingDefaults:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(config))
    return read_sampling_defaults(path)


def test_read_as_vllm_reads_it(tmp_path):
    assert _read(tmp_path, R1_DISTILL) == SamplingDefaults(temperature=0.6, top_p=0.95)
    # transformers' own defaults (save_pretrained may write them) recommend nothing: top_k 50 is not applied
    assert _read(tmp_path, {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}) == \
        SamplingDefaults()
    assert _read(tmp_path, {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}) == SamplingDefaults(
        top_k=20, min_p=0.05, repetition_penalty=1.05)
    assert _read(tmp_path, {"top_k": -1, "temperature": None}) == SamplingDefaults()
    assert read_sampling_defaults(tmp_path / "absent.json") == SamplingDefaults()
    assert SamplingDefaults(temperature=0.6, top_p=0.95).changed() == {"temperature": 0.6, "top_p": 0.95}


@pytest.mark.parametrize("config", [{"temperature": -1}, {"top_p": 0}, {"top_k": 2.5}, {"temperature": "hot"},
                                    {"repetition_penalty": False}, {"min_p": 2}, [1, 2]])
def test_a_bad_field_is_one_line_naming_it(tmp_path, config):
    with pytest.raises(LinesideError) as e:
        _read(tmp_path, config)
    msg = str(e.value)
    assert "\n" not in msg and "--generation-config none" in msg
    if isinstance(config, dict):
        assert next(iter(config)) in msg


def test_what_the_request_says_wins_and_the_rest_is_the_models():
    given = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = request_mapping.sampling_params(req, defaults=given)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.95, 20, 0.05, 1.1)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0, top_p=1, top_k=-1,
                                min_p=0, repetition_penalty=1)
    p = request_mapping.sampling_params(req, defaults=given)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0, 1, 0, 0, 1)
    p = request_mapping.sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_every_generation_route_samples_with_the_defaults(tiny_bundle):
    engine = make_engine(tiny_bundle)
    seen = []
    submit_all = engine.submit_all  # every route's submit goes through it
    engine.submit_all = lambda reqs: (seen.extend(r.sampling for r in reqs), submit_all(reqs))[1]
    given = SamplingDefaults(temperature=0.6, top_p=0.95)
    with running_server(engine, sampling_defaults=given) as srv:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
            key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
            r = httpx.post(f"{srv.url}{path}", json={**body, key: 2}, timeout=60)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{srv.url}{path}", json={**body, key: 2, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
    assert [(s.temperature, s.top_p) for s in seen] == [(0.6, 0.95), (0, 0.95)] * 3


def test_the_option_takes_vllms_spellings_and_a_folder(tmp_path):
    """vLLM's --generation-config takes auto, vllm (its own defaults: OpenAI's here) or a folder."""
    from lineside.runtime.sampling_defaults import resolve_generation_config

    bundle_tok, other = tmp_path / "tokenizer", tmp_path / "other"
    for d, config in ((bundle_tok, R1_DISTILL), (other, {"temperature": 0.3})):
        d.mkdir()
        (d / "generation_config.json").write_text(json.dumps(config))
    assert resolve_generation_config("auto", bundle_tok) == SamplingDefaults(temperature=0.6, top_p=0.95)
    assert resolve_generation_config("vllm", bundle_tok) == resolve_generation_config("None", bundle_tok) == \
        SamplingDefaults()
    assert resolve_generation_config(str(other), bundle_tok) == SamplingDefaults(temperature=0.3)
    assert resolve_generation_config(str(other / "generation_config.json"), bundle_tok) == \
        SamplingDefaults(temperature=0.3)
    with pytest.raises(LinesideError, match="not auto, vllm or none, nor a folder"):
        resolve_generation_config(str(tmp_path / "missing"), bundle_tok)


def test_serve_refuses_an_unknown_choice(tiny_bundle):
    r = run_cli("serve", tiny_bundle, "--generation-config", "bogus")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--generation-config" in r.stderr
    assert "not auto, vllm or none" in r.stderr


@pytest.mark.parametrize("choice,want", [("auto", SamplingDefaults(temperature=0.6, top_p=0.95)),
                                         ("none", SamplingDefaults())])
def test_serve_reads_the_bundles_generation_config(tiny_dense, tmp_path, monkeypatch, choice, want):
    """A checkpoint's generation_config.json travels into the bundle; `serve` samples with it unless told not to."""
    import shutil

    import lineside.server.serve as serve_mod
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.cli import main
    from tests.conftest import TINY_BUNDLE

    ckpt = tmp_path / "r1-style"
    shutil.copytree(tiny_dense(TINY_BUNDLE["variant"]), ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps(R1_DISTILL | {"bos_token_id": 1, "eos_token_id": 2}))
    bundle = tmp_path / "bundle"
    build_bundle(ckpt, bundle, BuildOptions(**{k: v for k, v in TINY_BUNDLE.items() if k != "variant"}))
    got = {}
    monkeypatch.setattr(serve_mod, "run", lambda app, *a, **k: got.setdefault("state", app.state.lineside))
    with pytest.raises(SystemExit) as e:
        main(["serve", str(bundle), "--generation-config", choice])
    assert e.value.code == 0 and got["state"].sampling_defaults == want


def test_a_response_object_names_the_sampling_it_was_made_with(tiny_bundle):
    """/v1/responses echoes temperature and top_p in its Response object (as vLLM does, from the sampling it ran):
    a request that leaves them out samples with the model's recommendation, and the object must say so, not
    OpenAI's 1.0 / 1.0, streamed or not."""
    given = SamplingDefaults(temperature=0.6, top_p=0.95)
    with running_server(make_engine(tiny_bundle), sampling_defaults=given) as srv:
        body = {"input": "hi", "max_output_tokens": 2, "store": False}
        r = httpx.post(f"{srv.url}/v1/responses", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert (r.json()["temperature"], r.json()["top_p"]) == (0.6, 0.95)
        with httpx.stream("POST", f"{srv.url}/v1/responses", json={**body, "stream": True}, timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        for e in events:
            if "response" in e:
                assert (e["response"]["temperature"], e["response"]["top_p"]) == (0.6, 0.95), e["type"]
        r = httpx.post(f"{srv.url}/v1/responses", json={**body, "temperature": 0.2, "top_p": 0.5}, timeout=60)
        assert (r.json()["temperature"], r.json()["top_p"]) == (0.2, 0.5)


def test_create_app_reads_the_bundles_own_by_default(tiny_dense, tmp_path):
    """The Python API (create_app on a bundle or an engine) samples as `serve` does unless told otherwise."""
    import shutil

    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.server.app import create_app
    from tests.conftest import TINY_BUNDLE

    ckpt = tmp_path / "r1-style"
    shutil.copytree(tiny_dense(TINY_BUNDLE["variant"]), ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps(R1_DISTILL | {"bos_token_id": 1, "eos_token_id": 2}))
    bundle = build_bundle(ckpt, tmp_path / "bundle",
                          BuildOptions(**{k: v for k, v in TINY_BUNDLE.items() if k != "variant"}))
    want = SamplingDefaults(temperature=0.6, top_p=0.95)
    assert create_app(bundle).state.lineside.sampling_defaults == want
    assert create_app(make_engine(bundle)).state.lineside.sampling_defaults == want
    assert create_app(bundle, sampling_defaults=SamplingDefaults()).state.lineside.sampling_defaults == \
        SamplingDefaults()


def test_max_new_tokens_is_the_default_length_where_the_request_gives_none(tiny_bundle, tmp_path):
    """vLLM's --generation-config auto also reads max_new_tokens (SmolLM-135M-Instruct ships 40): the length of a
    chat or responses answer whose request sends no max_tokens. /v1/completions keeps OpenAI's 16, and a request's
    own max_tokens wins."""
    assert _read(tmp_path, {"max_new_tokens": 40, "temperature": 0.6}) == SamplingDefaults(temperature=0.6, max_tokens=40)
    with pytest.raises(LinesideError, match="max_new_tokens"):
        _read(tmp_path, {"max_new_tokens": 0})
    engine = make_engine(tiny_bundle)
    seen = []
    submit_all = engine.submit_all  # every route's submit goes through it
    engine.submit_all = lambda reqs: (seen.extend(r.max_tokens for r in reqs), submit_all(reqs))[1]
    with running_server(engine, sampling_defaults=SamplingDefaults(max_tokens=3)) as srv:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/responses", {"input": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})):
            r = httpx.post(f"{srv.url}{path}", json={**body, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
    assert seen == [3, 3, 16, 5]
