"""Speculation at the edges: `--speculative/--spec-tokens` bad input is one line on serve, generate and bench;
`generate --speculative ngram` prints what plain generate prints; the server honours "speculative": false and
exports the spec_decode counters and acceptance histogram on /metrics."""

from __future__ import annotations

import httpx
import pytest

from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from tests.cli.test_cli_errors import assert_one_line_error, run_cli
from tests.server.conftest import metric, running_server


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
@pytest.mark.parametrize(("flags", "words"), [(["--speculative", "medusa"], ["not a known method", "ngram"]),
                                              (["--speculative", "ngram", "--spec-tokens", "0"], ["--spec-tokens", "out of range"]),
                                              (["--speculative", "ngram", "--spec-tokens", "17"], ["--spec-tokens", "out of range"])])
def test_bad_speculative_flags_are_one_line(tiny_bundle, command, flags, words):
    extra = {"serve": [str(tiny_bundle)], "generate": [str(tiny_bundle), "--prompt", "hi"],
             "bench": ["--bundle", str(tiny_bundle)]}[command]
    assert_one_line_error(run_cli(command, *extra, *flags), *words)


def test_generate_with_ngram_prints_the_plain_text(tiny_bundle):
    args = ["generate", str(tiny_bundle), "--prompt", "abcabcabcabc", "--max-tokens", "24", "--backend",
            "onnxruntime", "--threads", "1"]
    plain = run_cli(*args)
    spec = run_cli(*args, "--speculative", "ngram", "--spec-tokens", "3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "tokens per step" in spec.stderr


def test_server_speculative_false_and_metrics(tiny_bundle):
    body = {"prompt": "abcdabcdabcdabcdabcd", "max_tokens": 24, "temperature": 0}
    with running_server(tiny_bundle, num_slots=2, threads=1,
                        speculative=SpeculativeConfig(SpecMethod.NGRAM, 4)) as srv:
        off = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": False}, timeout=60).json()
        m0 = httpx.get(srv.url + "/metrics").text
        on = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        m1 = httpx.get(srv.url + "/metrics").text
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": "yes"}, timeout=60)
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    drafted = "lineside_spec_decode_num_draft_tokens_total"
    accepted = "lineside_spec_decode_num_accepted_tokens_total"
    assert metric(m0, drafted) == 0  # the request that said no did not speculate
    assert metric(m1, drafted) > 0 and 0 <= metric(m1, accepted) <= metric(m1, drafted)
    assert metric(m1, "lineside_spec_decode_acceptance_rate_count") > 0
    assert metric(m1, "lineside_spec_decode_acceptance_rate_bucket", 'le="+Inf"') == \
        metric(m1, "lineside_spec_decode_acceptance_rate_count")
    assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]


@pytest.mark.parametrize(("command", "method", "words"), [
    *((c, "layerskip:3", ["no 3-layer draft graph", "--draft-layers 3"]) for c in ("serve", "generate", "bench")),
    ("generate", "mtp", ["no MTP module"])])
def test_model_proposers_missing_from_the_bundle_are_one_line(tiny_bundle, command, method, words):
    extra = {"serve": [str(tiny_bundle)], "generate": [str(tiny_bundle), "--prompt", "hi"],
             "bench": ["--bundle", str(tiny_bundle)]}[command]
    assert_one_line_error(run_cli(command, *extra, "--speculative", method), *words)


def test_draft_bundle_path_and_build_draft_layers_are_one_line(tiny_bundle, tiny_dense, tmp_path):
    assert_one_line_error(run_cli("generate", str(tiny_bundle), "--prompt", "hi", "--speculative",
                                  f"draft:{tmp_path}"), "not a bundle directory")
    ckpt = tiny_dense("llama-gqa")
    assert_one_line_error(run_cli("build", str(ckpt), "-o", str(tmp_path / "a"), "--draft-layers", "x"),
                          "--draft-layers", "layer counts")
    assert_one_line_error(run_cli("build", str(ckpt), "-o", str(tmp_path / "c"), "--draft-layers", "1,²"),
                          "--draft-layers", "layer counts")  # str.isdigit takes "²"; int() does not
    assert_one_line_error(run_cli("build", str(ckpt), "-o", str(tmp_path / "b"), "--draft-layers", "2"),
                          "--draft-layers 2", "1 to 1")


def test_responses_endpoint_honours_speculative_false(tiny_bundle):
    """/v1/responses ignores fields it does not know: "speculative": false was dropped there, and the request
    speculated although the server's help and the README say a request's false turns it off."""
    body = {"input": "abcdabcdabcdabcdabcd", "max_output_tokens": 24, "temperature": 0, "store": False}
    drafted = "lineside_spec_decode_num_draft_tokens_total"
    with running_server(tiny_bundle, num_slots=2, threads=1,
                        speculative=SpeculativeConfig(SpecMethod.NGRAM, 4)) as srv:
        off = httpx.post(srv.url + "/v1/responses", json={**body, "speculative": False}, timeout=60)
        m0 = httpx.get(srv.url + "/metrics").text
        on = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
        m1 = httpx.get(srv.url + "/metrics").text
        bad = httpx.post(srv.url + "/v1/responses", json={**body, "speculative": "no"}, timeout=60)
    assert off.status_code == on.status_code == 200, off.text
    text = [r.json()["output"][0]["content"][0]["text"] for r in (off, on)]
    assert text[0] == text[1] and text[0]
    assert metric(m0, drafted) == 0  # the request that said no did not speculate
    assert metric(m1, drafted) > 0
    assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]
