"""The engine with LoRA slots: rows of different adapters (and none) batch in one step and give each request
the tokens it gets alone; adapters swap in LRU, a request waits when every slot is in use; prefix reuse is per adapter."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.lora import read_adapter
from lineside.runtime.adapter_slots import AdapterSlots, AdapterSlotsFull, UnknownAdapter
from lineside.runtime.backend import StepBatch
from lineside.runtime.engine import LLMEngine, LoraServing
from lineside.runtime.lora_stack import LoraSlotsConfig
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.request import GenerationRequest
from lineside.runtime.sampling import SamplingParams
from tests.conftest import LORA_ADAPTERS

NAMES = sorted(LORA_ADAPTERS)
PROMPTS = [[1, 17, 42, 5, 99, 250, 3, 77, 8, 150, 61, 12, 200, 33, 40, 41, 44, 45], [1, 60, 61, 62, 63],
           [1, 9, 8, 7, 6, 5, 4, 3], [1, 100, 101, 102, 103, 104]]


@pytest.fixture(scope="module")
def lora_setup(tiny_bundles, peft_adapter):
    bundle = open_bundle(tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=64,
                                      accuracy_level=0, max_lora_rank=8))
    adapters = {n: read_adapter(peft_adapter("llama-gqa", n), bundle.config, n) for n in NAMES}
    return bundle, adapters


def greedy_alone(bundle, adapter, prompt, n):
    """Reference: one sequence on its own backend, prefill then one decode step per token."""
    slots = LoraSlotsConfig(1, 8)
    be = OnnxRuntimeBackend(bundle, flavor="cpu", accuracy_level=0, threads=1, lora=slots)
    a = 0
    if adapter is not None:
        be.load_adapter(1, adapter)
        a = 1
    logits = be.forward(StepBatch.single(0, prompt, 0, adapter=a))[0, -1]
    out = []
    for i in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = be.forward(StepBatch.single(0, [tok], len(prompt) + i, adapter=a))[0, -1]
    return out


def make_engine(bundle, adapters, max_loras, num_slots=4):
    lora = LoraServing(adapters=adapters, slots=LoraSlotsConfig(max_loras, 8))
    be = OnnxRuntimeBackend(bundle, num_slots=num_slots, flavor="cpu", accuracy_level=0, threads=1, lora=lora.slots)
    return LLMEngine(bundle, backend=be, num_slots=num_slots, lora=lora)


async def collect(handle):
    toks = []
    async for ev in handle:
        toks += ev.token_ids
        if ev.finish_reason is not None:
            assert ev.error is None, ev.error
    return toks


def req(prompt, adapter, n=6, rid=None):
    kw = {"request_id": rid} if rid else {}
    return GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=SamplingParams(temperature=0.0),
                             ignore_eos=True, adapter=adapter, **kw)


def test_mixed_adapters_batch_and_match_each_alone(lora_setup):
    bundle, adapters = lora_setup
    mix = [NAMES[0], NAMES[1], None, NAMES[2]]
    want = [greedy_alone(bundle, adapters[a] if a else None, p, 6) for a, p in zip(mix, PROMPTS, strict=True)]
    engine = make_engine(bundle, adapters, max_loras=3)
    engine.step_log = __import__("collections").deque()

    async def main():
        # queued before the step thread starts: all four are there at its first step, however threads are timed
        handles = [engine.submit(req(p, a)) for a, p in zip(mix, PROMPTS, strict=True)]
        await engine.start()
        try:
            return await asyncio.gather(*(collect(h) for h in handles))
        finally:
            await engine.stop()

    got = asyncio.run(main())
    assert got == want
    assert max(rows for rows, _ in engine.step_log) == 4  # all four rows decoded in one step
    assert engine.adapter_slots.loads == 3 and engine.adapter_slots.evictions == 0
    # different adapters give different continuations (the adapters are really applied)
    assert len({tuple(t) for t in got}) == 4


def test_lru_unload_and_waiting_when_all_slots_are_busy(lora_setup):
    bundle, adapters = lora_setup
    engine = make_engine(bundle, adapters, max_loras=2)
    slots = engine.adapter_slots

    async def main():
        await engine.start()
        try:
            a = await collect(engine.submit(req(PROMPTS[1], NAMES[0])))
            b = await collect(engine.submit(req(PROMPTS[1], NAMES[1])))
            # both slots hold idle adapters: the least recently used (NAMES[0]) makes room for NAMES[2]
            c = await collect(engine.submit(req(PROMPTS[1], NAMES[2])))
            assert slots.slot_of(NAMES[0]) is None and slots.slot_of(NAMES[1]) and slots.slot_of(NAMES[2])
            assert slots.evictions == 1
            # two requests hold both slots: a third adapter's request waits for one (not refused)
            h1 = engine.submit(req(PROMPTS[2], NAMES[1], n=4))
            h2 = engine.submit(req(PROMPTS[2], NAMES[2], n=4))
            h3 = engine.submit(req(PROMPTS[2], NAMES[0], n=4))
            base = engine.submit(req(PROMPTS[2], None, n=4))  # the base model needs no slot
            *_, waited = await asyncio.gather(collect(h1), collect(h2), collect(base), collect(h3))
            assert waited == greedy_alone(bundle, adapters[NAMES[0]], PROMPTS[2], 4)
            again = await collect(engine.submit(req(PROMPTS[1], NAMES[0])))  # slots idle again: reloads
            with pytest.raises(UnknownAdapter):
                engine.submit(req(PROMPTS[1], "nope"))
            return a, b, c, again
        finally:
            await engine.stop()

    a, b, c, again = asyncio.run(main())
    assert a == again == greedy_alone(bundle, adapters[NAMES[0]], PROMPTS[1], 6)
    assert c == greedy_alone(bundle, adapters[NAMES[2]], PROMPTS[1], 6)
    assert slots.refs == [0, 0, 0]


def test_prefix_reuse_is_per_adapter(lora_setup):
    bundle, adapters = lora_setup
    engine = make_engine(bundle, adapters, max_loras=2)
    prompt = PROMPTS[0]  # 18 tokens: one full block of 16 to reuse

    async def main():
        await engine.start()
        try:
            out = []
            for adapter in (NAMES[0], NAMES[0], None, None, NAMES[1]):
                h = engine.submit(req(prompt, adapter, n=3))
                toks = await collect(h)
                out.append((adapter, h.metrics.prefix_reused_tokens, toks))
            return out
        finally:
            await engine.stop()

    runs = asyncio.run(main())
    reused = [r for _, r, _ in runs]
    # the same adapter (and the base model) reuse their own KV; another adapter's KV of the same tokens never
    assert reused[0] == 0 and reused[1] > 0 and reused[2] == 0 and reused[3] > 0 and reused[4] == 0, reused
    assert runs[1][2] == runs[0][2] and runs[3][2] == runs[2][2]
    assert runs[0][2] != runs[2][2]


def test_adapter_slots_bookkeeping_without_a_model():
    """LRU order follows use, references pin a slot, a resident adapter is not loaded again."""
    fake = {n: object() for n in "abc"}
    s = AdapterSlots(fake, 2)  # type: ignore[arg-type]
    sa, sb = s.acquire("a"), s.acquire("b")
    assert [p.slot for p in s.take_pending()] == [sa, sb] == [1, 2]
    s.release(sa)
    assert s.acquire("c") == sa and s.slot_of("a") is None and s.evictions == 1  # a was idle
    with pytest.raises(AdapterSlotsFull):
        s.acquire("a")  # b and c are both in use
    s.release(sb)
    assert s.acquire("a") == sb  # b was the idle one
    assert s.acquire("c") == sa and [p.slot for p in s.take_pending()] == [sa, sb]  # c stayed: no reload
    assert s.refs == [0, 2, 1]
    with pytest.raises(UnknownAdapter):
        s.acquire("zzz")


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "k", "v", "o", "gate", "up", "down"), ("down",)])
@pytest.mark.parametrize("loras, rank", [(1, 4), (3, 16)])
def test_stack_bytes_counts_what_the_stack_allocates(targets, loras, rank):
    """serve's memory check counts the adapter slots before allocating them: the count is the allocation."""
    from lineside.config import ModelConfig
    from lineside.lora import LoraTarget
    from lineside.runtime.lora_stack import LoraStack, stack_bytes

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=40, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=4)
    ts, slots = tuple(LoraTarget(t) for t in targets), LoraSlotsConfig(max_loras=loras, max_rank=rank)
    assert stack_bytes(cfg, ts, slots) == LoraStack(cfg, ts, slots).nbytes > 0


