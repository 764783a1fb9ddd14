"""Prompt logprobs (completions' echo): each prompt token's logprob from the logits at the position before it, checked
against transformers; and scoring a prompt changes neither its own completion nor another request's (prefix cache,
chunking, the int8 prefill graph)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from lineside.bundle import open_bundle
from lineside.errors import LinesideError
from lineside.runtime import step_plan
from lineside.runtime.backend import StepBatch
from lineside.runtime.engine import LLMEngine
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.request import FinishReason, GenerationRequest, TokenEvent
from lineside.runtime.sampling import log_softmax
from tests.host_cpu import needs_exact_int8
from tests.runtime.conftest import run

IDS = [1, *np.random.default_rng(7).integers(3, 259, 40).tolist()]


def reference_logprobs(ckpt, ids: list[int]) -> np.ndarray:
    """log_softmax of transformers' float32 logits: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


async def events(eng: LLMEngine, req: GenerationRequest) -> list[TokenEvent]:
    return [ev async for ev in eng.submit(req)]


def serve(bundle, reqs: list[GenerationRequest], **kw) -> list[list[TokenEvent]]:
    """Each request's events, in order, one engine for them all (each after the one before: the prefix cache holds
    the earlier ones' KV)."""
    async def main():
        eng = LLMEngine(bundle, backend="onnxruntime", threads=2, num_slots=2, **kw)
        await eng.start()
        try:
            return [await events(eng, r) for r in reqs]
        finally:
            await eng.stop()

    return run(main())


def scored(evs: list[TokenEvent]) -> list:
    """The prompt logprobs a request's events carried (exactly one event has them)."""
    carrying = [ev.prompt_logprobs for ev in evs if ev.prompt_logprobs is not None]
    assert len(carrying) == 1
    return carrying[0]


def tokens(evs: list[TokenEvent]) -> list[int]:
    return [t for ev in evs for t in ev.token_ids]


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_equal_transformers_log_softmax(tiny_bundle, tiny_dense, chunk, monkeypatch):
    """fp32 bundle: within 1e-4 of transformers, token for token, also when the prompt is scored in chunks of a few
    tokens (the bound on logits per step; chunk 7 of a 300-token vocabulary) and its alternatives are the top ones."""
    monkeypatch.setattr(step_plan, "PROMPT_LOGIT_FLOATS", 300 * chunk)
    ref = reference_logprobs(tiny_dense("llama-gqa"), IDS)
    [evs] = serve(tiny_bundle, [GenerationRequest(IDS, max_tokens=0, prompt_logprobs=3)])
    lps = scored(evs)
    assert [lp.token for lp in lps] == IDS[1:]
    np.testing.assert_allclose([lp.logprob for lp in lps], [ref[p - 1, t] for p, t in enumerate(IDS) if p],
                               atol=1e-4)
    for p, lp in enumerate(lps):
        best = np.argsort(-ref[p], kind="stable")[:3]
        assert [i for i, _ in lp.top] == best.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], ref[p, best], atol=1e-4)
    # max_tokens 0: the prompt is the answer, one final event, nothing generated
    assert len(evs) == 1 and evs[0].finish_reason == FinishReason.LENGTH
    assert (evs[0].prompt_tokens, evs[0].completion_tokens, evs[0].token_ids) == (len(IDS), 0, [])


def test_prompt_logprobs_come_once_on_the_first_event_and_the_answer_is_unchanged(tiny_bundle):
    plain, scoring = serve(tiny_bundle, [GenerationRequest(IDS, max_tokens=6),
                                         GenerationRequest(IDS, max_tokens=6, prompt_logprobs=0)])
    assert tokens(scoring) == tokens(plain)
    assert scoring[0].prompt_logprobs is not None and len(scoring[0].prompt_logprobs) == len(IDS) - 1
    assert all(lp.top == () for lp in scoring[0].prompt_logprobs)
    assert all(ev.prompt_logprobs is None for ev in plain)


def test_a_one_token_prompt_has_no_prompt_logprobs_to_give(tiny_bundle):
    [evs] = serve(tiny_bundle, [GenerationRequest([1], max_tokens=0, prompt_logprobs=1)])
    assert scored(evs) == [] and evs[-1].finish_reason == FinishReason.LENGTH


