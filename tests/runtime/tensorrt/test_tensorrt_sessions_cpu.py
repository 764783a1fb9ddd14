"""Prefill sessions on the TensorRT backend (CPU, strict fake): a session's chunks written into its pinned arena
slot, then lent to the completion that extends it, give the tokens of the prompt sent at once; the backend places
rows itself, so the scheduler moves no session either."""

from __future__ import annotations

import asyncio

import pytest

from tests.runtime.tensorrt import fake_trt
from tests.runtime.tensorrt.test_tensorrt_backend_cpu import IDS


@pytest.fixture(params=["fp16", "int4"])
def engine_bundle(tiny_bundles, monkeypatch, tmp_path, request):
    """The tiny fp16 trt bundle with an engine built on the fake TensorRT (as test_tensorrt_backend_cpu's), with
    the float cache and with the int4 one (packed values + group scales: chunks must land in both)."""
    import shutil

    from lineside.build.tensorrt.builder import BuildOptions, build_engine
    from lineside.bundle import open_bundle

    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundles(quant="fp16", flavors=("trt",), max_seq_len=64, group_size=64, accuracy_level=0,
                                 **({"kv_dtype": request.param} if request.param != "fp16" else {})), dst)
    fake_trt.install(monkeypatch)
    build_engine(dst, BuildOptions(num_slots=4, max_prefill=16, first_bucket=8, bucket_step=16))
    return open_bundle(dst)


def test_session_then_completion_equals_prompt_at_once(engine_bundle):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b = engine_bundle
    prompt = IDS[:50]

    async def serve(progressive: bool):
        be = TensorRTBackend(b, num_slots=3)
        eng = LLMEngine(b, backend=be, num_slots=3, kv_block_size=4, prefill_chunk=16)
        moved = []
        move = eng.arena.move
        eng.arena.move = lambda src, dst: (moved.append((src, dst)), move(src, dst))
        await eng.start()
        other = eng.submit(GenerationRequest(IDS[5:14], max_tokens=12))  # decoding beside the session's chunks
        if progressive:
            for end in (13, 30, 48):
                eng.prefill("trt", prompt[:end], end)
                while eng.session("trt").pending_tokens:
                    await asyncio.sleep(0)
        _, ids, _ = await eng.submit(GenerationRequest(prompt, max_tokens=8, session_id="trt")).result()
        _, other_ids, _ = await other.result()
        st = eng.stats()
        await eng.stop()
        return ids, other_ids, st, moved

    warm, other_warm, st, moved = asyncio.run(asyncio.wait_for(serve(True), timeout=120))
    cold, other_cold, _, _ = asyncio.run(asyncio.wait_for(serve(False), timeout=120))
    assert warm == cold and other_warm == other_cold and len(warm) == 8
    assert st.session_hits == 1 and st.session_tokens_saved == 48 and moved == []
