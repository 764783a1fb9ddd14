"""Speculative decoding on DeepSeek-V4 with the TensorRT backend (CPU, strict fake): a verification step
advances the whole-state tensors (window, compressor state, compressed entries) over every token it feeds, so
the rows that keep fewer are saved before it (device to device, into a save area reserved once) and put back.
The state after a partly rejected step equals plain decoding's (and does not without the restore), and greedy
serving with drafts gives the plain tokens, with one CUDA Graph per step shape."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lineside.graph_io import StateUpdate
from lineside.runtime.backend import StepBatch
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from tests.runtime.fakes import ReferenceProposer
from tests.runtime.tensorrt import fake_trt


@pytest.fixture(scope="module")
def v4_engine(tmp_path_factory):
    """The tiny V4 trt bundle with an engine built on the fake TensorRT, which stays installed for the module."""
    from lineside.build.tensorrt.builder import BuildOptions, build_engine
    from lineside.bundle import open_bundle
    from tests.runtime.tensorrt.bundles import v4_bundle

    p = v4_bundle(tmp_path_factory.mktemp("v4trtspec"), "fp16")
    with pytest.MonkeyPatch.context() as mp:
        dev = fake_trt.install(mp)
        build_engine(p, BuildOptions(num_slots=3, max_prefill=8))
        yield open_bundle(p), dev


def whole_state(be, slot: int) -> dict[str, np.ndarray]:
    """The slot's whole-state rows, read from the arena row it holds now."""
    row = be.layout.phys_of[slot]
    out = {}
    for lay in be.plan.states:
        assert lay.update == StateUpdate.REPLACE
        rb = lay.row_bytes(be.layout.pitch)
        out[lay.state.input] = fake_trt.read(be._addr(lay.state.input) + row * rb, lay.dtype, (lay.inner,))
    return out


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[1, *rng.integers(3, 120, n).tolist()] for n in (9, 5, 13)]