@needs_exact_int8
def test_on_a_w4a16_bundle_scoring_changes_no_answer_its_own_or_anothers(tiny_bundles, tiny_dense, monkeypatch):
    """The prompt of a scoring request runs on the int8 prefill graph as every prompt does, so the KV it leaves in
    the prefix cache is the one any prompt writes: the greedy answer that reuses it, and its own completion, are those
    of a fresh engine. Scored after a request that cached the prompt, every position is still scored. The logprobs
    track transformers within the w4a16 tolerance the graph tests use (3% of the logits' range)."""
    monkeypatch.setattr(step_plan, "PROMPT_LOGIT_FLOATS", 300 * 9)  # cut otherwise than the plain prompt's chunks
    bundle = tiny_bundles(quant="w4a16", group_size=32, max_seq_len=64)
    longer = [*IDS, 77, 78, 79]
    [alone] = serve(bundle, [GenerationRequest(longer, max_tokens=8)], kv_block_size=4)
    [own] = serve(bundle, [GenerationRequest(IDS, max_tokens=8)], kv_block_size=4)
    first, after, again = serve(bundle, [GenerationRequest(IDS, max_tokens=8, prompt_logprobs=2),
                                         GenerationRequest(longer, max_tokens=8),
                                         GenerationRequest(IDS, max_tokens=0, prompt_logprobs=2)], kv_block_size=4)
    assert tokens(first) == tokens(own)
    assert tokens(after) == tokens(alone)
    assert after[-1].prompt_tokens == len(longer)
    assert [lp.logprob for lp in scored(again)] == [lp.logprob for lp in scored(first)]
    # the prefill graph's numbers (the KV every prompt gets), not the 4-bit graph's
    be = OnnxRuntimeBackend(open_bundle(bundle), num_slots=1, threads=2)
    assert be.prefill_session is not None
    int8 = be._run(StepBatch.single(0, IDS, 0, all_logits=True), session=be.prefill_session)[0][0]
    be.reset_slot(0)
    four = be._run(StepBatch.single(0, IDS, 0, all_logits=True))[0][0]
    got = np.array([lp.logprob for lp in scored(first)])
    on = np.array([log_softmax(int8[p - 1])[t] for p, t in enumerate(IDS) if p])
    off = np.array([log_softmax(four[p - 1])[t] for p, t in enumerate(IDS) if p])
    np.testing.assert_allclose(got, on, atol=1e-5)
    assert np.abs(got - off).max() > 1e-3
    ref = reference_logprobs(tiny_dense("llama-gqa"), IDS)
    want = np.array([ref[p - 1, t] for p, t in enumerate(IDS) if p])
    assert np.abs(got - want).max() < 0.03 * np.abs(ref).max()


def test_prompt_logprobs_out_of_range_are_refused(tiny_bundle):
    async def main():
        eng = LLMEngine(tiny_bundle, backend="onnxruntime", threads=1, num_slots=1)
        with pytest.raises(LinesideError, match="prompt_logprobs must be 0..20"):
            eng.submit(GenerationRequest(IDS, max_tokens=1, prompt_logprobs=21))
        with pytest.raises(LinesideError, match="max_tokens must be ≥ 0"):
            eng.submit(GenerationRequest(IDS, max_tokens=-1))

    asyncio.run(main())


def test_a_long_scored_prompt_is_cut_into_chunks_of_bounded_logits():
    assert step_plan.prompt_logit_rows(49152) * 49152 <= step_plan.PROMPT_LOGIT_FLOATS
    assert step_plan.prompt_logit_rows(151936) == 110
    assert step_plan.prompt_logit_rows(10**9) == 2  # never a 1-token chunk


def test_a_scoring_request_preempted_mid_prompt_scores_it_as_an_unpreempted_one(tiny_bundle):
    """The engine's step (schedule, run_step on the real backend, postprocess) driven by hand, so the preemption
    lands mid-prompt for sure: a batch request scoring its prompt in chunks of 6 has scored part of it when a
    realtime request needs its KV blocks; re-admitted, it scores the prompt from the start (none of its first,
    partial scores is kept or repeated) and gets the prompt logprobs and answer of an engine that never preempts it."""
    from lineside.runtime.kv_manager import KVCacheArena
    from lineside.runtime.request import RequestHandle
    from lineside.runtime.scheduler import Scheduler
    from lineside.runtime.sequence import Sequence
    from lineside.runtime.sequence import SequenceStatus as Status
    from lineside.runtime.step_runner import run_step
    from lineside.runtime.tokenizer import Tokenizer

    [want] = serve(tiny_bundle, [GenerationRequest(IDS, max_tokens=3, prompt_logprobs=2)], prefill_chunk=6,
                   kv_block_size=4)
    bundle = open_bundle(tiny_bundle)
    be = OnnxRuntimeBackend(bundle, num_slots=2, threads=1)
    tok = Tokenizer.from_bundle(bundle)
    eos = set(tok.eos_token_ids) | set(bundle.config.eos_token_ids)
    # 12 blocks of 4: the job's 44 positions (11 blocks) and the realtime request's 12 (3) do not fit together
    sch = Scheduler(KVCacheArena(2, be.max_seq_len, 4, num_blocks=12, prefix_cache=False), prefill_chunk=6)

    def admit(req: GenerationRequest, now: float) -> Sequence:
        handle = RequestHandle(req)
        handle.metrics.arrival = now
        seq = Sequence(handle, tok, eos, be.max_seq_len)
        seq.prompt_rows = step_plan.prompt_logit_rows(be.vocab_size)
        sch.add(seq)
        return seq

    evs: dict[Sequence, list[TokenEvent]] = {}

    def step(now: float) -> None:
        plan = sch.schedule(now=now)
        out = run_step(be, plan)
        for seq, ev in sch.postprocess(plan, out.sampled, out.errors, now=now, logprobs=out.logprobs,
                                       prompt_logprobs=out.prompt_logprobs):
            evs.setdefault(seq, []).append(ev)

    job = admit(GenerationRequest(IDS, max_tokens=3, prompt_logprobs=2, mode="batch"), 0.0)
    step(0.0)
    step(0.1)
    assert job.status == Status.PREFILL and 0 < len(job.prompt_logprobs) < len(IDS) - 1  # scored in part
    rt = admit(GenerationRequest([1, 5, 6, 7, 8, 9, 10, 11], max_tokens=4, priority="low"), 1.0)
    step(1.0)
    assert job.status == Status.WAITING and sch.preemptions == 1 and rt.slot is not None
    for t in range(2, 40):
        if job.status == Status.FINISHED and rt.status == Status.FINISHED:
            break
        step(float(t))
    assert job.status == Status.FINISHED and job.handle.metrics.preemptions == 1
    assert scored(evs[job]) == scored(want)
    assert tokens(evs[job]) == tokens(want)
