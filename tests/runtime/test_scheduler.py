"""Scheduler policy without a model: admission order, preemption rules, chunk plans."""

from lineside.runtime.kv_manager import KVCacheArena
from lineside.runtime.request import GenerationRequest, RequestHandle
from lineside.runtime.scheduler import Scheduler, prefill_take
from lineside.runtime.sequence import Sequence
from lineside.runtime.sequence import SequenceStatus as Status


def seq(prompt_len=8, n=8, t=0.0, **kw) -> Sequence:
    h = RequestHandle(GenerationRequest(prompt_ids=list(range(3, 3 + prompt_len)), max_tokens=n, **kw))
    h.metrics.arrival = t
    return Sequence(h, None, set(), max_seq_len=64)


def test_chunk_plan_and_status():
    sch = Scheduler(KVCacheArena(2, 64, 4, prefix_cache=False), prefill_chunk=3)
    a = seq(prompt_len=7)
    sch.add(a)
    plans = []
    for _ in range(3):
        p = sch.schedule(now=1.0)
        plans.append((p.prefill_start, len(p.prefill_tokens), p.prefill_last))
        a.computed += len(p.prefill_tokens)
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
