"""LLMEngine: continuous batching over one backend, the API the server uses.

``submit`` queues a request and returns a handle to async-iterate; an asyncio task runs the step
loop: the scheduler plans a step (decode batch + at most one prefill chunk), a worker thread runs
the backend calls and samples (step_runner.py), the scheduler's ``postprocess`` applies the outcome
to the sequences, and the engine hands the resulting events to the handles. Cancellation and
timeouts take effect at the next step and free the request's slot. All times come from ``clock``
(tests inject one instead of sleeping).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lineside.bundle import Bundle, open_bundle
from lineside.errors import LinesideError
from lineside.graph_io import StateUpdate
from lineside.runtime.backend import Backend, StepBatch
from lineside.runtime.kv_manager import KVCacheArena
from lineside.runtime.request import (
    EngineDraining,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    RequestHandle,
    TokenEvent,
    validate_request,
)
from lineside.runtime.scheduler import ACCEPTANCE_BUCKETS, Clock, Scheduler
from lineside.runtime.sequence import Sequence, SequenceStatus
from lineside.runtime.speculative.config import SpeculativeConfig
from lineside.runtime.step_plan import StepPlan
from lineside.runtime.step_runner import StepOutcome, error_line, run_step
from lineside.runtime.structured import GrammarCompiler

log = logging.getLogger("lineside.engine")


@dataclass
class EngineStats:
    running: int
    waiting: int
    num_slots: int
    kv_usage: float  # live KV blocks / total blocks, 0..1
    kv_blocks_used: int
    kv_blocks_reserved: int
    kv_blocks_total: int
    prefix_cache_hits: int
    prefix_cache_hit_tokens: int
    prompt_tokens_total: int
    generated_tokens_total: int
    steps: int
    preemptions: int
    spec_draft_tokens_total: int = 0  # proposed tokens the model scored
    spec_accepted_tokens_total: int = 0  # of those, kept
    spec_verify_rows_total: int = 0  # decode rows that verified proposals
    # acceptance rate per verifying row and step: (bucket upper bounds, rows in each bucket, sum of rates)
    spec_acceptance: tuple[tuple[float, ...], tuple[int, ...], float] = ((), (), 0.0)
    requests: dict[FinishReason, int] = field(default_factory=dict)  # finished requests by finish_reason


class LLMEngine:
    """What the server talks to: takes requests, runs the step loop, streams each request's events."""

    def __init__(self, bundle: Bundle | str | Path, backend: str | Backend = "auto", *, num_slots: int = 8,
                 max_waiting: int = 256, kv_block_size: int = 16, prefill_chunk: int = 512,
                 prefix_cache: bool = True, threads: int | None = None, kv_blocks: int | None = None,
                 aging_s: float = 10.0, preemption: bool = True, clock: Clock = time.monotonic,
                 speculative: SpeculativeConfig | None = None):
        from lineside.runtime.tokenizer import Tokenizer

        self.bundle = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
        if num_slots < 1:
            raise LinesideError(f"num_slots must be ≥ 1, got {num_slots}")
        if isinstance(backend, str):  # TensorRT when its engine fits this machine, else onnxruntime CPU
            from lineside.runtime.select import choose_backend

            backend = choose_backend(self.bundle, backend, num_slots, say=log.info, threads=threads)
        self.backend: Backend = backend
        self.backend_name = self.backend.name
        self.tokenizer = Tokenizer.from_bundle(self.bundle)
        self.max_seq_len = int(self.backend.max_seq_len)
        self.model_name = self.bundle.path.name
        self.vocab_size = int(self.backend.vocab_size)
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(self.bundle.config.eos_token_ids)
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        # Whole-state tensors (DeepSeek-V4 compressor state) cannot be cut at a prefix: no prefix reuse there.
        states = getattr(self.backend, "states", [])
        prefix_ok = prefix_cache and not any(getattr(s, "update", None) == StateUpdate.REPLACE for s in states)
        self.arena = KVCacheArena(self.backend.num_slots, self.max_seq_len, kv_block_size, num_blocks=kv_blocks,
                                  prefix_cache=prefix_ok)
        # A chunk larger than the backend's prefill profile would be split inside one step anyway.
        chunk = min(int(prefill_chunk), int(getattr(self.backend, "max_prefill", prefill_chunk) or prefill_chunk))
        self.clock = clock
        # Whole-state tensors would advance past the accepted length on a verification step (not handled yet).
        self.speculative = speculative
        if speculative is not None and any(getattr(s, "update", None) == StateUpdate.REPLACE for s in states):
            raise LinesideError(f"--speculative {speculative.method} is not supported for this model yet: its decode "
                               "state has whole-state tensors that a rejected draft would advance")
        self.scheduler = Scheduler(self.arena, prefill_chunk=chunk, aging_s=aging_s, preemption=preemption,
                                   contiguous_slots=self.backend.needs_contiguous_slots, clock=clock,
                                   proposer=None if speculative is None else speculative.proposer(),
                                   spec_tokens=0 if speculative is None else speculative.num_tokens,
                                   spec_max_rows=_spec_max_rows(self.backend, speculative),
                                   verify_cost=float(getattr(self.backend, "verify_cost", 1.0)))
        self.max_waiting = max_waiting
        self.ready = False
        self.draining = False
        self._incoming: deque[Sequence] = deque()
        self._seqs: dict[str, Sequence] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._step_lock = threading.Lock()
        # One thread runs every step (not the default pool's rotating threads: warm caches, no context copy).
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lineside-step")
        self._closed = False
        self._steps = 0
        self._prompt_total = 0
        self._outcomes: dict[FinishReason, int] = {}
        self.step_log: deque[tuple[int, int]] | None = None  # (decode rows, prefill tokens) per step, when set

    # ---- public API -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Warm the backend up (first runs allocate and pick kernels), then start the step loop."""
        if self._task is not None:
            return
        if self._closed or self.draining:
            raise LinesideError("this engine was stopped; create a new LLMEngine to serve again")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        await self._loop.run_in_executor(self._stepper, self._warmup)
        self.ready = True
        self._task = asyncio.create_task(self._run(), name="lineside-engine")
        if self._incoming:
            self._wake.set()

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_timeout`` s, cancel the rest."""
        self.draining = True
        self.ready = False
        deadline = self.clock() + drain_timeout
        while self._task is not None and self._seqs and self.clock() < deadline:
            await asyncio.sleep(0.01)
        for seq in list(self._seqs.values()):
            seq.handle.cancel()
        self._kick()
        while self._task is not None and self._seqs and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in list(self._seqs.values()):  # never started: finish them here
            self._abort(seq, FinishReason.CANCELLED)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Free the backend (after any step still running in the worker thread); ``stop`` calls it."""
        with self._step_lock:
            if not self._closed:
                self._closed = True
                self.backend.close()
        self._stepper.shutdown(wait=False)

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request; raises LinesideError if it is malformed, QueueFullError / EngineDraining if refused."""
        if self.draining:
            raise EngineDraining("the server is shutting down and takes no new requests; retry on another instance")
        validate_request(req, self.vocab_size, self.max_seq_len)
        if len(self._incoming) + len(self.scheduler.waiting) >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are already waiting; retry later")
        if req.request_id in self._seqs:
            raise LinesideError(f"request id {req.request_id!r} is already running; use a new id")
        if not self.arena.fits_ever(len(req.prompt_ids) + min(req.max_tokens, self.max_seq_len - len(req.prompt_ids))):
            raise LinesideError(f"prompt + max_tokens need more KV than the engine's {self.arena.total_blocks} blocks "
                               f"of {self.arena.block_size}; lower max_tokens")
        handle = RequestHandle(req, on_cancel=self._kick)
        handle.metrics.arrival = self.clock()
        matcher = self.grammar.matcher(req.constraint) if req.constraint is not None else None
        seq = Sequence(handle, self.tokenizer, self.eos_ids, self.max_seq_len, matcher=matcher)
        self._seqs[req.request_id] = seq
        self._incoming.append(seq)
        self._kick()
        return handle

    @property
    def grammar(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer, made on first use (about a second: it
        reads the whole vocabulary); its cache makes a repeated constraint cost a copy."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._grammar

    @property
    def grammar_ready(self) -> bool:
        return self._grammar is not None

    def stats(self) -> EngineStats:
        a, s = self.arena, self.scheduler
        used = a.used_blocks
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting) + len(self._incoming), num_slots=a.num_slots,
            kv_usage=used / a.total_blocks, kv_blocks_used=used, kv_blocks_reserved=a.reserved_blocks,
            kv_blocks_total=a.total_blocks, prefix_cache_hits=a.prefix_hits, prefix_cache_hit_tokens=a.prefix_hit_tokens,
            prompt_tokens_total=self._prompt_total, generated_tokens_total=s.generated_tokens, steps=self._steps,
            preemptions=s.preemptions, spec_draft_tokens_total=s.spec_drafted,
            spec_accepted_tokens_total=s.spec_accepted, spec_verify_rows_total=s.spec_steps,
            spec_acceptance=(ACCEPTANCE_BUCKETS, tuple(s.spec_rate_counts), s.spec_rate_sum),
            requests=dict(self._outcomes))

    # ---- loop -------------------------------------------------------------------------------------
    def _kick(self) -> None:
        """Wake the step loop (safe from any thread)."""
        if self._wake is None or self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._wake.set()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                self._intake()
                self._deliver(self.scheduler.expire())
                plan = self.scheduler.schedule()
                if plan.empty:
                    await self._wake.wait()
                    continue
                out = await self._loop.run_in_executor(self._stepper, self._execute, plan)
                self._steps += 1
                if self.step_log is not None:
                    self.step_log.append((len(plan.decode), len(plan.prefill_tokens)))
                self._deliver(self.scheduler.postprocess(plan, out.sampled, out.errors, logprobs=out.logprobs,
                                                         accepted=out.accepted))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # an engine bug must not leave clients waiting forever
                msg = error_line(e)
                for seq in list(self._seqs.values()):
                    with contextlib.suppress(Exception):
                        self._abort(seq, FinishReason.ERROR, msg)
                await asyncio.sleep(0)
            # No yield here: the next step is planned and handed to the worker first, so the streams' chunks for
            # this step are encoded and written while it runs (not on the decode's critical path).

    def _intake(self) -> None:
        while self._incoming:
            seq = self._incoming.popleft()
            if seq.status == SequenceStatus.FINISHED:  # ended before it got here (stop, or a failed step)
                continue
            self._prompt_total += len(seq.prompt)
            self.scheduler.add(seq)

    def _deliver(self, events: Iterable[tuple[Sequence, TokenEvent | None]]) -> None:
        """Hand events to their handles; a final one also retires the request here."""
        for seq, ev in events:
            if ev is None:  # it had finished already
                continue
            if ev.finish_reason is not None:
                self._outcomes[ev.finish_reason] = self._outcomes.get(ev.finish_reason, 0) + 1
                self._seqs.pop(seq.req.request_id, None)
            seq.handle._push(ev)

    def _abort(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        self._deliver([(seq, self.scheduler.abort(seq, reason, error))])

    def _execute(self, plan: StepPlan) -> StepOutcome:
        """Worker thread: the step's backend calls and sampling (never beside ``close``)."""
        with self._step_lock:
            return run_step(self.backend, plan)

    def _warmup(self) -> None:
        """One prefill and one decode step on slot 0, then forget it."""
        be = self.backend
        ids = [int(self.bundle.config.bos_token_id or 0)] * 4
        be.reset_slot(0)
        be.forward(StepBatch.single(0, ids, 0))
        be.forward(StepBatch.single(0, ids[:1], len(ids)))
        be.reset_slot(0)

    def __repr__(self) -> str:
        return f"LLMEngine({self.model_name!r}, backend={self.backend_name}, slots={self.arena.num_slots})"



def _spec_max_rows(backend: Backend, spec: SpeculativeConfig | None) -> int | None:
    """Decode rows up to which a step speculates: the config's, else the backend's ``spec_max_rows`` (onnxruntime's
    cpu graph runs each multi-token row as its own call, so beside other rows a verification is a whole extra
    forward), else any."""
    if spec is None:
        return None
    return spec.max_rows if spec.max_rows is not None else getattr(backend, "spec_max_rows", None)
