"""The engine's health when its backend fails: one bad request leaves it serving, a backend that fails step
after step (or declares itself lost) fails it, and every request then ends or is refused at once. Steps are
counted on a fake backend; nothing waits on time."""

from __future__ import annotations

import asyncio

import pytest

from lineside.errors import LinesideError
from lineside.runtime.engine import LLMEngine
from lineside.runtime.engine_health import BackendLost, EngineFailed, Judgement, StepHealth, StepVerdict
from lineside.runtime.request import EngineDraining, GenerationRequest
from tests.runtime.conftest import run
from tests.runtime.fakes import FakeBackend

GOOD = [1, 5, 6, 7]
BAD = [1, 250, 3]  # the fake backend's poison token: forward raises on it


def engine(bundle, slots=1, **kw) -> tuple[LLMEngine, FakeBackend]:
    be = FakeBackend(slots)
    be.poison = 250
    return LLMEngine(bundle, backend=be, **kw), be


def req(prompt, n=3) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), max_tokens=n)


def test_transient_failures_leave_the_engine_serving(tiny_bundle):
    """Bad requests one after another, fewer than the limit in a row, each with a good one between: each bad one
    fails alone, a success resets the count, the engine stays ready."""
    async def main():
        eng, _ = engine(tiny_bundle, max_failed_steps=3)
        await eng.start()
        ends = []
        for _ in range(4):
            for prompt in (BAD, BAD, GOOD):
                ends.append((await eng.submit(req(prompt)).result())[2])
        st, ready, failure = eng.stats(), eng.ready, eng.failure
        await eng.stop()
        return ends, st, ready, failure

    ends, st, ready, failure = run(main())
    assert [e.finish_reason for e in ends] == ["error", "error", "length"] * 4
    assert all(not e.engine_failed for e in ends)
    assert ready and failure is None
    assert st.failed_steps_consecutive == 0 and st.failed_steps_total == 8 and not st.engine_failed


def test_one_bad_request_retried_up_to_the_limit_leaves_the_engine_serving(tiny_bundle):
    """An OpenAI client retries a 500 twice: one bad prompt is 3 failed steps in a row on an idle engine. The probe
    forward then works, so the engine keeps serving and the count restarts (it would take 3 more to probe again)."""
    async def main():
        eng, be = engine(tiny_bundle, max_failed_steps=3)
        await eng.start()
        ends = [(await eng.submit(req(BAD)).result())[2] for _ in range(4)]
        good = (await eng.submit(req(GOOD)).result())[2]
        health = eng.health
        await eng.stop()
        return ends, good, health, eng.ready, be.calls

    ends, good, health, ready, calls = run(main())
    assert [e.finish_reason for e in ends] == ["error"] * 4 and good.finish_reason == "length"
    assert health.failure is None and health.probes_passed == 1 and health.failed_total == 4
    # warm-up, 4 failed prefills (their ids are never settled), the probe, the good request's 3 steps, the chunk that
    # settles its answer (planned in the step that finishes it, before its result is delivered)
    assert len(calls) == 2 + 4 + 1 + 3 + 1


def test_persistent_failure_fails_the_engine_and_refuses_new_requests(tiny_bundle):
    """A backend that fails every forward: the first 3 requests end with the step's error (one failed step each),
    the 3rd failure fails the engine, the requests still waiting end at once as refused by a failed engine, and
    a new request is refused (a draining engine's refusal: the server's 503)."""
    async def main():
        eng, be = engine(tiny_bundle, max_failed_steps=3)
        failures: list[str] = []
        eng.on_failure = failures.append
        await eng.start()
        be.broken = RuntimeError("CUDA error: an illegal memory access was encountered\ndetails")
        handles = [eng.submit(req(GOOD, n=2)) for _ in range(5)]
        ends = [(await h.result())[2] for h in handles]
        with pytest.raises(EngineFailed, match="the model engine failed .*retry on another instance") as refused:
            eng.submit(req(GOOD))
        st, ready = eng.stats(), eng.ready
        forwards = len(be.calls)
        await eng.stop()
        return ends, refused.value, st, ready, eng.failure, failures, forwards

    ends, refused, st, ready, failure, failures, forwards = run(main())
    assert isinstance(refused, EngineDraining)
    assert [e.finish_reason for e in ends] == ["error"] * 5
    assert [e.error for e in ends[:3]] == ["model step failed: CUDA error: an illegal memory access was encountered"] * 3
    assert [e.engine_failed for e in ends] == [False] * 3 + [True] * 2
    cause = "model step failed: CUDA error: an illegal memory access was encountered"
    assert failure == f"3 consecutive model steps failed, the last with: {cause}; a probe forward failed too ({cause})"
    assert ends[3].error == f"the model engine failed: {failure}"
    assert failures == [failure] and not ready
    assert st.engine_failed and st.failed_steps_consecutive == 3 and st.failed_steps_total == 3
    assert forwards == 2 + 3 + 1  # the warm-up's two, one per failed step, the probe: nothing ran after the failure


