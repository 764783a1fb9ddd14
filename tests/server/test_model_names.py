"""Which `model` names the server answers to: the bundle's name (its target's when served through a
link such as a Jetson's `current`), the checkpoint's name, or exactly the --served-model-name list."""

from __future__ import annotations

import json

import httpx
import pytest

from lineside.bundle import default_model_names
from tests.server.conftest import running_server


def _chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


def test_default_names_follow_links_and_add_the_checkpoint_name(tiny_bundle, tmp_path):
    link = tmp_path / "current"
    link.symlink_to(tiny_bundle, target_is_directory=True)
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    names = default_model_names(link, {**manifest, "model_name": "org/Tiny-Chat"})
    assert names == ["tiny-llama", "org/Tiny-Chat", "Tiny-Chat"]
    assert default_model_names(tiny_bundle, {"model_name": "tiny-llama"}) == ["tiny-llama"]
    pushed = tmp_path / "versions" / "smollm2-w4a16-0123456789ab-20261129T181500Z"  # what jetson push installs
    pushed.mkdir(parents=True)
    (tmp_path / "cur").symlink_to(pushed, target_is_directory=True)
    assert default_model_names(tmp_path / "cur", {}) == ["smollm2-w4a16"]  # stable across pushes


def test_served_through_a_link_answers_to_the_bundle_name(tiny_bundle, tmp_path):
    link = tmp_path / "current"
    link.symlink_to(tiny_bundle, target_is_directory=True)
    with running_server(link, num_slots=1, threads=1) as srv:
        models = httpx.get(f"{srv.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny-llama"]  # not "current"
        r = _chat(srv.url, "tiny-llama")
        assert r.status_code == 200 and r.json()["model"] == "tiny-llama"
        ckpt = json.loads((tiny_bundle / "manifest.json").read_text()).get("model_name")
        if ckpt and ckpt != "tiny-llama":
            assert _chat(srv.url, ckpt).status_code == 200  # the checkpoint's name is an alias
        assert _chat(srv.url, "current").status_code == 404


@pytest.mark.parametrize("names", [["factory-llm"], ["factory-llm", "gpt-4o-mini"]])
def test_served_model_name_replaces_the_defaults(tiny_bundle, names):
    with running_server(tiny_bundle, num_slots=1, threads=1, served_model_names=names) as srv:
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == names
        for n in names:
            r = _chat(srv.url, n)
            assert r.status_code == 200 and r.json()["model"] == names[0]
        r = _chat(srv.url, "tiny-llama")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert all(repr(n) in r.json()["error"]["message"] for n in names)
        assert httpx.get(f"{srv.url}/v1/models/{names[-1]}").json()["id"] == names[-1]


def test_cli_passes_served_model_names(tiny_bundle, monkeypatch):
    import lineside.server.serve as serve_mod
    from lineside.cli import main

    got = {}
    monkeypatch.setattr(serve_mod, "run", lambda app, *a, **k: got.setdefault("state", app.state.lineside))
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tiny_bundle), "--served-model-name", "a", "--served-model-name", " b ",
              "--served-model-name", ""])
    assert e.value.code == 0 and got["state"].served_names == ["a", "b"]