def _random_adapter(cfg, name: str, rank: int, targets, seed: int):
    """A LoraAdapter straight from random arrays (the stack only reads its weights)."""
    from lineside.lora import LoraAdapter, in_out

    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for t in targets:
            fin, fout = in_out(cfg, t)
            weights[(layer, t)] = (rng.standard_normal((rank, fin)).astype(np.float16),
                                   rng.standard_normal((fout, rank)).astype(np.float16))
    return LoraAdapter(name=name, rank=rank, alpha=float(rank) / 2, rslora=False, targets=tuple(targets), weights=weights,
                       scalings=dict.fromkeys(weights, 0.5))  # kept as a file holds them: fp16, scaled on loading


def test_packed_stack_holds_what_is_loaded_at_its_own_rank():
    """Packed (onnxruntime): loaded adapters side by side at their own rank, an empty slot takes no column, one
    B per part; padded (TensorRT): every slot at max rank, same shapes whatever is loaded. Both put each
    adapter's A/B where its slot's mask columns are."""
    from lineside.config import ModelConfig
    from lineside.lora import ALL_TARGETS, LoraTarget, cols_input
    from lineside.runtime.lora_stack import LoraStack

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=40, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=4)
    q, v = LoraTarget.Q, LoraTarget.V
    big, small = _random_adapter(cfg, "big", 8, ALL_TARGETS, 1), _random_adapter(cfg, "small", 3, (q, v), 2)
    packed = LoraStack(cfg, ALL_TARGETS, LoraSlotsConfig(3, 8))
    padded = LoraStack(cfg, ALL_TARGETS, LoraSlotsConfig(3, 8), packed=False)
    assert packed.width == 0 and padded.width == 24 and packed.nbytes == padded.nbytes
    for st in (packed, padded):
        st.load(1, big)
        st.load(3, small)  # slot 2 stays empty
    assert packed.width == 11 and padded.width == 24 and packed.live_bytes < padded.live_bytes
    assert packed.arrays[cols_input(3)].tolist() == ([1] * 8 + [3] * 3) * 3
    assert padded.arrays[cols_input(3)].tolist() == ([1] * 8 + [2] * 8 + [3] * 8) * 3
    for st, start in ((packed, 8), (padded, 16)):  # where slot 3 starts
        kk = st.width
        a, b_v = st.arrays["lora_a.1.qkv"], st.arrays["lora_b.1.qkv.v"]
        assert a.shape == (3 * kk, 16) and b_v.shape == (8, kk) and st.arrays["lora_b.1.qkv.q"].shape == (16, kk)
        la, lb = small.scaled_pair((1, v))
        fa, fb = small.weights[(1, v)]  # the file's fp16 A, B; the slot holds float32 A, B * lora_alpha / r
        assert la.dtype == lb.dtype == np.float32 and fa.dtype == np.float16
        np.testing.assert_array_equal(lb, fb.astype(np.float32) * np.float32(0.5))
        np.testing.assert_array_equal(a[2 * kk + start:2 * kk + start + 3], la)
        np.testing.assert_array_equal(b_v[:, start:start + 3], lb)
        assert not a[kk + start:2 * kk].any()  # small adapts no k: its k block is zeros
        la, lb = big.scaled_pair((0, LoraTarget.DOWN))
        np.testing.assert_array_equal(st.arrays["lora_a.0.down"][:8], la)
        np.testing.assert_array_equal(st.arrays["lora_b.0.down.down"][:, :8], lb)
    packed.unload(1)
    assert packed.width == 3 and packed.arrays[cols_input(1)].tolist() == [3] * 3
    np.testing.assert_array_equal(packed.arrays["lora_b.1.qkv.v"], small.scaled_pair((1, v))[1])
    packed.unload(3)
    assert packed.width == 0 and packed.live_bytes == 0


