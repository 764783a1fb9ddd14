"""Runtime LoRA loading (`serve --allow-runtime-lora`, vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter):
a loaded adapter answers as the same adapter given with --lora-modules, a bad one is a one-line 400, an unloaded
one is refused to new requests while those already running or waiting on it finish with it, and the slots and
/metrics follow."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

from lineside.bundle import open_bundle
from lineside.lora import read_adapter
from lineside.runtime.adapter_slots import (
    AdapterInUse,
    AdapterLoad,
    AdapterSlots,
    AdapterSlotsFull,
    UnknownAdapter,
)
from lineside.runtime.adapters import LoraModule, serving_config
from tests.cli.cli_run import assert_one_line_error, run_cli
from tests.conftest import make_peft_adapter
from tests.server.conftest import SlowBackend, running_server
from tests.server.test_lora_serving import _lora_metrics

PROMPT = [1, 17, 42, 5, 99, 250, 3, 77]


@pytest.fixture(scope="module")
def runtime_bundle(tiny_bundles, peft_adapter):
    """The tiny Llama with LoRA graphs (rank 8) and no adapter of its own; two PEFT adapters to load."""
    bundle = tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=64, accuracy_level=0,
                          max_lora_rank=8)
    return bundle, peft_adapter("llama-gqa", "qv"), peft_adapter("llama-gqa", "all-rslora")


def _engine(bundle_dir, modules=(), *, runtime=False, max_loras=None, delay=0.0):
    """An engine as `serve` makes it: --lora-modules ``modules`` (name, dir), --allow-runtime-lora when ``runtime``."""
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(bundle_dir)
    lora = serving_config(b, [LoraModule(n, p) for n, p in modules], max_loras=max_loras, max_rank=None,
                          runtime=runtime)
    be = OnnxRuntimeBackend(b, num_slots=4, threads=1, accuracy_level=0, lora=None if lora is None else lora.slots)
    return LLMEngine(b, backend=SlowBackend(be, delay) if delay else be, num_slots=4, lora=lora)


def _roots(*paths):
    """--lora-dir for adapters made in the run's temporary directories: the one directory above them all."""
    return [os.path.commonpath([str(p) for p in paths])]


def _complete(url, model, n=6, **extra):
    return httpx.post(f"{url}/v1/completions", timeout=60, headers=extra.pop("headers", None),
                      json={"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0, **extra})


def _answer(url, model, n=6):
    """Greedy text and per-token top-3 logprobs: the numbers compared between servers."""
    r = _complete(url, model, n, logprobs=3)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["top_logprobs"]


def _load(url, name, path, headers=None):
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=60)


def _unload(url, name, headers=None):
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)