def test_backend_lost_fails_the_engine_at_once(tiny_bundle):
    async def main():
        eng, be = engine(tiny_bundle, max_failed_steps=5)
        await eng.start()
        be.broken = BackendLost("the TensorRT execution context was lost")
        be.pause(lambda batch: True)  # the first step waits until the second request is queued behind it: else
        first = eng.submit(req(GOOD))  # the engine could fail before it arrived and refuse it (EngineFailed)
        await be.until_paused()
        second = eng.submit(req(GOOD))
        be.resume()
        ends = [(await h.result())[2] for h in (first, second)]
        failure = eng.failure
        await eng.stop()
        return ends, failure

    ends, failure = run(main())
    assert failure == "model step failed: the TensorRT execution context was lost"
    assert [(e.finish_reason, e.engine_failed) for e in ends] == [("error", False), ("error", True)]


def test_failures_within_a_busy_step_do_not_count_while_others_succeed(tiny_bundle):
    """Several slots: a bad request's prefill fails beside good requests' forwards in the same steps: the backend
    works, so no step counts as failed however many bad requests come."""
    async def main():
        eng, _ = engine(tiny_bundle, slots=3, max_failed_steps=1)
        await eng.start()
        ends = await asyncio.gather(*(eng.submit(req(p, n=6)).result() for p in (GOOD, BAD, [1, 9, 9], BAD)))
        failure = eng.failure
        await eng.stop()
        return [e[2].finish_reason for e in ends], failure

    reasons, failure = run(main())
    assert failure is None
    assert sorted(reasons) == ["error", "error", "length", "length"]


def test_step_health_counts_resets_and_asks_for_a_probe():
    h = StepHealth(2)
    assert h.record(StepVerdict(failed=1, error="x")) == Judgement.SERVING
    assert h.record(StepVerdict()) == Judgement.SERVING  # a step with no backend call (sampling only) says nothing
    assert h.consecutive == 1
    assert h.record(StepVerdict(ok=1, failed=1, error="y")) == Judgement.SERVING  # the backend worked for someone
    assert h.consecutive == 0
    assert h.record(StepVerdict(failed=1, error="a")) == Judgement.SERVING
    assert h.record(StepVerdict(failed=2, error="b")) == Judgement.PROBE
    assert h.judge_probe(None) == Judgement.SERVING and h.consecutive == 0 and h.failure is None
    h.record(StepVerdict(failed=1, error="c"))
    assert h.record(StepVerdict(failed=1, error="d")) == Judgement.PROBE
    assert h.judge_probe("p") == Judgement.FAILED
    assert h.failure == "2 consecutive model steps failed, the last with: d; a probe forward failed too (p)"
    assert h.record(StepVerdict(failed=1, error="e", fatal=True)) == Judgement.SERVING  # reported once
    assert StepHealth(9).record(StepVerdict(ok=1, failed=1, error="lost", fatal=True)) == Judgement.FAILED


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_max_failed_steps_must_be_a_positive_integer(tiny_bundle, bad):
    with pytest.raises(LinesideError, match="max_failed_steps must be an integer >= 1"):
        LLMEngine(tiny_bundle, backend=FakeBackend(1), max_failed_steps=bad)