def test_a_bfloat16_adapter_is_read(peft_adapter, tiny_bundles, tmp_path):
    """PEFT adapters of bf16 models are saved in bfloat16, which safetensors.numpy cannot read: they are read
    through ml_dtypes and held in float32 (exact), the same A, B and scaling as the float32 file rounded to bf16."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    bundle = open_bundle(tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=64,
                                      accuracy_level=0, max_lora_rank=8))
    src = peft_adapter("llama-gqa", "qv")
    dst = tmp_path / "bf16"
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights))
    f32, bf16 = read_adapter(src, bundle.config, "f32"), read_adapter(dst, bundle.config, "bf16")
    assert f32.weights.keys() == bf16.weights.keys() and f32.scalings == bf16.scalings
    for key, (a, b) in f32.weights.items():
        ba, bb = bf16.weights[key]
        assert ba.dtype == bb.dtype == np.float32
        np.testing.assert_array_equal(ba, torch.from_numpy(a).to(torch.bfloat16).float().numpy())
        np.testing.assert_array_equal(bb, torch.from_numpy(b).to(torch.bfloat16).float().numpy())


def test_an_adapter_completion_never_leaves_its_kv_in_a_session(lora_setup):
    """A session holds base-model KV: an adapter's completion naming it with keep_session (as a new session, or
    over one a prefill made) must not hand its slot to the session, or the next base turn reuses adapter KV."""
    bundle, adapters = lora_setup
    engine = make_engine(bundle, adapters, max_loras=2)
    prompt, turn = PROMPTS[0], [5, 6, 7, 8]

    def kept(adapter, sid):
        return GenerationRequest(prompt_ids=prompt, max_tokens=3, sampling=SamplingParams(temperature=0.0),
                                 ignore_eos=True, adapter=adapter, session_id=sid, keep_session=True)

    async def main():
        await engine.start()
        try:
            adapter_out = await collect(engine.submit(kept(NAMES[0], "new")))
            engine.prefill("made", prompt, len(prompt))
            while engine.session("made").pending_tokens:
                await asyncio.sleep(0)
            await collect(engine.submit(kept(NAMES[0], "made")))
            hits = engine.stats().session_hits
            nexts = [await collect(engine.submit(GenerationRequest(
                prompt_ids=prompt + adapter_out + turn, max_tokens=3, sampling=SamplingParams(temperature=0.0),
                ignore_eos=True, session_id=sid))) for sid in ("new", "made")]
            ref = await collect(engine.submit(req(prompt + adapter_out + turn, None, n=3, rid="ref")))
            return nexts, ref, hits, engine.stats()
        finally:
            await engine.stop()

    nexts, ref, hits, st = asyncio.run(main())
    assert hits == 0  # the adapter completion never took the base session's slot
    assert nexts == [ref, ref]
    # "made" kept its base KV (one hit, its prompt); "new" was never made from adapter KV
    assert st.session_hits == 1 and st.session_tokens_saved <= len(PROMPTS[0])


def test_more_adapters_than_slots_wait_for_a_slot_and_each_gets_its_own_tokens(lora_setup):
    """vLLM's scheduler: a request whose adapter finds every slot held by running requests waits in the queue until
    one frees (it used to be refused with AdapterSlotsFull, a 429, while the server could run it a moment later).
    Three adapters and the base model, one slot, all submitted at once: each gets the tokens it gets alone."""
    bundle, adapters = lora_setup
    mix = [NAMES[0], NAMES[1], None, NAMES[2], NAMES[0], NAMES[1]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mix))]
    engine = make_engine(bundle, adapters, max_loras=1, num_slots=6)

    async def main():
        await engine.start()
        try:
            handles = [engine.submit(req(p, a, n=5)) for a, p in zip(mix, prompts, strict=True)]
            return await asyncio.gather(*(collect(h) for h in handles))
        finally:
            await engine.stop()

    got = asyncio.run(main())
    want = [greedy_alone(bundle, adapters[a] if a else None, p, 5) for a, p in zip(mix, prompts, strict=True)]
    assert got == want
    slots = engine.adapter_slots
    assert slots.refs == [0, 0] and slots.loads >= 3  # each adapter swapped into the one slot in turn


def test_an_adapter_completion_ends_the_session_it_names(lora_setup):
    """"The session ends with the completion unless it sends keep_session": an adapter's completion too (it never
    uses the base model's KV, but it named the session), else the session stayed pinned until its TTL."""
    bundle, adapters = lora_setup
    engine = make_engine(bundle, adapters, max_loras=2)
    prompt = PROMPTS[0]

    async def main():
        await engine.start()
        try:
            engine.prefill("s", prompt, len(prompt))
            while engine.session("s").pending_tokens:
                await asyncio.sleep(0)
            await collect(engine.submit(GenerationRequest(
                prompt_ids=prompt, max_tokens=3, sampling=SamplingParams(temperature=0.0), ignore_eos=True,
                adapter=NAMES[0], session_id="s")))
            return engine.session("s"), engine.stats()
        finally:
            await engine.stop()

    info, st = asyncio.run(main())
    assert info is None and st.sessions == 0 and st.session_pinned_blocks == 0