def test_a_runtime_adapter_answers_as_lora_modules_and_the_base_is_unchanged(runtime_bundle):
    bundle_dir, qv, _ = runtime_bundle
    with running_server(_engine(bundle_dir)) as srv:  # no LoRA at all: the base graph
        base = _answer(srv.url, srv.state.model_name)
        assert _load(srv.url, "line-b", qv).status_code == 404  # the routes exist only with the flag
    with running_server(_engine(bundle_dir, [("line-b", qv)])) as srv:  # --lora-modules line-b=DIR
        given = _answer(srv.url, "line-b")
    with running_server(_engine(bundle_dir, runtime=True), allow_runtime_lora=True, lora_dirs=_roots(qv)) as srv:
        name = srv.state.model_name
        assert srv.state.engine.backend.max_loras == 4  # slots, empty, for adapters that come later
        assert _answer(srv.url, name) == base  # the LoRA graph's slots with no adapter: the base model's numbers
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == [name]
        assert _complete(srv.url, "line-b").status_code == 404
        assert _lora_metrics(srv.url) == {"served": 0, "slots": 4, "loaded": 0, "in_use": 0, "loads": 0,
                                          "evictions": 0}
        r = _load(srv.url, "line-b", qv)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'line-b' added successfully."
        models = httpx.get(f"{srv.url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(name, None), ("line-b", name)]
        runtime = _answer(srv.url, "line-b")
        assert runtime == given  # same greedy tokens, same logprobs as --lora-modules
        assert runtime[0] != base[0]  # and the adapter really changes the model
        assert _answer(srv.url, name) == base
        assert _lora_metrics(srv.url) == {"served": 1, "slots": 4, "loaded": 1, "in_use": 0, "loads": 1,
                                          "evictions": 0}


def test_bad_loads_and_unloads_are_one_line_4xx(runtime_bundle, peft_adapter, tiny_dense, tmp_path):
    bundle_dir, qv, rs = runtime_bundle
    big = make_peft_adapter(tiny_dense("llama-gqa"), tmp_path / "r16", r=16, lora_alpha=16, target_modules=["q_proj"])
    dora = make_peft_adapter(tiny_dense("llama-gqa"), tmp_path / "dora", r=4, lora_alpha=8, use_dora=True,
                             target_modules=["q_proj"])
    # an SFT adapter (task_type: no auto_mapping) of a Qwen2 model whose A/B shapes fit the Llama bundle
    sft_qwen = make_peft_adapter(tiny_dense("qwen2-bias-tied"), tmp_path / "sft-qwen", r=4, lora_alpha=8,
                                 target_modules=["q_proj"], task_type="CAUSAL_LM")
    key = {"Authorization": "Bearer k1"}
    roots = _roots(qv, rs, tmp_path, peft_adapter("qwen2-bias-tied", "qv"))
    with running_server(_engine(bundle_dir, [("line-a", qv)], runtime=True), allow_runtime_lora=True,
                        api_key="k1", lora_dirs=roots) as srv:
        name = srv.state.model_name
        assert _load(srv.url, "x", rs).status_code == 401  # under the server's key
        assert _unload(srv.url, "line-a").status_code == 401
        cases = [
            ({"lora_name": "x", "lora_path": str(big)}, "lora_path", ("rank 16", "--max-lora-rank")),
            ({"lora_name": "x", "lora_path": str(peft_adapter("qwen2-bias-tied", "qv"))}, "lora_path", ("qwen2",)),
            ({"lora_name": "x", "lora_path": str(dora)}, "lora_path", ("use_dora true", "plain LoRA")),
            ({"lora_name": "x", "lora_path": str(sft_qwen)}, "lora_path",
             ("base_model_name_or_path", "architecture is qwen2")),
            ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, "lora_path", ("not an adapter directory",)),
            ({"lora_name": "x", "lora_path": " "}, "lora_path", ("lora_path is empty",)),
            ({"lora_name": "x", "lora_path": f"{tmp_path}/a\nb"}, "lora_path", ("control character",)),
            ({"lora_name": "x/y", "lora_path": str(rs)}, "lora_name", ("1-64 letters",)),
            ({"lora_name": name, "lora_path": str(rs)}, "lora_name", ("base model",)),
            ({"lora_name": "line-a", "lora_path": str(rs)}, "lora_name", ("already loaded",)),
            ({"lora_name": "x"}, "lora_path", ("lora_path",)),
            ({"lora_name": "x", "lora_path": "x" * 2000}, "lora_path",
             ("the adapter directory cannot be read (File name too long)",)),
            ({"lora_name": 3, "lora_path": str(rs)}, "lora_name", ("lora_name",)),
        ]
        for body, param, needles in cases:
            r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=body, headers=key, timeout=60)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and "\n" not in err["message"], (body, err)
            assert all(n in err["message"] for n in needles), (body, err)
        r = _unload(srv.url, "line-z", headers=key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and "line-a" in r.text
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models", headers=key).json()["data"]] == [name, "line-a"]
        # the bundle's own and --lora-modules adapters can be unloaded too
        assert _unload(srv.url, "line-a", headers=key).status_code == 200
        assert _complete(srv.url, "line-a", headers=key).status_code == 404


def test_unload_lets_running_and_waiting_requests_finish_then_frees_the_slot(runtime_bundle):
    """One slot: line-a streams in it while a line-b request waits for it; both are unloaded. New requests naming
    either get 404 at once; the running one finishes with line-a, the waiting one then loads line-b and finishes
    with it (its own answer), and the slot is empty when the last ends. Loaded again, line-b answers as before."""
    bundle_dir, qv, rs = runtime_bundle
    with running_server(_engine(bundle_dir, [("line-a", qv), ("line-b", rs)], max_loras=1)) as srv:
        alone_a = _complete(srv.url, "line-a", n=40).json()["choices"][0]["text"]
        alone_b = _complete(srv.url, "line-b").json()["choices"][0]["text"]
    engine = _engine(bundle_dir, runtime=True, max_loras=1, delay=0.05)
    # events, not polls: line-b's request queued behind line-a's, and line-b's slot emptied when its last request ended
    queued_b, emptied_b = threading.Event(), threading.Event()
    submit_all, forget = engine.submit_all, engine.adapter_slots._forget

    def watched_submit_all(reqs):
        handles = submit_all(reqs)
        if any(req.adapter == "line-b" for req in reqs):
            queued_b.set()
        return handles

    def watched_forget(key):
        forget(key)
        if key.startswith("line-b#") and not engine.adapter_slots.resident:
            emptied_b.set()

    engine.submit_all, engine.adapter_slots._forget = watched_submit_all, watched_forget
    with running_server(engine, allow_runtime_lora=True, lora_dirs=_roots(qv, rs)) as srv:
        assert _load(srv.url, "line-a", qv).status_code == 200 and _load(srv.url, "line-b", rs).status_code == 200
        body = {"model": "line-a", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        waited: list[httpx.Response] = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            seen = [next(lines)]
            other = threading.Thread(target=lambda: waited.append(_complete(srv.url, "line-b")))
            other.start()
            assert queued_b.wait(60), "line-b's request never reached the engine"
            assert engine.stats().waiting == 1  # behind line-a, which holds the only slot
            assert _unload(srv.url, "line-b").status_code == 200
            assert _unload(srv.url, "line-a").status_code == 200
            for model in ("line-a", "line-b"):
                r = _complete(srv.url, model)
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert httpx.get(f"{srv.url}/v1/models").json()["data"][1:] == []
            assert _lora_metrics(srv.url) | {"loads": 0} == {"served": 0, "slots": 1, "loaded": 1, "in_use": 1,
                                                             "loads": 0, "evictions": 0}
            seen += list(lines)
        other.join(60)
        assert waited and waited[0].status_code == 200, waited and waited[0].text
        assert waited[0].json()["choices"][0]["text"] == alone_b  # line-b's own answer, after line-a went
        chunks = [json.loads(line[6:]) for line in seen if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == alone_a  # line-a's to the end
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert emptied_b.wait(60), "line-b's slot was never emptied"
        assert engine.stats().lora_adapters_loaded == 0
        # line-a's slot was emptied when its request ended, so line-b took a free slot: a load, no eviction
        assert _lora_metrics(srv.url) == {"served": 0, "slots": 1, "loaded": 0, "in_use": 0, "loads": 2,
                                          "evictions": 0}
        assert engine.backend.inner.lora.width == 0  # the backend's stack is empty again
        assert _load(srv.url, "line-b", rs).status_code == 200
        assert _complete(srv.url, "line-b").json()["choices"][0]["text"] == alone_b
        assert _complete(srv.url, "line-a").status_code == 404


def test_slots_keep_an_unloaded_adapter_until_its_last_request_ends(runtime_bundle):
    """AdapterSlots alone: hold/drop count requests per load, remove defers while held, the slot empties with the
    last; the name can be loaded again meanwhile, as a new load (its own key and KV namespace) beside the old."""
    bundle_dir, qv, rs = runtime_bundle
    cfg = open_bundle(bundle_dir).config
    a, b, a2 = read_adapter(qv, cfg, "a"), read_adapter(rs, cfg, "b"), read_adapter(rs, cfg, "a")
    s = AdapterSlots({}, 1)
    s.add(a)
    assert s.hold("a") == "a#1" and s.acquire("a#1") == 1 and s.take_pending() == [AdapterLoad(1, a)]
    with pytest.raises(AdapterInUse, match="load_inplace"):
        s.add(a2)  # served: only a replacing load takes the name
    s.remove("a")
    with pytest.raises(UnknownAdapter):
        s.hold("a")  # new requests: refused
    assert s.slot_of("a#1") == 1 and s.take_pending() == []  # the running request keeps it
    s.add(a2)  # loaded again at once: a new load, which waits for the slot the old one's request holds
    assert s.hold("a") == "a#2" and s.retiring == {"a#1": a} and s.adapters == {"a": a2}
    with pytest.raises(AdapterSlotsFull):
        s.acquire("a#2")
    s.release(1)
    s.drop("a#1")
    assert s.slot_of("a#1") is None and s.take_pending() == [AdapterLoad(1, None)] and not s.retiring
    assert s.acquire("a#2") == 1 and s.take_pending() == [AdapterLoad(1, a2)]
    s.add(a, replace=True)  # load_inplace: a#2 retires (its request holds it), a#3 is served
    assert s.hold("a") == "a#3" and s.namespaces == {"a": "a#3"} and list(s.retiring) == ["a#2"]
    s.release(1)
    s.drop("a#2")
    s.drop("a#3")  # a request that never got a slot
    assert not s.holds and not s.retiring and not s.resident and s.take_pending() == [AdapterLoad(1, None)]
    s.add(b)
    s.remove("b")  # nobody held it: gone at once, nothing to write
    assert s.names == ["a"] and s.take_pending() == [] and list(s.by_key) == ["a#3"]
    with pytest.raises(UnknownAdapter):
        s.remove("b")


def test_serve_allow_runtime_lora_needs_a_lora_graph(tiny_bundles):
    plain = tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=64)
    assert_one_line_error(run_cli("serve", str(plain), "--port", "1", "--allow-runtime-lora"),
                          "--allow-runtime-lora", "--max-lora-rank")
    shown = run_cli("serve", "--help", env={**os.environ, "COLUMNS": "250"}).stdout
    assert "--allow-runtime-lora" in shown and "/v1/load_lora_adapter" in shown


def test_every_post_is_held_to_the_body_limit(runtime_bundle):
    """The adapter routes (and the other POSTs that run no generation) read their bodies under the server's body
    limit as the generation routes do: a 413 in one line, sized or chunked, counted as an invalid request."""
    from tests.server.conftest import metric

    bundle_dir, qv, _ = runtime_bundle
    with running_server(_engine(bundle_dir, runtime=True), allow_runtime_lora=True, max_body_bytes=1024,
                        lora_dirs=_roots(qv)) as srv:
        def invalid() -> float:
            return metric(httpx.get(f"{srv.url}/metrics").text, "lineside_requests_total", 'outcome="invalid"')

        big = json.dumps({"lora_name": "line-b", "lora_path": "x" * 2000}).encode()
        paths = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/responses/resp_x/cancel"]
        before = invalid()
        for path in paths:
            r = httpx.post(srv.url + path, content=big, headers={"Content-Type": "application/json"}, timeout=60)
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", (path, r.text)
            assert "1024" in r.json()["error"]["message"] and "\n" not in r.text, r.text
        for path in paths[:2]:  # chunked: no Content-Length to refuse up front, the bytes are counted as they come
            r = httpx.post(srv.url + path, content=iter([big[:600], big[600:]]),
                           headers={"Content-Type": "application/json"}, timeout=60)
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", (path, r.text)
        assert invalid() - before == len(paths) + 2
        assert _load(srv.url, "line-b", qv).status_code == 200  # a body under the limit is read as before
        assert _unload(srv.url, "line-b").status_code == 200


def test_the_adapter_routes_leave_the_grammar_compiler_unbuilt(runtime_bundle):
    """The routes check the engine serves adapters without reading its properties: the structured-output compiler,
    made on first use (a second of reading the vocabulary, on the event loop here), stays unmade."""
    bundle_dir, qv, _ = runtime_bundle
    with running_server(_engine(bundle_dir, runtime=True), allow_runtime_lora=True, lora_dirs=_roots(qv)) as srv:
        assert not srv.state.engine.grammar_ready
        assert _unload(srv.url, "line-z").status_code == 404
        assert _load(srv.url, "line-b", qv).status_code == 200
        assert _unload(srv.url, "line-b").status_code == 200
        assert not srv.state.engine.grammar_ready


def test_loads_read_only_under_lora_dir(runtime_bundle, tmp_path):
    """A lora_path resolving outside every --lora-dir (``..``, absolute, a symlinked directory or weights file) is
    a one-line 403 before anything is read; paths under it load, relative to it too; no refusal names the server's
    directories (a client learns no path it did not send)."""
    import shutil

    bundle_dir, qv, _ = runtime_bundle
    root, outside = tmp_path / "adapters", tmp_path / "outside"
    shutil.copytree(qv, root / "line-b")
    shutil.copytree(qv, outside / "secret")
    (root / "escape").symlink_to(outside / "secret", target_is_directory=True)
    (root / "inner").symlink_to(root / "line-b", target_is_directory=True)
    (root / "planted").mkdir()
    shutil.copy(qv / "adapter_config.json", root / "planted")
    (root / "planted" / "adapter_model.safetensors").symlink_to(outside / "secret" / "adapter_model.safetensors")
    with running_server(_engine(bundle_dir, runtime=True), allow_runtime_lora=True, lora_dirs=[root]) as srv:
        refused = [str(outside / "secret"), "../outside/secret", f"{root}/../outside/secret", "escape", "planted",
                   "/", "line-b/../../outside/secret", str(root / "escape")]
        for path in refused:
            r = _load(srv.url, "x", path)
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "lora_path_not_allowed" and err["param"] == "lora_path", (path, err)
            assert "--lora-dir" in err["message"] and "\n" not in err["message"], (path, err)
            assert str(root) not in err["message"].replace(path, ""), (path, err)  # only what the client sent
        for path in ["nope", "x" * 2000, "line-b/adapter_config.json"]:  # under the directory: lora.py's own 400
            r = _load(srv.url, "x", path)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora_adapter", (path, r.text)
            assert str(tmp_path) not in r.text and str(tmp_path)[:40] not in r.text, (path, r.text)
        assert _load(srv.url, "x", "nope").json()["error"]["message"].startswith("nope: not an adapter directory")
        assert _load(srv.url, "line-b", "line-b").status_code == 200  # relative to --lora-dir
        assert _load(srv.url, "line-c", str(root / "line-b")).status_code == 200  # absolute under it
        assert _load(srv.url, "line-d", "inner").status_code == 200  # a symlink that stays inside
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]][1:] == ["line-b", "line-c",
                                                                                             "line-d"]
    with running_server(_engine(bundle_dir, runtime=True), allow_runtime_lora=True) as srv:  # no --lora-dir
        r = _load(srv.url, "line-b", str(qv))
        assert r.status_code == 403 and "--lora-dir" in r.json()["error"]["message"], r.text


