"""Speculative decoding on real graphs: rejected positions' KV is overwritten harmlessly (GQA in-place cache
and the append-state trt graph), and greedy output with drafts equals plain decoding token for token at
MatMulNBits accuracy level 0 (tiny random Llama and Qwen2, SmolLM2)."""

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
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from tests.runtime.conftest import run
from tests.runtime.fakes import ReferenceProposer


@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_rejected_drafts_kv_is_overwritten(tiny_bundles, flavor):
    """Verify [pending, d1, d2, d3], keep d1, then decode: the logits equal those of a slot that never saw d2, d3."""
    b = open_bundle(tiny_bundles(quant="w4a16", accuracy_level=0, flavors=(flavor,), group_size=64,
                                 max_seq_len=64))
    spec = OnnxRuntimeBackend(b, num_slots=2, threads=2, flavor=flavor)
    ref = OnnxRuntimeBackend(b, num_slots=2, threads=2, flavor=flavor)
    rng = np.random.default_rng(4)
    prompt, drafts = rng.integers(3, 259, 11).tolist(), rng.integers(3, 259, 4).tolist()
    for be in (spec, ref):
        be.forward(StepBatch.single(1, prompt, 0))
    out = spec.forward(StepBatch.single(1, drafts, len(prompt), all_logits=True))[0]
    want = ref.forward(StepBatch.single(1, drafts[:2], len(prompt), all_logits=True))[0]
    np.testing.assert_allclose(out[:2], want, rtol=1e-4, atol=1e-4)  # same scores for the kept prefix
    nxt = [7, 8]
    got = spec.forward(StepBatch.single(1, nxt, len(prompt) + 2, all_logits=True))[0]
    exp = ref.forward(StepBatch.single(1, nxt, len(prompt) + 2, all_logits=True))[0]
    np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-4)
    one = spec.forward(StepBatch.single(1, [9], len(prompt) + 4))[0]
    np.testing.assert_allclose(one, ref.forward(StepBatch.single(1, [9], len(prompt) + 4))[0], rtol=1e-4, atol=1e-4)



