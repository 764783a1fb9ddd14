"""The engine serving a DeepSeek-V4 bundle (whole-state tensors: compressor state and window, mode replace) as a
user sees it: concurrent greedy requests of different lengths (chunked prefills, rows at different positions in
one decode batch, compression windows crossed mid-decode, slots reused and compacted) each give the tokens they
give alone, and those are transformers' greedy tokens; a preempted and resumed request, and a request in the slot
a cancelled one left mid-window, give theirs too; the prefix cache never hands out a whole-state slot."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lineside.runtime.request import GenerationRequest, Mode, Priority
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig

MTP = SpeculativeConfig(SpecMethod.MTP, 3, draft_cost=0.0)  # drafts in every step the rows allow
N = 14  # > the largest compression rate (8): every row crosses a window boundary while decoding


@pytest.fixture(scope="module")
def bundle(v4, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle

    return build_bundle(v4.hf_dir("a"), tmp_path_factory.mktemp("v4eng") / "v4",
                        BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=64))


async def cancel_after(handle, tokens: int) -> None:
    """Read a request's stream and cancel it once ``tokens`` tokens have come."""
    n = 0
    async for ev in handle:
        n += len(ev.token_ids)
        if n >= tokens:
            handle.cancel()


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[1, *rng.integers(3, 120, n).tolist()] for n in (2, 10, 21, 6, 29)]


@pytest.fixture(scope="module")
def alone(bundle) -> dict[tuple[int, ...], list[int]]:
    from lineside.runtime.generate import Generator

    g = Generator(bundle, threads=2)
    return {tuple(p): list(g.stream(p, N, stop_at_eos=False)) for p in prompts()}


def engine(bundle, **kw):
    from lineside.runtime.engine import LLMEngine

    return LLMEngine(bundle, backend="onnxruntime", threads=2, **kw)


def req(p, **kw) -> GenerationRequest:
    return GenerationRequest(list(p), max_tokens=kw.pop("max_tokens", N), ignore_eos=True, **kw)


def test_generate_equals_transformers_greedy(v4, alone):
    import torch

    model = v4.model("a")
    for p in prompts()[1:3]:
        ids = list(p)
        with torch.no_grad():
            for _ in range(N):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert alone[tuple(p)] == ids[len(p):]


def test_concurrent_rows_equal_alone(bundle, alone):
    """5 requests on 3 slots, prefill chunk 8: three prompts are chunked, rows decode at different positions."""
    async def main():
        eng = engine(bundle, num_slots=3, prefill_chunk=8)
        await eng.start()
        outs = await asyncio.gather(*(eng.submit(req(p)).result() for p in prompts()))
        st = eng.stats()
        await eng.stop()
        return [o[1] for o in outs], st

    got, st = asyncio.run(main())
    assert got == [alone[tuple(p)] for p in prompts()]
    assert st.prefix_cache_hits == 0


def test_preempted_request_resumes_with_its_tokens(bundle, alone):
    ps = prompts()

    async def main():
        eng = engine(bundle, num_slots=1, prefill_chunk=8)
        await eng.start()
        low = eng.submit(req(ps[2], mode=Mode.BATCH, priority=Priority.LOW))
        head = []
        async for ev in low:
            head += ev.token_ids
            if len(head) >= 5:  # past the first window of 4 positions of its decode
                break
        high = eng.submit(req(ps[1], priority=Priority.HIGH))
        hi = await high.result()
        rest = await low.result()
        st = eng.stats()
        await eng.stop()
        return hi[1], head + rest[1], st

    hi, lo, st = asyncio.run(main())
    assert st.preemptions >= 1
    assert hi == alone[tuple(ps[1])]
    assert lo == alone[tuple(ps[2])]


