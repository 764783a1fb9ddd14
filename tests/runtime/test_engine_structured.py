"""Constrained decoding and logprobs through the serving engine (tiny random Llama, batched): constrained rows
parse whatever the model, the grammar ends them, unconstrained rows in the same steps are unchanged, and
event logprobs match a direct log-softmax of the model's logits."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest

from lineside.runtime.request import FinishReason, GenerationRequest
from lineside.runtime.sampling import SamplingParams, log_softmax
from lineside.runtime.structured import Constraint, ConstraintError
from tests.runtime.conftest import run

SCHEMA = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["code", "n", "ok"]}


def _engine(bundle, **kw):
    from lineside.runtime.engine import LLMEngine

    return LLMEngine(bundle, backend="onnxruntime", threads=1, num_slots=4, **kw)


async def _collect(eng, reqs):
    await eng.start()
    try:
        handles = [eng.submit(r) for r in reqs]
        return await asyncio.gather(*(h.result() for h in handles))
    finally:
        await eng.stop()


def test_constrained_rows_parse_and_free_rows_are_unchanged(tiny_bundle):
    eng = _engine(tiny_bundle)
    ids = eng.tokenizer.encode("the line stopped at")
    free = GenerationRequest(prompt_ids=ids, max_tokens=20)
    hot = SamplingParams(temperature=1.0, seed=7)
    reqs = [GenerationRequest(prompt_ids=ids, max_tokens=120, constraint=Constraint.json_schema(SCHEMA), sampling=hot),
            GenerationRequest(prompt_ids=ids, max_tokens=40, constraint=Constraint.regex(r"[a-c]{3}-[0-9]{2}")),
            GenerationRequest(prompt_ids=ids, max_tokens=10, constraint=Constraint.choice(["left", "right"]),
                              sampling=hot),
            free]
    (schema_out, regex_out, choice_out, free_out) = run(_collect(eng, reqs))
    obj = json.loads(schema_out[0])
    assert set(obj) == {"code", "n", "ok"} and re.fullmatch(r"[A-Z]{2}[0-9]", obj["code"]) and 0 <= obj["n"] <= 99
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", regex_out[0]) and choice_out[0] in ("left", "right")
    for _text, _ids, last in (schema_out, regex_out, choice_out):
        assert last.finish_reason == FinishReason.STOP  # the grammar ended them, not max_tokens
    alone = run(_collect(_engine(tiny_bundle), [GenerationRequest(prompt_ids=ids, max_tokens=20)]))[0]
    assert free_out[1] == alone[1]  # batching with constrained rows did not touch the free row


def test_event_logprobs_equal_log_softmax_of_the_logits(tiny_bundle):
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import compute_logits
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    eng = _engine(tiny_bundle)
    ids = eng.tokenizer.encode("hello there")

    async def go():
        await eng.start()
        try:
            h = eng.submit(GenerationRequest(prompt_ids=ids, max_tokens=8, logprobs=3, ignore_eos=True))
            return [ev async for ev in h]
        finally:
            await eng.stop()

    events = run(go())
    toks = [t for ev in events for t in ev.token_ids]
    lps = [lp for ev in events for lp in ev.logprobs]
    assert [lp.token for lp in lps] == toks and len(toks) == 8
    logits = compute_logits(OnnxRuntimeBackend(open_bundle(tiny_bundle), num_slots=1, threads=1), ids + toks,
                            mode="decode")
    for i, lp in enumerate(lps):
        ref = log_softmax(logits[len(ids) - 1 + i])
        assert lp.logprob == pytest.approx(ref[lp.token], abs=1e-4)
        assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:3])
        assert lp.top[0][0] == lp.token  # greedy: the chosen token is the most likely one


def test_submit_refuses_a_constraint_that_cannot_match(tiny_bundle):
    eng = _engine(tiny_bundle)
    with pytest.raises(ConstraintError) as e:
        eng.submit(GenerationRequest(prompt_ids=[5, 6], constraint=Constraint.regex("[a&&b]", param="guided_regex")))
    assert e.value.param == "guided_regex"
    with pytest.raises(Exception, match="logprobs"):
        eng.submit(GenerationRequest(prompt_ids=[5, 6], logprobs=21))
    eng.close()


# 2,500 alternatives behind 12 free bytes: past the engine's 2,000 items per parser row, met only once generating
# (the compile walks 8 one-byte tokens; repetitions this large are refused at validation)
LATE_LIMIT = 'start: /[bc]{12}/ (' + " | ".join(f'"o{i}"' for i in range(2500)) + ')\n'


def test_a_grammar_past_llguidance_limits_mid_generation_is_the_clients_error(tiny_bundle):
    """The grammar compiles, then llguidance gives up 12 bytes in ("Current row has 2501 items; max is 2000"): that
    request ends as the client's error, one line naming its field, and the unconstrained request in the same
    batch runs to its length."""
    eng = _engine(tiny_bundle)
    ids = eng.tokenizer.encode("go")
    bad, free = run(_collect(eng, [
        GenerationRequest(prompt_ids=ids, max_tokens=20, constraint=Constraint.grammar(LATE_LIMIT)),
        GenerationRequest(prompt_ids=ids, max_tokens=24, sampling=SamplingParams(temperature=0.0), ignore_eos=True)]))
    last = bad[2]
    assert last.finish_reason == FinishReason.ERROR and last.client_error, last
    assert last.error.startswith("guided_grammar: this grammar is past the grammar engine's limits once generating "
                                 "(Parser Error: Current row has 2501 items; max is 2000"), last.error
    assert "\n" not in last.error
    assert free[2].finish_reason == FinishReason.LENGTH and free[2].completion_tokens == 24 and not free[2].client_error