def test_a_padded_row_at_the_end_of_the_context_verifies_beside_a_longer_one(tiny_bundles):
    """A verification step right-pads rows to its widest (the trt graph takes them in one run): a row whose one
    token sits at the last position of the context must not give its padding positions past the rotary table
    (onnxruntime failed the whole step: Gather index 64 out of [-64, 63]); each row scores as it does alone."""
    b = open_bundle(tiny_bundles(quant="w4a16", accuracy_level=0, flavors=("trt",), group_size=64,
                                 max_seq_len=64))
    be = OnnxRuntimeBackend(b, num_slots=2, threads=2, flavor="trt")
    rng = np.random.default_rng(5)
    long, short = rng.integers(3, 259, 63).tolist(), rng.integers(3, 259, 9).tolist()
    be.forward(StepBatch.single(0, long, 0))
    be.forward(StepBatch.single(1, short, 0))
    last, drafts = [int(rng.integers(3, 259))], rng.integers(3, 259, 4).tolist()
    ids = np.zeros((2, 4), dtype=np.int64)
    ids[0, :1], ids[1] = last, drafts
    new = np.array([1, 4])
    out = be.forward(StepBatch(slots=[0, 1], input_ids=ids, past_lengths=np.array([63, 9]), new_lengths=new,
                               logits_positions=np.minimum(np.arange(4)[None, :], (new - 1)[:, None])))
    alone = OnnxRuntimeBackend(b, num_slots=2, threads=2, flavor="trt")
    alone.forward(StepBatch.single(0, long, 0))
    alone.forward(StepBatch.single(1, short, 0))
    np.testing.assert_allclose(out[0, 0], alone.forward(StepBatch.single(0, last, 63))[0, 0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out[1], alone.forward(StepBatch.single(1, drafts, 9, all_logits=True))[0],
                               rtol=1e-4, atol=1e-4)


async def engine_outputs(bundle, prompts, n, *, spec, proposer=None, slots=3, **kw):
    eng = LLMEngine(bundle, backend="onnxruntime", threads=2, num_slots=slots, speculative=spec, **kw)
    if proposer is not None:
        eng.scheduler.proposer = proposer
    await eng.start()
    outs = await asyncio.gather(*(eng.submit(GenerationRequest(list(p), max_tokens=n)).result() for p in prompts))
    st = eng.stats()
    await eng.stop()
    return [o[1] for o in outs], st


def tiny_prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(3, 259, 12).tolist()
    return [[1, *base, *base[:5]], [1, *rng.integers(3, 259, 7).tolist()], [1, *base[3:], *base[3:9]]]


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
def test_tiny_int4_level0_greedy_with_drafts_equals_plain(tiny_bundles, variant):
    bundle = tiny_bundles(variant=variant, quant="w4a16", accuracy_level=0, group_size=32, max_seq_len=128)
    prompts, n = tiny_prompts(), 16
    g = Generator(bundle, threads=2)
    want = [list(g.stream(p, n)) for p in prompts]
    refs = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    for wrong in (3, 1000):
        got, st = run(engine_outputs(bundle, prompts, n, spec=SpeculativeConfig(SpecMethod.NGRAM, 4, max_rows=8),
                                     proposer=ReferenceProposer(refs, wrong)))
        assert got == want, wrong
        assert st.spec_accepted_tokens_total > 0
        if wrong == 3:
            assert st.spec_accepted_tokens_total < st.spec_draft_tokens_total
    got, st = run(engine_outputs(bundle, prompts, n, spec=SpeculativeConfig(SpecMethod.NGRAM, 4, max_rows=8)))
    assert got == want  # the real prompt-lookup proposer


@pytest.fixture(scope="module")
def smol_level0(smol_level0_bundle):
    return smol_level0_bundle


COPY_TASKS = [
    "Reformat this log line as 'time | level | message': 2026-03-02T10:15:01 WARN spindle 3 temperature 81C above "
    "limit 80C",
    "Extract the fields as JSON with keys machine, fault, shift: Machine: Press-07. Fault: hydraulic pressure low. "
    "Shift: night.",
    "Summarise this ticket, quoting the part number: Operator reports part 4471-B jams in feeder 2 every hour.",
]


@pytest.mark.slow
def test_smollm2_level0_greedy_with_ngram_equals_plain(smol_level0):
    from lineside.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_bundle(open_bundle(smol_level0))
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in COPY_TASKS]
    plain, _ = run(engine_outputs(smol_level0, prompts, 40, spec=None))
    got, st = run(engine_outputs(smol_level0, prompts, 40, spec=SpeculativeConfig(SpecMethod.NGRAM, 4, max_rows=8)))
    assert got == plain
    assert st.spec_accepted_tokens_total > 0


def test_mixed_verify_and_decode_rows_equal_rows_run_alone(tiny_bundles):
    """One step with 1-token rows around a verifying row (the GQA cpu graph splits it into runs of adjacent
    1-token rows and single multi-token rows): every row's logits equal those of the row run by itself."""
    b = open_bundle(tiny_bundles(quant="w4a16", accuracy_level=0, group_size=32))
    mixed = OnnxRuntimeBackend(b, num_slots=5, threads=2)
    alone = OnnxRuntimeBackend(b, num_slots=5, threads=2)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 259, 6 + i).tolist() for i in range(5)]
    for be in (mixed, alone):
        for slot, p in enumerate(prompts):
            be.forward(StepBatch.single(slot, p, 0))
    rows = [[5], [6, 7, 8], [9], [10], [11, 12]]
    width = 3
    ids = np.zeros((5, width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    new = np.array([len(r) for r in rows], dtype=np.int64)
    batch = StepBatch(slots=list(range(5)), input_ids=ids, past_lengths=np.array([len(p) for p in prompts]),
                      new_lengths=new, logits_positions=np.minimum(np.arange(width)[None, :], (new - 1)[:, None]))
    got = mixed.forward(batch)
    for slot, r in enumerate(rows):
        want = alone.forward(StepBatch.single(slot, r, len(prompts[slot]), all_logits=True))[0]
        np.testing.assert_allclose(got[slot, :len(r)], want, rtol=1e-4, atol=1e-4)
