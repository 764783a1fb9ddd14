"""Scheduler policy without a model: admission order, preemption rules, chunk plans, and what
``postprocess`` / ``expire`` do to sequences, slots and the arena after a step."""

import pytest

from lineside.runtime.kv_manager import KVCacheArena, SlotOpKind
from lineside.runtime.request import GenerationRequest, RequestHandle
from lineside.runtime.scheduler import Scheduler
from lineside.runtime.sequence import Sequence
from lineside.runtime.sequence import SequenceStatus as Status
from lineside.runtime.step_plan import prefill_take


class Letters:
    """Decodes token i as one letter: enough text for the detokenizer and stop-string paths."""

    def decode(self, ids, skip_special=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def seq(prompt_len=8, n=8, t=0.0, **kw) -> Sequence:
    h = RequestHandle(GenerationRequest(prompt_ids=list(range(3, 3 + prompt_len)), max_tokens=n, **kw))
    h.metrics.arrival = t
    return Sequence(h, Letters(), {2}, max_seq_len=64)


def test_chunk_plan_and_status():
    sch = Scheduler(KVCacheArena(2, 64, 4, prefix_cache=False), prefill_chunk=3)
    a = seq(prompt_len=7)
    sch.add(a)
    plans = []
    for _ in range(3):
        p = sch.schedule(now=1.0)
        (c,) = p.prefills
        plans.append((c.start, len(c.tokens), c.last))
        a.computed += len(c.tokens)
    assert plans == [(0, 3, False), (3, 2, False), (5, 2, True)]  # no 1-token chunk
    assert a.status == Status.PREFILL and a.slot == 0


def test_realtime_preempts_batch_but_not_the_reverse():
    sch = Scheduler(KVCacheArena(1, 64, 4), aging_s=10.0)
    job = seq(mode="batch", t=0.0)
    sch.add(job)
    sch.schedule(now=0.0)
    job.status = Status.DECODE
    rt = seq(priority="low", t=1.0)
    sch.add(rt)
    sch.schedule(now=1.0)
    assert job.status == Status.WAITING and job.slot is None and rt.slot == 0 and sch.preemptions == 1
    rt.status = Status.DECODE
    # the batch job has aged far past the realtime one, but it never preempts a better class
    sch.schedule(now=1000.0)
    assert rt.slot == 0 and job.status == Status.WAITING and sch.preemptions == 1


def test_same_class_waits_and_gap_of_one_class_preempts():
    sch = Scheduler(KVCacheArena(1, 64, 4), aging_s=0)
    low = seq(priority="low")
    sch.add(low)
    sch.schedule(now=0.0)
    low.status = Status.DECODE
    other_low = seq(priority="low")
    sch.add(other_low)
    sch.schedule(now=0.0)
    assert other_low.status == Status.WAITING and sch.preemptions == 0
    normal = seq(priority="normal")
    sch.add(normal)
    sch.schedule(now=0.0)
    assert normal.slot == 0 and low.status == Status.WAITING and sch.preemptions == 1


def test_no_preemption_when_it_would_not_fit_anyway():
    arena = KVCacheArena(2, 64, 4, num_blocks=6)
    sch = Scheduler(arena)
    hi = seq(n=4, priority="high")  # 12 positions: 3 blocks
    job = seq(n=4, mode="batch")
    for s in (hi, job):
        sch.add(s)
        sch.schedule(now=0.0)
        s.status = Status.DECODE
    big = seq(prompt_len=12, n=8, priority="normal")  # 5 blocks: only 3 free even with the job gone
    sch.add(big)
    sch.schedule(now=0.0)
    assert job.slot is not None and sch.preemptions == 0 and big.status == Status.WAITING


def test_prefill_chunks_never_leave_one_token():
    assert [prefill_take(r, 4) for r in (10, 6, 5, 4, 3, 2, 1)] == [4, 4, 3, 4, 3, 2, 1]
    assert prefill_take(3, 2) == 3  # a chunk of 2 would leave 1: take all 3


def test_postprocess_records_kv_advances_and_finishes():
    arena = KVCacheArena(2, 64, 4)
    sch = Scheduler(arena, prefill_chunk=16)
    a = seq(prompt_len=6, n=2)
    sch.add(a)
    p = sch.schedule(now=1.0)
    (c,) = p.prefills
    assert c.seq is a and c.last and c.tokens == a.prompt
    evs = sch.postprocess(p, {a: 7}, {}, now=2.0)
    assert [(s, e.token_ids, e.finish_reason) for s, e in evs] == [(a, [7], None)]
    assert a.status == Status.DECODE and a.computed == 6 and arena.tokens[a.slot] == a.prompt
    assert a.pending == 7 and a.handle.metrics.first_token == 2.0
    p = sch.schedule(now=3.0)
    assert p.decode == [a] and p.decode_batch().input_ids.tolist() == [[7]]
    slot = a.slot
    evs = sch.postprocess(p, {a: 9}, {}, now=4.0)
    assert [(e.token_ids, e.finish_reason) for _, e in evs] == [([9], "length")]
    assert a.status == Status.FINISHED and a.slot is None and sch.running == [] and arena.occupied == 0
    assert arena.tokens[slot] == [*a.prompt, 7]  # the token fed this step is cached; the slot is free
    assert a.handle.metrics.finished == 4.0 and sch.generated_tokens == 2


def test_postprocess_error_ends_only_the_failed_sequence():
    arena = KVCacheArena(2, 64, 4)
    sch = Scheduler(arena, prefill_chunk=16)
    a, b = seq(prompt_len=4), seq(prompt_len=5)
    sch.add(a)
    sch.add(b)
    sch.postprocess(sch.schedule(now=0.0), {a: 10}, {}, now=0.0)  # a's prefill
    sch.postprocess(sch.schedule(now=0.0), {a: 11, b: 20}, {}, now=0.0)  # a decodes 10, b's prefill
    p = sch.schedule(now=1.0)
    assert p.decode == [a, b]
    b_slot = b.slot
    evs = sch.postprocess(p, {a: 12}, {b: "model step failed: boom"}, now=1.0)
    assert [(s, e.finish_reason, e.error) for s, e in evs] == [(b, "error", "model step failed: boom"),
                                                                (a, None, None)]
    assert b.status == Status.FINISHED and b.slot is None and arena.tokens[b_slot] == b.prompt  # 20 not recorded
    assert a.computed == 6 and arena.tokens[a.slot] == [*a.prompt, 10, 11] and sch.running == [a]


def test_expire_cancels_and_times_out():
    sch = Scheduler(KVCacheArena(1, 64, 4))
    run, wait = seq(timeout_s=5.0), seq()
    for s in (run, wait):
        sch.add(s)
    sch.schedule(now=0.0)
    assert run.slot == 0 and wait.status == Status.WAITING
    assert sch.expire(now=4.9) == []
    wait.handle.cancel()
    evs = sch.expire(now=5.0)
    assert [(s, e.finish_reason) for s, e in evs] == [(wait, "cancelled"), (run, "timeout")]
    assert sch.waiting == sch.running == [] and sch.arena.occupied == 0
    assert sch.abort(run, "error") is None  # already finished: no second final event


def test_only_a_backend_that_needs_contiguous_slots_gets_moves():
    for contiguous in (False, True):
        sch = Scheduler(KVCacheArena(3, 64, 4, prefix_cache=False), prefill_chunk=32, contiguous_slots=contiguous)
        a, b, c = (prompt_seq(list(range(10 * i, 10 * i + 8)), n=n) for i, n in ((1, 8), (2, 2), (3, 8)))
        for s in (a, b, c):
            sch.add(s)
        p = sch.schedule(now=0.0)  # all three prefill at once, in slots 0, 1, 2
        sch.postprocess(p, {a: 10, b: 10, c: 10}, {}, now=0.0)
        p = sch.schedule(now=1.0)
        assert p.ops == [] and [s.slot for s in p.decode] == [0, 1, 2]
        sch.postprocess(p, {a: 11, b: 11, c: 11}, {}, now=1.0)  # b ends: slot 1 is a hole
        assert b.status == Status.FINISHED
        p = sch.schedule(now=2.0)
        assert [(o.kind, o.src, o.dst) for o in p.ops] == ([(SlotOpKind.COPY, 2, 1)] if contiguous else [])
        assert [s.slot for s in p.decode] == ([0, 1] if contiguous else [0, 2])
        sch.postprocess(p, {a: 12, c: 12}, {}, now=2.0)
        a.handle.cancel()
        sch.expire(now=3.0)  # a ends: c decodes alone, in one range of slots already, where it is
        p = sch.schedule(now=3.0)
        assert p.ops == [] and [s.slot for s in p.decode] == [c.slot] == ([1] if contiguous else [2])


def prompt_seq(prompt: list[int], n: int = 4, t: float = 0.0) -> Sequence:
    h = RequestHandle(GenerationRequest(prompt_ids=prompt, max_tokens=n))
    h.metrics.arrival = t
    return Sequence(h, Letters(), {2}, max_seq_len=64)


def step(sch: Scheduler, now: float):
    """Plan a step and apply it as the engine would, every sampled token 9."""
    p = sch.schedule(now=now)
    sampled = {s: 9 for s in p.decode} | {c.seq: 9 for c in p.prefills if c.last}
    sch.postprocess(p, sampled, {}, now=now)
    return p


def test_a_burst_of_short_prompts_is_admitted_in_one_step_then_decodes_together():
    sch = Scheduler(KVCacheArena(4, 64, 4), prefill_chunk=16)
    burst = [prompt_seq([10 * k + i for i in range(5)], t=k) for k in range(1, 4)]
    for s in burst:
        sch.add(s)
    p = step(sch, 1.0)
    assert [c.seq for c in p.prefills] == burst and all(c.last and c.start == 0 for c in p.prefills)
    p = step(sch, 2.0)
    assert p.decode == burst and not p.prefills


def test_the_step_budget_caps_all_chunks_together():
    sch = Scheduler(KVCacheArena(4, 64, 4), prefill_chunk=8)
    long, short = prompt_seq(list(range(100, 113))), prompt_seq([7, 8, 9], t=1.0)
    sch.add(long)
    sch.add(short)
    plans = [[(c.seq, c.start, len(c.tokens)) for c in step(sch, float(i)).prefills] for i in range(3)]
    # 13 tokens: 8, then the last 5 with the short prompt beside them (5 + 3 = 8)
    assert plans == [[(long, 0, 8)], [(long, 8, 5), (short, 0, 3)], []]
    assert all(sum(n for *_, n in p) <= 8 for p in plans)


def test_a_prompt_sharing_a_block_still_being_computed_waits_to_reuse_it():
    sch = Scheduler(KVCacheArena(4, 64, 4), prefill_chunk=32)
    head = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks of 4
    a, b = prompt_seq(head + [20, 21]), prompt_seq(head + [30, 31], t=1.0)
    c = prompt_seq([40, 41, 42], t=2.0)  # behind b in line: waits with it (admission keeps its order)
    for s in (a, b, c):
        sch.add(s)
    p = step(sch, 1.0)
    assert [x.seq for x in p.prefills] == [a]
    p = step(sch, 2.0)
    assert [(x.seq, x.start) for x in p.prefills] == [(b, 8), (c, 0)]  # b reused a's two blocks
    assert b.handle.metrics.prefix_reused_tokens == 8


@pytest.mark.parametrize("second", [3, 6])
def test_the_last_slot_goes_to_a_prefill_only_when_every_prefill_ends_in_the_step(second):
    sch = Scheduler(KVCacheArena(3, 64, 4), prefill_chunk=24, contiguous_slots=True)
    first = prompt_seq([1, 2, 3])
    sch.add(first)
    step(sch, 0.0)
    x, y = prompt_seq(list(range(100, 120)), t=1.0), prompt_seq(list(range(200, 200 + second)), t=2.0)
    sch.add(x)
    sch.add(y)
    p = step(sch, 1.0)
    if second == 3:  # 20 + 3 tokens: both prompts done in this step, nothing can end out of order
        assert [c.seq for c in p.prefills] == [x, y] and all(c.last for c in p.prefills)
        assert step(sch, 2.0).decode == [first, x, y]
    else:  # 20 + 6 > 24: y would still be prefilling after the step, holding the last slot
        assert [c.seq for c in p.prefills] == [x]
        p = step(sch, 2.0)
        assert [c.seq for c in p.prefills] == [y] and p.decode == [first, x]


def test_a_session_does_not_take_the_slot_a_prefill_needs_to_leave_the_decode_range():
    from lineside.runtime.sessions import SessionStore

    arena = KVCacheArena(4, 64, 4)
    head = list(range(50, 58))  # two blocks cached in slot 3: the next prompt that starts with them reuses slot 3
    for i in range(4):
        arena.allocate(f"x{i}", [], 8, 0)
    arena.append(3, head)
    for i in range(4):
        arena.free(i)
    arena.take_pending()
    sch = Scheduler(arena, prefill_chunk=8, contiguous_slots=True, sessions=SessionStore())
    d = prompt_seq([1, 2, 3], n=20)
    sch.add(d)
    step(sch, 0.0)
    sch.update_session("s", list(range(300, 310)), 10, now=1.0)  # pending work: it wants a slot
    a, b = prompt_seq(head + [60, 61], n=20, t=1.0), prompt_seq(list(range(100, 120)), n=20, t=2.0)
    sch.add(a)
    sch.add(b)
    p = step(sch, 1.0)
    assert [(c.seq, c.seq.slot, c.last) for c in p.prefills] == [(a, 3, True), (b, 1, False)]
    for t in (2.0, 3.0):  # a ended in slot 3 while b, in slot 1, still prefills: b moves up, a down
        p = step(sch, t)
        assert p.decode and [s.slot for s in p.decode] == list(range(p.decode[0].slot, p.decode[0].slot + len(p.decode)))


def test_cached_tokens_count_the_first_admission_only_when_preempted_before_the_first_token():
    """A request preempted mid-prefill and admitted again reuses the prefix cache twice (what it had cached at first,
    then its own computed prompt): prefix_reused_tokens (usage's cached_tokens) added both, 16 + 18 = 34 of a
    20-token prompt. It is what the cache gave the request when it was first scheduled, as vLLM counts it."""
    arena = KVCacheArena(2, 64, 4, num_blocks=8)
    head = list(range(50, 66))  # four blocks cached in slot 1
    arena.allocate("x", [], 16, 0, lowest=1)
    arena.append(1, head)
    arena.free(1)
    arena.take_pending()
    sch = Scheduler(arena, prefill_chunk=2)
    h = RequestHandle(GenerationRequest(prompt_ids=head + [70, 71, 72, 73], max_tokens=4, mode="batch"))
    h.metrics.arrival = 0.0
    job = Sequence(h, Letters(), {2}, max_seq_len=64)
    sch.add(job)
    step(sch, 0.0)  # reuses the 16 cached tokens, computes 2 of the last 4
    assert job.slot == 1 and job.status == Status.PREFILL and job.handle.metrics.prefix_reused_tokens == 16
    rt = prompt_seq([5, 6, 7, 8, 9, 10, 11, 12], n=4, t=1.0)
    sch.add(rt)
    step(sch, 1.0)
    assert job.status == Status.WAITING and sch.preemptions == 1
    for t in range(2, 12):
        step(sch, float(t))
    assert rt.status == Status.FINISHED and job.status != Status.WAITING and arena.prefix_hits == 2
    assert job.handle.metrics.prefix_reused_tokens == 16