def test_serve_checks_lora_dir_and_the_key(runtime_bundle, tmp_path):
    """--allow-runtime-lora needs --lora-dir (an existing directory), --lora-dir needs the flag, and off loopback
    the flag needs an API key: each one line before the model loads."""
    bundle_dir, qv, _ = runtime_bundle
    b = str(bundle_dir)
    env = {k: v for k, v in os.environ.items() if k != "LINESIDE_API_KEY"}
    cases = [
        (("--allow-runtime-lora",), ("--lora-dir DIR",)),
        (("--lora-dir", str(tmp_path)), ("--allow-runtime-lora",)),
        (("--allow-runtime-lora", "--lora-dir", str(tmp_path / "none")), ("not a directory",)),
        (("--allow-runtime-lora", "--lora-dir", str(tmp_path), "--host", "0.0.0.0"), ("API key", "--api-key-file")),
    ]
    for args, needles in cases:
        assert_one_line_error(run_cli("serve", b, "--port", "1", *args, env=env), *needles)


def test_load_inplace_replaces_a_served_adapter_and_never_reuses_its_kv(runtime_bundle, peft_adapter):
    """vLLM's ``load_inplace: true`` loads new weights under a name already served (an RL loop's weight sync):
    it was ignored, so the load was a 400 'already loaded'. Answers after it equal a fresh server's with the new
    weights, though the old weights' KV of the same prompt sat in the prefix cache; without it the 400 says how."""
    bundle_dir, qv, rs = runtime_bundle
    pat = peft_adapter("llama-gqa", "patterns")
    prompt = PROMPT + list(range(100, 116))  # 24 tokens: a full block of 16 for the prefix cache

    def answer(url):
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "line-a", "prompt": prompt,
                                                                 "max_tokens": 6, "temperature": 0, "logprobs": 2})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["top_logprobs"], r.json()["usage"]

    with running_server(_engine(bundle_dir, [("line-a", rs)])) as srv:
        fresh = answer(srv.url)[:2]
    engine = _engine(bundle_dir, runtime=True, max_loras=2)
    dirs = sorted({p.parent for p in (qv, rs, pat)})
    with running_server(engine, allow_runtime_lora=True, lora_dirs=dirs) as srv:
        assert _load(srv.url, "line-a", qv).status_code == 200
        old, cached = answer(srv.url), answer(srv.url)
        assert cached[:2] == old[:2] and cached[2]["prompt_tokens_details"]["cached_tokens"] > 0  # reused
        r = _load(srv.url, "line-a", rs)
        assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"], r.text
        body = {"lora_name": "line-a", "lora_path": str(rs), "load_inplace": True}
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'line-a' added successfully.", r.text
        new = answer(srv.url)
        assert new[:2] == fresh and new[:2] != old[:2]
        assert new[2]["prompt_tokens_details"]["cached_tokens"] == 0  # the old weights' KV was not reused
        # a name not served yet: load_inplace is a plain load
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={**body, "lora_name": "line-p", "lora_path": str(pat)},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]][1:] == ["line-a", "line-p"]
        slots = engine.adapter_slots
        assert not slots.retiring and not slots.holds and sorted(slots.resident.values()) == [slots.served["line-a"]]
        assert engine.backend.lora.loaded.count("line-a") == 1
