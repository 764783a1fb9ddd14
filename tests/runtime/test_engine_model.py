"""The engine on real graphs: batching, chunking and prefix reuse must not change greedy results."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.runtime.backend import StepBatch
from lineside.runtime.engine import LLMEngine
from lineside.runtime.generate import Generator
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.request import GenerationRequest
from lineside.runtime.sampling import Sampler, SamplingParams
from tests.runtime.conftest import run


def sequential(bundle, prompts: list[list[int]], n: int, params: list | None = None) -> list[list[int]]:
    g = Generator(bundle, threads=2)
    return [list(g.stream(p, n, params[i] if params else None, stop_at_eos=True)) for i, p in enumerate(prompts)]


class RecordingSampler(Sampler):
    """Keeps every logits row it samples from, per SamplingParams object (one per request)."""

    seen: dict[int, list[np.ndarray]] = {}

    def step(self, logits, history=None, prompt_len=0, **kw):  # what the engine and Generator call
        self.seen.setdefault(id(self.p), []).append(np.array(logits, copy=True))
        return super().step(logits, history, prompt_len, **kw)


async def concurrent(bundle, prompts: list[list[int]], n: int, **kw) -> tuple[list[list[int]], object]:
    eng = LLMEngine(bundle, backend="onnxruntime", threads=2, **kw)
    await eng.start()
    outs = await asyncio.gather(*(eng.submit(GenerationRequest(p, max_tokens=n)).result() for p in prompts))
    st = eng.stats()
    await eng.stop()
    return [o[1] for o in outs], st


def test_tiny_concurrent_greedy_equals_sequential(tiny_bundle):
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 259, 20).tolist()
    prompts = [[1, *shared, *rng.integers(3, 259, k).tolist()] for k in (1, 5, 17, 30)]
    prompts += [[1, *rng.integers(3, 259, 9).tolist()]]
    want = sequential(tiny_bundle, prompts, 12)
    got, st = run(concurrent(tiny_bundle, prompts, 12, num_slots=3, prefill_chunk=8, kv_block_size=4))
    assert got == want
    assert st.prefix_cache_hits >= 3  # the shared 21-token start was computed once


def test_prefix_copy_gives_same_logits(tiny_bundle):
    be = OnnxRuntimeBackend(open_bundle(tiny_bundle), num_slots=2, threads=2)
    ids = np.random.default_rng(1).integers(3, 259, 40).tolist()
    full = be.forward(StepBatch.single(0, ids, 0, all_logits=True))[0]
    be.copy_slot(0, 1, 32)
    be.forward(StepBatch.single(0, [5] * 8, 32))  # overwrite the source's tail: slot 1 must not care
    tail = be.forward(StepBatch.single(1, ids[32:], 32, all_logits=True))[0]
    np.testing.assert_allclose(tail, full[32:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_seq_len", [2, 3, 4])
def test_a_bundle_with_a_tiny_context_warms_up_and_serves(tiny_bundles, max_seq_len):
    """The warm-up ran a 4-token prompt and a decode step after it (5 positions): an engine over a bundle built with
    --max-seq-len 2-4 (which the builder allows) failed to start ("sequence of 5 tokens exceeds ..."), so `lineside
    serve` exited. The warm-up stays within the context, and the int8 prefill graph still gets its run."""
    bundle = tiny_bundles(quant="w4a16", group_size=32, max_seq_len=max_seq_len)
    prompt = [1, 17][:max_seq_len - 1]
    want = sequential(bundle, [prompt], 1)

    async def main():
        eng = LLMEngine(bundle, backend="onnxruntime", threads=2, num_slots=1)
        await eng.start()
        out = await eng.submit(GenerationRequest(prompt, max_tokens=1)).result()
        await eng.stop()
        return out[1]

    assert run(main()) == want[0] and len(want[0]) == 1


@pytest.mark.slow
def test_smollm2_concurrent_greedy_equals_sequential(smol_bundle, monkeypatch):
    """Batching, chunked prefill, a shared system prompt from the prefix cache and a preempted (then
    resumed) batch job: every request still gets exactly the tokens — and the very logits — it gets alone."""
    from lineside.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_bundle(open_bundle(smol_bundle))
    system = "You are a maintenance assistant on a factory floor. Answer in one short sentence."
    questions = ["What is the capital of France?", "Write a haiku about rivers.", "List three prime numbers.",
                 "Why do bearings overheat?"]
    prompts = [tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    monkeypatch.setattr("lineside.runtime.generate.Sampler", RecordingSampler)
    monkeypatch.setattr("lineside.runtime.sequence.Sampler", RecordingSampler)
    ref_params = [SamplingParams() for _ in prompts]
    eng_params = [SamplingParams() for _ in prompts]
    want = sequential(smol_bundle, prompts, 14, ref_params)

    async def main():
        eng = LLMEngine(smol_bundle, backend="onnxruntime", threads=2, num_slots=2, prefill_chunk=16,
                        kv_block_size=8)
        await eng.start()
        job = eng.submit(GenerationRequest(prompts[0], max_tokens=14, mode="batch", sampling=eng_params[0]))
        while len(job.metrics.token_times) < 3:
            await asyncio.sleep(0.01)
        hs = [eng.submit(GenerationRequest(p, max_tokens=14, sampling=eng_params[i + 1]))
              for i, p in enumerate(prompts[1:])]
        outs = await asyncio.gather(job.result(), *(h.result() for h in hs))
        st = eng.stats()
        await eng.stop()
        return [o[1] for o in outs], st, job.metrics

    got, st, mjob = run(main())
    assert got == want
    assert st.prefix_cache_hits >= 3 and st.preemptions >= 1 and mjob.preemptions >= 1
    for a, b in zip(ref_params, eng_params, strict=True):
        ref, mine = RecordingSampler.seen[id(a)], RecordingSampler.seen[id(b)]
        assert len(ref) == len(mine) and all(np.array_equal(x, y) for x, y in zip(ref, mine, strict=True))


@pytest.mark.slow
def test_smollm2_chinese_and_emoji_stream_clean(smol_bundle):
    async def main():
        eng = LLMEngine(smol_bundle, backend="onnxruntime", threads=2, num_slots=2)
        await eng.start()
        tok = eng.tokenizer
        hs = [eng.submit(GenerationRequest(tok.encode_chat([{"role": "user", "content": q}]), max_tokens=24))
              for q in ("请用中文介绍一下北京。", "Reply only with emoji: 🎉🚀😀")]
        evs = []
        for h in hs:
            evs.append([ev async for ev in h])
        await eng.stop()
        return tok, evs

    tok, evs = run(main())
    for stream in evs:
        assert all("\ufffd" not in e.text for e in stream)
        ids = [t for e in stream for t in e.token_ids]
        assert "".join(e.text for e in stream) == tok.decode(ids).rstrip("\ufffd")
    assert any(ord(c) > 0x2000 for e in evs[0] + evs[1] for c in e.text)  # non-ASCII text did come out