@pytest.mark.parametrize("max_loras", [1, 2])
def test_a_name_reloaded_while_its_old_requests_run_serves_the_new_weights_at_once(lora_setup, max_loras):
    """vLLM lets a name be loaded again right after its unload (and replaced with load_inplace): a request already
    running on the old weights finishes on them, new ones get the new weights at once (with one slot, after the old
    request frees it), and neither reuses the other's KV of the same prompt. It was refused until the old ended."""
    import dataclasses

    bundle, adapters = lora_setup
    old, new = adapters[NAMES[0]], dataclasses.replace(adapters[NAMES[1]], name="x")
    prompt = PROMPTS[0] + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 33 tokens: two full blocks
    engine = make_engine(bundle, {"x": dataclasses.replace(old, name="x")}, max_loras=max_loras)
    slots = engine.adapter_slots

    async def main():
        await engine.start()
        try:
            warm = await collect(engine.submit(req(prompt, "x", n=3)))  # the old weights' KV of the prompt, cached
            h_old = engine.submit(req(prompt, "x", n=12))
            engine.remove_adapter("x")
            engine.add_adapter(new)  # at once: h_old still runs (or waits) on the old weights
            h_new = engine.submit(req(prompt, "x", n=6))
            got = await asyncio.gather(collect(h_old), collect(h_new))
            again = engine.submit(req(prompt, "x", n=6))  # the new load's own KV is reused
            return warm, got, await collect(again), h_new.metrics.prefix_reused_tokens, again.metrics
        finally:
            await engine.stop()

    warm, (got_old, got_new), got_again, new_reused, again_metrics = asyncio.run(main())
    want_old, want_new = greedy_alone(bundle, old, prompt, 12), greedy_alone(bundle, new, prompt, 6)
    assert warm == want_old[:3] and got_old == want_old
    assert got_new == got_again == want_new != want_old[:6]
    assert new_reused == 0 and again_metrics.prefix_reused_tokens > 0
    # nothing left behind: one load served, in one slot, no reference, the old load forgotten
    assert slots.names == ["x"] and not slots.holds and not slots.retiring and slots.refs == [0] * (max_loras + 1)
    assert list(slots.resident.values()) == [slots.namespaces["x"]] and len(slots.namespaces) == 1
    assert engine.backend.lora.loaded.count("x") == 1
