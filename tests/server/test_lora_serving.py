"""Serving LoRA adapters over HTTP: each adapter is a model (parent: the base), `model` selects it, unknown
names are 404 model_not_found, a request waits while every slot is busy (/metrics counts the slots' loads and
evictions), and `serve` refuses bad adapters in one line."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from lineside.bundle import open_bundle
from lineside.runtime.adapters import LoraModule, serving_config
from tests.cli.cli_run import assert_one_line_error, run_cli, unreadable_dirs
from tests.conftest import make_peft_adapter
from tests.server.conftest import SlowBackend, running_server

PROMPT = [1, 17, 42, 5, 99, 250, 3, 77]


@pytest.fixture(scope="module")
def lora_served_bundle(tiny_bundles, peft_adapter, tmp_path_factory):
    """The tiny Llama with LoRA graphs and one adapter of its own ("line-a"); "line-b" comes by --lora-modules."""
    from lineside.build.lora_commands import add

    src = tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=64, accuracy_level=0,
                       max_lora_rank=8)
    dst = tmp_path_factory.mktemp("lora-serve") / "tiny-llama"
    shutil.copytree(src, dst)
    add(dst, peft_adapter("llama-gqa", "qv"), name="line-a")
    return dst, peft_adapter("llama-gqa", "all-rslora")


def _engine(bundle_dir, extra, *, max_loras, delay=0.0):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(bundle_dir)
    lora = serving_config(b, [LoraModule("line-b", extra)], max_loras=max_loras, max_rank=None)
    be = OnnxRuntimeBackend(b, num_slots=4, threads=1, lora=lora.slots)
    return LLMEngine(b, backend=SlowBackend(be, delay) if delay else be, num_slots=4, lora=lora)


def _complete(url, model, n=6):
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0})


def test_adapters_are_models_and_model_selects_one(lora_served_bundle):
    bundle_dir, extra = lora_served_bundle
    with running_server(_engine(bundle_dir, extra, max_loras=2)) as srv:
        models = httpx.get(f"{srv.url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("tiny-llama", None), ("line-a", "tiny-llama"),
                                                            ("line-b", "tiny-llama")]
        assert httpx.get(f"{srv.url}/v1/models/line-b").json()["parent"] == "tiny-llama"
        answers = {}
        for model in ("tiny-llama", "line-a", "line-b"):
            r = _complete(srv.url, model)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            answers[model] = r.json()["choices"][0]["text"]
        assert len(set(answers.values())) == 3  # each adapter really changes the model
        # concurrent requests of all three batch together and give the same greedy answers
        results: dict[str, str] = {}

        def one(model):
            results[model] = _complete(srv.url, model).json()["choices"][0]["text"]

        threads = [threading.Thread(target=one, args=(m,)) for m in answers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == answers
        # a session holds the base model's KV: an adapter's answer cannot be kept in one
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "model": "line-a", "prompt": PROMPT, "max_tokens": 2, "session_id": "s1", "keep_session": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_session", r.text
        r = _complete(srv.url, "line-z")
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "line-a" in err["message"]
        chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "line-a", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == "line-a"
        # /tokenize and /detokenize take an adapter's name and count with its base model's tokenizer
        counted = {model: httpx.post(f"{srv.url}/tokenize", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}]}).json() for model in answers}
        assert len({str(c) for c in counted.values()}) == 1
        assert counted["line-a"]["count"] == chat.json()["usage"]["prompt_tokens"]
        r = httpx.post(f"{srv.url}/detokenize", timeout=60, json={"model": "line-b", "tokens": PROMPT})
        assert r.status_code == 200 and isinstance(r.json()["prompt"], str)
        assert httpx.post(f"{srv.url}/tokenize", json={"model": "line-z", "prompt": "a"}).status_code == 404


def test_a_request_waits_while_every_slot_is_in_use(lora_served_bundle):
    """As vLLM's scheduler: an adapter that finds every slot held by running requests waits for one (it was a 429
    adapter_slots_full, while the server could run it a moment later); the base model needs no slot."""
    bundle_dir, extra = lora_served_bundle
    with running_server(_engine(bundle_dir, extra, max_loras=1)) as srv:
        alone = _complete(srv.url, "line-b").json()["choices"][0]["text"]
    with running_server(_engine(bundle_dir, extra, max_loras=1, delay=0.05)) as srv:
        # line-a's greedy answer to PROMPT has no EOS in its first 40 tokens: it holds the only slot while it streams
        body = {"model": "line-a", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        waited: list[httpx.Response] = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: dropping the iterator would close the stream (a cancel)
            next(lines)
            other = threading.Thread(target=lambda: waited.append(_complete(srv.url, "line-b")))
            other.start()
            assert _complete(srv.url, "tiny-llama", n=2).status_code == 200  # the base model needs no slot
            assert _lora_metrics(srv.url)["in_use"] == 1  # line-a's, or line-b's after it
            assert any('"finish_reason":"length"' in line for line in lines)
        other.join(60)
        assert waited and waited[0].status_code == 200, waited and waited[0].text
        assert waited[0].json()["choices"][0]["text"] == alone  # line-b's own answer, after line-a swapped out
        assert _lora_metrics(srv.url) == {"served": 2, "slots": 1, "loaded": 1, "in_use": 0, "loads": 2,
                                          "evictions": 1}


def _lora_metrics(url) -> dict[str, float]:
    """The lineside_lora_* samples of GET /metrics, by short name."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    short = {"lineside_lora_adapters_served": "served", "lineside_lora_slots": "slots",
             "lineside_lora_adapters_loaded": "loaded", "lineside_lora_adapters_in_use": "in_use",
             "lineside_lora_slot_loads_total": "loads", "lineside_lora_slot_evictions_total": "evictions"}
    return {short[s.name]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in short}


