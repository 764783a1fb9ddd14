"""Speculative verification on the TensorRT backend (CPU, strict fake): a step of k+1 tokens per row, then
the next step starting past the kept drafts only (the arena's append overwrites the rejected positions), and
the serving engine with drafts giving the plain tokens."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lineside.runtime.backend import StepBatch
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from tests.runtime.fakes import ReferenceProposer
from tests.runtime.tensorrt import fake_trt
from tests.runtime.tensorrt.test_tensorrt_backend_cpu import IDS, rel


@pytest.fixture
def engine_bundle(trt_bundle, monkeypatch, tmp_path):
    """The tiny fp16 trt bundle with an engine built on the fake TensorRT (as test_tensorrt_backend_cpu's)."""
    import shutil

    from lineside.build.tensorrt.builder import BuildOptions, build_engine
    from lineside.bundle import open_bundle

    dst = tmp_path / "bundle"
    shutil.copytree(trt_bundle("fp16").path, dst)
    dev = fake_trt.install(monkeypatch)
    build_engine(dst, BuildOptions(num_slots=4, max_prefill=16, first_bucket=8, bucket_step=16))
    return open_bundle(dst), dev


def test_verify_step_then_overwrite_rejected_positions(engine_bundle):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = engine_bundle
    a, c = IDS[:9], IDS[20:25]
    ref = OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0)
    want_a = compute_logits(ref, a + [5, 6, 30, 31], "prefill")[len(a):]  # kept 5, 6; then 30, 31
    want_c = compute_logits(ref, c + [7, 40], "prefill")[len(c):]
    be = TensorRTBackend(b, num_slots=4)
    be.forward(StepBatch.single(0, a, 0))
    be.forward(StepBatch.single(1, c, 0))
    # row 0 verifies [5, 6, 90, 91] (keeps 5, 6), row 1 decodes one token: one mixed step
    ids = np.array([[5, 6, 90, 91], [7, 0, 0, 0]])
    new = np.array([4, 1])
    out = be.forward(StepBatch(slots=[0, 1], input_ids=ids, past_lengths=np.array([len(a), len(c)]), new_lengths=new,
                               logits_positions=np.minimum(np.arange(4)[None, :], (new - 1)[:, None])))
    assert rel(out[0, :2], want_a[:2]) < 1e-4 and rel(out[1, :1], want_c[:1]) < 1e-4
    nxt = be.forward(StepBatch(slots=[0, 1], input_ids=np.array([[30, 31], [40, 0]]),
                               past_lengths=np.array([len(a) + 2, len(c) + 1]), new_lengths=np.array([2, 1]),
                               logits_positions=np.array([[0, 1], [0, 0]])))
    assert rel(nxt[0], want_a[2:]) < 1e-4 and rel(nxt[1, :1], want_c[1:]) < 1e-4
    be.close()


def test_serving_engine_with_drafts_equals_plain_on_tensorrt(engine_bundle):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest
    from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = engine_bundle
    prompts = [IDS[:5], IDS[:9] + [40], IDS[10:13]]

    async def serve(spec, proposer=None):
        eng = LLMEngine(b, backend=TensorRTBackend(b, num_slots=3), num_slots=3, kv_block_size=4, speculative=spec)
        if proposer is not None:
            eng.scheduler.proposer = proposer
        await eng.start()
        outs = await asyncio.gather(*(eng.submit(GenerationRequest(p, max_tokens=10)).result() for p in prompts))
        st = eng.stats()
        await eng.stop()
        return [o[1] for o in outs], st

    plain, _ = asyncio.run(asyncio.wait_for(serve(None), timeout=60))
    refs = {tuple(p): w for p, w in zip(prompts, plain, strict=True)}
    got, st = asyncio.run(asyncio.wait_for(serve(SpeculativeConfig(SpecMethod.NGRAM, 3), ReferenceProposer(refs, 3)),
                                           timeout=60))
    assert got == plain
    assert 0 < st.spec_accepted_tokens_total < st.spec_draft_tokens_total
    # a draft model on onnxruntime proposing for the TensorRT target (its rows sit in any slots)
    draft = SpeculativeConfig(SpecMethod.DRAFT, 3, draft_bundle=b.path, draft_cost=0.0)
    got, st = asyncio.run(asyncio.wait_for(serve(draft), timeout=60))
    assert got == plain and st.spec_draft_tokens_total > 0


def test_verification_steps_are_captured_per_batch_bucket_and_width(engine_bundle):
    """k+1-token verification steps run on the decode profile (its width reaches 1 + 16 drafts) from a CUDA
    Graph per (batch bucket, tokens per row, logits per row, length bucket): the first is captured, the next of
    the same shape replays it, and both give onnxruntime's logits."""
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = engine_bundle
    a, c = IDS[:9], IDS[20:25]
    ref = OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0)
    first_a = compute_logits(ref, a + [5, 6, 90, 91], "prefill")[len(a):]
    second_a = compute_logits(ref, a + [5, 6, 30, 31, 94, 95], "prefill")[len(a) + 2:]
    want_c = compute_logits(ref, c + [7, 40], "prefill")[len(c):]
    be = TensorRTBackend(b, num_slots=4)
    assert be.max_verify == 16  # 1 + 16 drafts, capped by the engine's --max-prefill 16
    be.forward(StepBatch.single(0, a, 0))
    be.forward(StepBatch.single(1, c, 0))
    launched = dev.launched_graphs

    def verify_step(row0, past0, tok1, past1):
        new = np.array([4, 1])
        return be.forward(StepBatch(slots=[0, 1], input_ids=np.array([row0, [tok1, 0, 0, 0]]),
                                    past_lengths=np.array([past0, past1]), new_lengths=new,
                                    logits_positions=np.minimum(np.arange(4)[None, :], (new - 1)[:, None])))

    before = dict(be.stats)
    out1 = verify_step([5, 6, 90, 91], len(a), 7, len(c))  # keeps 5, 6
    assert be.stats["captured"] == before["captured"] + 1 and be.stats["eager"] == before["eager"]
    out2 = verify_step([30, 31, 94, 95], len(a) + 2, 40, len(c) + 1)
    assert be.stats["replay"] == before["replay"] + 1 and dev.launched_graphs == launched + 1
    key = next(k for k in be.graphs.graphs if k[1] == 4)
    assert key[:3] == (2, 4, 4)
    assert rel(out1[0], first_a) < 1e-4 and rel(out1[1, :1], want_c[:1]) < 1e-4
    assert rel(out2[0], second_a) < 1e-4 and rel(out2[1, :1], want_c[1:]) < 1e-4
    be.close()