def test_restored_state_equals_plain_decoding(v4_engine):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = v4_engine
    prompt = prompts()[0]
    spec, plain, unrestored = (TensorRTBackend(b, num_slots=3) for _ in range(3))
    assert spec.save_base is None  # nothing reserved until speculation asks
    fed = [7, 8, 9, 10]  # pending + 3 drafts; keep pending + 1 draft
    for be in (spec, plain, unrestored):
        be.forward(StepBatch.single(0, [5, 6, 7], 0))  # slot 0 holds row 0: slot 2 is swapped in and out
        be.forward(StepBatch.single(2, prompt, 0))
    for t, tok in enumerate(fed[:2]):
        plain.forward(StepBatch.single(2, [tok], len(prompt) + t))
    allocs = len(dev.keep)
    for be in (spec, unrestored):
        saved = be.save_rows([0, 2])
        be.forward(StepBatch.single(2, fed, len(prompt), all_logits=True))
        assert any(not np.array_equal(v, plain_v) for v, plain_v in
                   zip(whole_state(be, 2).values(), whole_state(plain, 2).values(), strict=True))
        be.forward(StepBatch.single(0, [8], 3))  # slot 0 takes row 0 back: slot 2 moves again before its restore
        if be is spec:
            be.restore_rows(saved, 2)
        be.forward(StepBatch.single(2, fed[:2], len(prompt)))
    assert len(dev.keep) == allocs + 2  # a save area for each backend that saved
    want = whole_state(plain, 2)
    for name, v in whole_state(spec, 2).items():
        np.testing.assert_allclose(v, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(not np.allclose(v, want[n], rtol=1e-3, atol=1e-4) for n, v in whole_state(unrestored, 2).items())
    nxt = StepBatch.single(2, [11], len(prompt) + 2)
    np.testing.assert_allclose(spec.forward(nxt), plain.forward(nxt), rtol=1e-4, atol=1e-4)
    # a handle is good for one restore window: a slot saved again since refuses the older one in one line
    old = spec.save_rows([2])
    spec.save_rows([2])
    assert len(dev.keep) == allocs + 2  # reserved once: later saves allocate nothing
    with pytest.raises(Exception, match="no current saved state") as e:
        spec.restore_rows(old, 2)
    assert "\n" not in str(e.value)
    for be in (spec, plain, unrestored):
        be.close()


def test_mixed_new_lengths_run_by_length(v4_engine):
    """No attention mask in V4's trt graph: a step whose rows feed different numbers of tokens runs each length
    together and gives each row the logits it gets alone."""
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = v4_engine
    a, c = prompts()[1], prompts()[2]
    be, alone = TensorRTBackend(b, num_slots=3), TensorRTBackend(b, num_slots=3)
    for x in (be, alone):
        x.forward(StepBatch.single(0, a, 0))
        x.forward(StepBatch.single(1, c, 0))
    new = np.array([4, 1])
    out = be.forward(StepBatch(slots=[0, 1], input_ids=np.array([[5, 6, 90, 91], [7, 0, 0, 0]]),
                               past_lengths=np.array([len(a), len(c)]), new_lengths=new,
                               logits_positions=np.minimum(np.arange(4)[None, :], (new - 1)[:, None])))
    want0 = alone.forward(StepBatch.single(0, [5, 6, 90, 91], len(a), all_logits=True))
    want1 = alone.forward(StepBatch.single(1, [7], len(c)))
    np.testing.assert_allclose(out[0], want0[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out[1], np.repeat(want1[0], 4, axis=0), rtol=1e-4, atol=1e-4)
    assert (1, 1, 4, 0) not in be.graphs.graphs  # the 1-token row asked for its one position: the decode graph
    be.close()
    alone.close()


def test_v4_greedy_with_drafts_equals_plain_on_tensorrt(v4_engine):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = v4_engine
    ps, n = prompts(), 12

    async def serve(spec, proposer=None):
        be = TensorRTBackend(b, num_slots=3)
        eng = LLMEngine(b, backend=be, num_slots=3, kv_block_size=4, speculative=spec)
        if proposer is not None:
            eng.scheduler.proposer = proposer
        await eng.start()
        outs = await asyncio.gather(*(eng.submit(GenerationRequest(list(p), max_tokens=n)).result() for p in ps))
        st = eng.stats()
        graphs = (set(be.graphs.graphs), dict(be.graphs.failed), dict(be.stats))  # before stop closes the backend
        await eng.stop()
        return [o[1] for o in outs], st, graphs

    plain, _, _ = asyncio.run(asyncio.wait_for(serve(None), timeout=120))
    refs = {tuple(p): w for p, w in zip(ps, plain, strict=True)}
    ngram = SpeculativeConfig(SpecMethod.NGRAM, 3, max_rows=8)
    got, st, (keys, failed, counts) = asyncio.run(asyncio.wait_for(serve(ngram, ReferenceProposer(refs, 3, span=120, shift=5)),
                                               timeout=120))
    assert got == plain
    assert 0 < st.spec_accepted_tokens_total < st.spec_draft_tokens_total  # kept, partly kept and rejected drafts
    # every decode-profile step shape captured once and replayed after: 1-token rows on the plain decode graphs,
    # verification rows (1 + k tokens, logits at each) on their own; no per-length-bucket graphs (no append state)
    assert counts["captured"] == len(keys) and not failed
    assert all(k[1] == k[2] and k[3] == 0 for k in keys) and {(1, 1, 1, 0), (2, 1, 1, 0)} <= keys
    assert any(k[1] > 1 for k in keys) and counts["replay"] > counts["captured"]
    got, _, _ = asyncio.run(asyncio.wait_for(serve(ngram), timeout=120))  # the real prompt-lookup proposer
    assert got == plain


def test_generate_cli_speculates_on_tensorrt_v4(v4_engine, capsys):
    """`generate --speculative ngram` on a V4 bundle picks the TensorRT engine (no refusal) and prints the plain
    output (the wiring; the rewind itself is checked above)."""
    from lineside.cli import main

    b, _ = v4_engine
    outs = {}
    for extra in ([], ["--speculative", "ngram", "--spec-tokens", "3"]):
        with pytest.raises(SystemExit) as e:
            main(["generate", str(b.path), "--prompt", "abcabcabcabc", "--max-tokens", "12", *extra])
        cap = capsys.readouterr()
        assert e.value.code == 0, cap.err
        assert "backend: tensorrt" in cap.err
        outs[bool(extra)] = cap.out
    assert outs[True] == outs[False] and outs[True].strip()
