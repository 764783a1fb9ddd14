"""Schemathesis against the server's own OpenAPI schema: valid and invalid requests for every operation,
a bounded number of cases, over real HTTP. No case may get a 5xx; every 4xx under /v1 is OpenAI-shaped."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

CASES_PER_OPERATION = 25  # per generation mode


def test_fuzz_no_server_errors(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    assert httpx.get(server.url + "/openapi.json").status_code == 404  # not served by default
    raw = server.app.openapi()
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=server.url, request_timeout=30)
    seen: dict[str, set[int]] = {}
    failures: list[str] = []

    def fuzz(op, mode) -> None:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            r = case.call(base_url=server.url, timeout=30)
            seen.setdefault(op.label, set()).add(r.status_code)
            if r.status_code >= 500:
                failures.append(f"{op.label} {r.status_code}: {case.body!r} -> {r.text[:300]}")
            elif r.status_code >= 400 and (op.path.startswith("/v1/") or op.path in ("/tokenize", "/detokenize")):
                err = r.json().get("error")
                if not (isinstance(err, dict) and {"message", "type", "code", "param"} <= set(err)):
                    failures.append(f"{op.label} {r.status_code} not OpenAI-shaped: {r.text[:200]}")

        try:
            run()
        except Unsatisfiable:  # no body and only free-text path parameters (GET /health, DELETE /v1/prefill/{id},
            # POST /v1/responses/{id}/cancel): nothing to make invalid
            assert mode == GenerationMode.NEGATIVE and len(op.body) == 0

    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(result.ok(), mode)

    assert not failures, "\n".join(failures[:10])
    posts = [k for k in seen if k.startswith("POST") and not k.endswith("/cancel")]
    # chat, completions, responses, responses/input_tokens, tokenize answer 200; prefill (a session) 202; detokenize's
    # random ids are past the vocabulary (which the schema cannot know), so only its 400s are sure
    assert len(posts) == 7 and all({202 if k.endswith("/prefill") else 200, 400} <= seen[k]
                                   for k in posts if not k.endswith("/detokenize")), seen
    assert 400 in seen["POST /detokenize"], seen
    assert seen["POST /v1/responses/{response_id}/cancel"] == {404}, seen  # no such (random) response id