def test_cancelled_slot_and_repeated_prompt_start_clean(bundle, alone):
    """One slot: a request cancelled mid-decode (its compressor state mid-window), then the next prompt in that
    slot; then the same prompt again (its slot's cached tokens match: still no prefix reuse). (The cpu graph reads
    its whole state by position, so a slot's leftover state is masked at past 0 as well as reset.)"""
    ps = prompts()

    async def main():
        eng = engine(bundle, num_slots=1, prefill_chunk=8)
        await eng.start()
        first = eng.submit(req(ps[4], max_tokens=30))
        await cancel_after(first, 7)
        outs = [(await eng.submit(req(ps[3])).result())[1] for _ in range(2)]
        st = eng.stats()
        await eng.stop()
        return first.finish_reason, outs, st

    reason, outs, st = asyncio.run(main())
    assert reason == "cancelled"
    assert outs == [alone[tuple(ps[3])]] * 2
    assert st.prefix_cache_hits == 0


@pytest.fixture(scope="module")
def mtp_bundle(v4, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle
    from tests.build.deepseek_v4.mtp_reference import with_mtp

    root = tmp_path_factory.mktemp("v4eng-mtp")
    return build_bundle(with_mtp(v4.hf_dir("a"), root / "ckpt"), root / "b",
                        BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=64))


def test_mtp_engine_equals_plain_through_preemption_and_cancel(mtp_bundle, alone):
    """`--speculative mtp` with the backend's own row limit (drafts only while one row decodes): concurrent rows,
    a preempted batch request and a cancelled one give plain greedy's tokens. The MTP runs (its state and the
    target's hidden-stream ring walk every step), but its drafts are swapped for plain decoding's continuation
    with every third token wrong (random MTP weights never agree with the target), so verification steps keep
    all, some and none of their drafts and the target's whole state is rewound mid-window."""
    from lineside.runtime.speculative.config import Draft
    from tests.runtime.fakes import ReferenceProposer

    ps = prompts()
    ref = ReferenceProposer(alone, 3, span=120, shift=5)

    async def main():
        eng = engine(mtp_bundle, num_slots=2, prefill_chunk=8, speculative=MTP)
        mtp = eng._model_proposer
        real = mtp.propose_rows
        mtp.propose_rows = lambda rows: [Draft(ref.propose(r.tokens, len(d.tokens)))
                                         for r, d in zip(rows, real(rows), strict=True)]
        await eng.start()
        first = eng.submit(req(ps[4], max_tokens=30))
        await cancel_after(first, 6)
        low = eng.submit(req(ps[2], mode=Mode.BATCH, priority=Priority.LOW))
        mid = eng.submit(req(ps[0], mode=Mode.BATCH, priority=Priority.LOW))
        head = []
        async for ev in low:
            head += ev.token_ids
            if len(head) >= 5:
                break
        highs = [eng.submit(req(p, priority=Priority.HIGH)) for p in (ps[1], ps[3])]
        outs = [(await h.result())[1] for h in highs]
        outs += [head + (await low.result())[1], (await mid.result())[1]]
        st = eng.stats()
        await eng.stop()
        return outs, st

    outs, st = asyncio.run(main())
    assert outs == [alone[tuple(ps[i])] for i in (1, 3, 2, 0)]
    assert st.preemptions >= 1 and 0 < st.spec_accepted_tokens_total < st.spec_draft_tokens_total


def test_server_n_stop_strings_and_refused_sessions(mtp_bundle, alone):
    """Over HTTP with `--speculative mtp`: n=2 greedy choices are each the plain answer, a stop string cuts it
    where plain text has it, and prefill sessions are refused in one line."""
    import httpx

    from lineside.bundle import open_bundle
    from lineside.runtime.tokenizer import Tokenizer
    from tests.server.conftest import running_server

    p = prompts()[2]
    want = Tokenizer.from_bundle(open_bundle(mtp_bundle)).decode(alone[tuple(p)])
    stop = want[6:8]
    assert stop and "\ufffd" not in stop
    body = {"prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    with running_server(mtp_bundle, num_slots=2, threads=2, speculative=MTP) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/completions", json={**body, "n": 2})
        assert r.status_code == 200, r.text
        assert [ch["text"] for ch in r.json()["choices"]] == [want, want]
        r = c.post("/v1/completions", json={**body, "stop": [stop]})
        ch = r.json()["choices"][0]
        assert (ch["text"], ch["finish_reason"]) == (want[:want.index(stop)], "stop")
        r = c.post("/v1/prefill", json={"prompt": p, "session_id": "s1"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "sessions_unsupported" and "\n" not in err["message"]