def test_serve_refuses_bad_adapters_in_one_line(lora_served_bundle, tiny_bundles, peft_adapter, tiny_dense, tmp_path):
    bundle_dir, extra = lora_served_bundle
    big = make_peft_adapter(tiny_dense("llama-gqa"), tmp_path / "r16", r=16, lora_alpha=16, target_modules=["q_proj"])
    cases = [
        (("--lora-modules", "nameonly"), ("NAME=ADAPTER_DIR",)),
        (("--lora-modules", f"big={big}"), ("rank 16",)),
        (("--lora-modules", f"b={extra}", "--max-lora-rank", "4"), ("rank 8", "--max-lora-rank")),
        (("--lora-modules", f"q={peft_adapter('qwen2-bias-tied', 'qv')}"), ("qwen2",)),
        (("--lora-modules", f"line-a={extra}"), ("given twice",)),
        # a name the base model answers to: requests for it got the base model, the adapter was unreachable
        (("--lora-modules", f"tiny-llama={extra}"), ("'tiny-llama'", "base model", "another name")),
        (("--served-model-name", "plant", "--lora-modules", f"plant={extra}"), ("'plant'", "base model")),
        (("--lora-modules", f"x={tmp_path / 'none'}"), ("not an adapter directory",)),
    ]
    # paths the OS refuses to look up: the OSError escaped lora.py (a bare OS error with the whole path)
    paths = unreadable_dirs(tmp_path)
    cases += [
        (("--lora-modules", f"x={paths['too long']}"), ("the adapter directory cannot be read (File name too long)",)),
        (("--lora-modules", f"x={paths['loop']}"), ("cannot be read (Too many levels of symbolic links)",)),
        (("--lora-modules", f"x={paths['deep']}"), ("the adapter directory cannot be read (File name too long)",)),
    ]
    for args, needles in cases:
        assert_one_line_error(run_cli("serve", str(bundle_dir), "--port", "1", *args), *needles)
    plain = tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=64)
    assert_one_line_error(run_cli("serve", str(plain), "--port", "1", "--lora-modules", f"a={extra}"),
                          "--max-lora-rank")
    assert_one_line_error(run_cli("serve", str(plain), "--port", "1", "--max-loras", "2"), "no adapters")



def test_adapter_requests_go_through_the_slo_ladder_on_the_primary(lora_served_bundle):
    """An adapter runs on the primary only, but its requests are still the primary's load: degraded, they carry
    the level's header, and at level 1 a batch-mode one waits at the batch gate while the running batch is at the
    policy's cap (they used to skip the guard altogether)."""
    from lineside.server.slo.guard import SloGuard
    from lineside.server.slo.policy import SloPolicy
    from tests.server.conftest import metric

    bundle_dir, extra = lora_served_bundle
    policy = SloPolicy(fallback_modes=(), fallback_priorities=(), batch_running_cap=1, min_samples=1)
    guard = SloGuard(policy, device=lambda: (None, None), ticking=False)
    with running_server(_engine(bundle_dir, extra, max_loras=2, delay=0.05), slo_guard=guard) as srv:
        guard.signals.observe(ttft_s=1.0, queue_s=0.0)
        assert guard.tick(device=(None, None)) == 1
        batch = {"X-Mode": "batch"}
        # line-a's greedy answer has no EOS in its first 40 tokens: the running batch is at the cap while it streams
        body = {"model": "line-a", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=batch, timeout=60) as stream:
            assert stream.status_code == 200 and stream.headers["x-lineside-degraded"] == "1"
            lines = stream.iter_lines()
            next(lines)
            r = httpx.post(f"{srv.url}/v1/completions", timeout=60, headers=batch,
                           json={"model": "line-b", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == "line-b" and r.headers["x-lineside-degraded"] == "1"
            assert any('"finish_reason":"length"' in line for line in lines)
        text = httpx.get(f"{srv.url}/metrics").text
    assert metric(text, "lineside_slo_batch_held_total") == 1


def test_lora_modules_take_vllms_json_form(lora_served_bundle, tmp_path):
    """vLLM's --lora-modules also takes '{"name": ..., "path": ..., "base_model_name": ...}': its commas were split
    as separate NAME=DIR items ("give NAME=ADAPTER_DIR"), so a vLLM command line failed here."""
    from lineside.runtime.adapters import parse_lora_modules

    bundle_dir, extra = lora_served_bundle
    given = [json.dumps({"name": "line-b", "path": str(extra), "base_model_name": "tiny-llama"}), "x=/a,y=/b"]
    assert [(m.name, str(m.path)) for m in parse_lora_modules(given)] == [("line-b", str(extra)), ("x", "/a"),
                                                                         ("y", "/b")]
    bad = '{"name": "line-b"}'
    assert_one_line_error(run_cli("serve", str(bundle_dir), "--port", "1", "--lora-modules", bad), '"path"')
    assert_one_line_error(run_cli("serve", str(bundle_dir), "--port", "1", "--lora-modules", "{nope"), "JSON")
