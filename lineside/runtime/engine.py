"""LLMEngine: continuous batching over one backend, the API the server uses.

``submit`` queues a request and returns a handle to async-iterate. One thread of the engine's own (the step
thread) runs the step loop: the scheduler plans a step (decode batch + prefill chunks within a budget), the backend
runs it and the logits are sampled (step_runner.py), the scheduler's ``postprocess`` applies the outcome to the
sequences, and the next step is planned and started at once. The resulting events go to the handles on the
event loop (``call_soon_threadsafe``), which writes them while the next step runs: no step waits for the event
loop (on two cores its wake-up and the hand-back cost 0.35-0.5 ms a token). The scheduler's state is shared with
the event loop's calls (submit, sessions, stats) under one lock, held only between backend runs. Cancellation
and timeouts take effect at the next step and free the request's slot. All times come from ``clock`` (tests
inject one instead of sleeping).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lineside.bundle import Bundle, open_bundle
from lineside.errors import LinesideError
from lineside.lora import LoraAdapter, LoraTarget, check_fits
from lineside.runtime.adapter_slots import AdapterSlots, AdapterSlotsFull, UnknownAdapter
from lineside.runtime.backend import Backend, StepBatch, has_whole_state
from lineside.runtime.engine_health import (
    DEFAULT_MAX_FAILED_STEPS,
    BackendLost,
    EngineFailed,
    Judgement,
    StepHealth,
    StepVerdict,
)
from lineside.runtime.fair_lock import FairLock
from lineside.runtime.kv_bytes import KvArenaBytes
from lineside.runtime.kv_manager import KVCacheArena, salted
from lineside.runtime.lora_stack import LoraSlotsConfig
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
from lineside.runtime.sessions import SessionInfo, SessionStore, SessionsUnsupported, check_session_id
from lineside.runtime.speculative.config import SpeculativeConfig
from lineside.runtime.speculative.proposers import check_speculation, make_proposer
from lineside.runtime.step_plan import StepPlan, prompt_logit_rows
from lineside.runtime.step_runner import StepOutcome, error_line, run_step
from lineside.runtime.structured import DEFAULT_CACHED_GRAMMARS, GrammarCompiler

log = logging.getLogger("lineside.engine")
T = TypeVar("T")
IDLE_CHECK_S = 5.0  # the longest the idle step thread waits before it looks again (sessions may wake it sooner)


@dataclass(frozen=True)
class LoraServing:
    """The adapters an engine serves (by name) and the backend slots they share."""

    adapters: dict[str, LoraAdapter]
    slots: LoraSlotsConfig


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
    kv_dtype: str = ""  # the arena's KV dtype label (fp32 | fp16 | int8 | int4 | fp8); "" when the backend can't say
    kv_bytes_per_token: float = 0.0  # the arena's real bytes per cached position, all layers, K and V, scales
    kv_capacity_bytes: int = 0  # the arena's allocated state buffers
    kv_bytes_used: int = 0  # positions the running requests hold x bytes per token (+ their slots' sink entries)
    spec_draft_tokens_total: int = 0  # proposed tokens the model scored
    spec_accepted_tokens_total: int = 0  # of those, kept
    spec_verify_rows_total: int = 0  # decode rows that verified proposals
    # acceptance rate per verifying row and step: (bucket upper bounds, rows in each bucket, sum of rates)
    spec_acceptance: tuple[tuple[float, ...], tuple[int, ...], float] = ((), (), 0.0)
    requests: dict[FinishReason, int] = field(default_factory=dict)  # finished requests by finish_reason
    sessions: int = 0  # prefill sessions held
    session_pinned_blocks: int = 0  # KV blocks their pinned slots hold
    session_hits: int = 0  # completions that started from a session's KV
    session_tokens_saved: int = 0  # prompt tokens those completions did not compute
    session_prefill_tokens: int = 0  # tokens computed for sessions in idle capacity
    sessions_expired: int = 0
    sessions_evicted: int = 0  # released early: running requests needed the memory
    lora_adapters_served: int = 0  # LoRA adapters this engine serves (each a model)
    lora_slots: int = 0  # the backend's adapter slots
    lora_adapters_loaded: int = 0  # resident in a slot
    lora_adapters_in_use: int = 0  # resident and held by a waiting or running request
    lora_slot_loads: int = 0  # adapters written into a slot so far
    lora_slot_evictions: int = 0  # of those, loads that replaced an idle adapter
    grammars_cached: int = 0  # compiled structured-output grammars held (at most max_cached_grammars)
    grammar_compiles: int = 0  # constraints compiled so far, refusals included (cache misses)
    failed_steps_consecutive: int = 0  # steps in a row whose backend calls all failed (engine_health.py)
    failed_steps_total: int = 0
    engine_failed: bool = False  # past --max-failed-steps (or a fatal error): the engine serves no more


class LLMEngine:
    """What the server talks to: takes requests, runs the step loop, streams each request's events."""

    def __init__(self, bundle: Bundle | str | Path, backend: str | Backend = "auto", *, num_slots: int = 8,
                 max_waiting: int = 256, kv_block_size: int = 16, prefill_chunk: int = 512,
                 prefix_cache: bool = True, threads: int | None = None, kv_blocks: int | None = None,
                 aging_s: float = 10.0, preemption: bool = True, clock: Clock = time.monotonic,
                 speculative: SpeculativeConfig | None = None, session_ttl: float = 30.0, max_sessions: int = 64,
                 session_every: int = 4, session_busy_chunk: int = 32, lora: LoraServing | None = None,
                 max_cached_grammars: int = DEFAULT_CACHED_GRAMMARS,
                 max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS):
        import tokenizers  # noqa: F401 - imported on this thread, not beside other threads' imports

        from lineside.runtime.tokenizer import Tokenizer

        self.health = StepHealth(max_failed_steps)  # checked first: a bad value is refused before anything loads
        # told (from the step thread) once the engine fails, with the failure's line: the server stops being ready
        self.on_failure: Callable[[str], None] | None = None
        self.bundle = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
        if num_slots < 1:
            raise LinesideError(f"num_slots must be ≥ 1, got {num_slots}")
        # The tokenizer (~0.1 s of Rust holding the GIL) loads while onnxruntime builds its session (which
        # releases the GIL): on two cores the two overlap instead of adding up before the server is ready.
        tokenizer = in_thread(Tokenizer.from_bundle, self.bundle, name="lineside-tokenizer")
        self.backend_reason: str | None = None  # why --backend chose it (/health/ready, bench); None: given
        if isinstance(backend, str):  # TensorRT when its engine fits this machine, else onnxruntime CPU
            from lineside.runtime.select import choose_backend

            decisions: list = []
            backend = choose_backend(self.bundle, backend, num_slots, say=log.info, threads=threads,
                                     lora=None if lora is None else lora.slots, decided=decisions.append)
            self.backend_reason = decisions[-1].reason
        self.backend: Backend = backend
        # LoRA adapters (each a served model): which sits in which backend slot, refcounted per request
        self.adapter_slots: AdapterSlots | None = None
        if lora is not None:
            if int(getattr(self.backend, "max_loras", 0) or 0) < lora.slots.max_loras:
                raise LinesideError(f"the {self.backend.name} backend was not started with {lora.slots.max_loras} "
                                    "LoRA slots; create it with lora=LoraSlotsConfig(...)")
            self.adapter_slots = AdapterSlots(lora.adapters, lora.slots.max_loras)
        self.backend_name = self.backend.name
        self.tokenizer: Tokenizer = tokenizer.result()
        self.max_seq_len = int(self.backend.max_seq_len)
        self.model_name = self.bundle.path.name
        self.vocab_size = int(self.backend.vocab_size)
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(self.bundle.config.eos_token_ids)
        self._grammar: GrammarCompiler | None = None
        if max_cached_grammars < 1:  # a request's grammar is compiled when checked, then taken from the cache
            raise LinesideError(f"max_cached_grammars must be >= 1, got {max_cached_grammars}")
        self.max_cached_grammars = max_cached_grammars  # compiled structured-output grammars kept (LRU)
        self._grammar_lock = threading.Lock()
        # Whole-state tensors (DeepSeek-V4 compressor state) cannot be cut at a prefix: no prefix reuse there.
        self.whole_state = has_whole_state(self.backend)
        prefix_ok = prefix_cache and not self.whole_state
        self.arena = KVCacheArena(self.backend.num_slots, self.max_seq_len, kv_block_size, num_blocks=kv_blocks,
                                  prefix_cache=prefix_ok)
        arena_of = getattr(self.backend, "kv_arena_bytes", None)  # the backend's buffers, read once: they never move
        self.kv_bytes: KvArenaBytes | None = arena_of() if callable(arena_of) else None
        # A chunk larger than the backend's prefill profile would be split inside one step anyway.
        chunk = min(int(prefill_chunk), int(getattr(self.backend, "max_prefill", prefill_chunk) or prefill_chunk))
        self.clock = clock
        self.speculative = speculative
        check_speculation(self.backend, speculative)
        proposer = None if speculative is None else make_proposer(speculative, self.bundle, self.backend,
                                                                  threads=threads)
        self._model_proposer = proposer if hasattr(proposer, "propose_rows") else None
        # A session is a prefix of a slot's state kept for a later prompt: whole-state tensors cannot be kept so.
        sessions = None if self.whole_state or max_sessions == 0 else SessionStore(session_ttl, max_sessions)
        self.scheduler = Scheduler(self.arena, prefill_chunk=chunk, aging_s=aging_s, preemption=preemption,
                                   contiguous_slots=self.backend.needs_contiguous_slots, clock=clock,
                                   proposer=proposer,
                                   spec_tokens=0 if speculative is None else speculative.num_tokens,
                                   spec_max_rows=_spec_max_rows(self.backend, speculative),
                                   verify_cost=float(getattr(self.backend, "verify_cost", 1.0)),
                                   verify_token_cost=float(getattr(self.backend, "verify_token_cost", 0.0)),
                                   sessions=sessions, session_every=session_every,
                                   session_busy_chunk=session_busy_chunk)
        if self.adapter_slots is not None:
            self.scheduler.adapter_gate = self._adapter_gate
        self.max_waiting = max_waiting
        self.ready = False
        self.draining = False
        self._incoming: deque[Sequence] = deque()
        self._seqs: dict[str, Sequence] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # where the handles live (their events are pushed there)
        # The scheduler (its sequences, arena and sessions), _seqs, _incoming and the adapter slots: the step thread
        # changes them between backend runs, the event loop's calls (submit, sessions, stats) at any time.
        self._state = FairLock()
        self._wake = threading.Event()  # set by submit, cancel, session calls and stop: the step thread looks again
        self._thread: threading.Thread | None = None
        self._exit = False
        self._step_lock = threading.Lock()  # a backend run and close() never overlap
        self._closed = False
        self._warmed = False
        self._steps = 0
        self._prompt_total = 0
        self._outcomes: dict[FinishReason, int] = {}
        self.step_log: deque[tuple[int, int]] | None = None  # (decode rows, prefill tokens) per step, when set

    # ---- public API -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Warm the backend up (first runs allocate and pick kernels), then start the step thread."""
        if self._thread is not None:
            return
        if self._closed or self.draining:
            raise LinesideError("this engine was stopped; create a new LLMEngine to serve again")
        self._loop = asyncio.get_running_loop()
        # Taken before the warm-up's await: a second start() meanwhile returns instead of starting a second thread.
        thread = self._thread = threading.Thread(target=self._run, name="lineside-step", daemon=True)
        if not self._warmed:
            try:
                await asyncio.to_thread(self.warm_up)
            except BaseException:
                self._thread = None
                raise
        if self.draining:  # stopped or closed during the warm-up: the thread must not start after that
            raise LinesideError("this engine was stopped while it was starting; create a new LLMEngine")
        self.ready = True
        self._exit = False
        thread.start()

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_timeout`` s, cancel the rest."""
        self.draining = True
        self.ready = False
        deadline = self.clock() + drain_timeout
        while self._stepping() and self._seqs and self.clock() < deadline:
            await asyncio.sleep(0.01)
        for seq in list(self._seqs.values()):
            seq.handle.cancel()
        self._kick()
        while self._stepping() and self._seqs:
            await asyncio.sleep(0.01)
        thread, self._thread = self._thread, None
        if thread is not None and thread.ident is not None:  # (not yet started: stop() came during the warm-up)
            self._exit = True
            self._kick()
            await asyncio.to_thread(thread.join)
            await asyncio.sleep(0)  # the events it posted last reach their handles
        for seq in list(self._seqs.values()):  # never started: finish them here
            self._abort(seq, FinishReason.CANCELLED)
        self._drop_sessions()
        await asyncio.to_thread(self.close)

    def _stepping(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Free the backend (after any step still running in the step thread); ``stop`` calls it. Without ``stop``,
        requests still in flight end cancelled and new ones are refused."""
        self.draining = True
        self.ready = False
        self._exit = True
        self._kick()
        with self._step_lock:
            if not self._closed:
                self._closed = True
                self.backend.close()
                if self._model_proposer is not None:
                    self._model_proposer.close()

    @property
    def capacity(self) -> int:
        """Sequences it holds at once: every slot running and ``max_waiting`` waiting (what ``submit`` admits from
        idle). A request of more choices can never be admitted."""
        return self.arena.num_slots + self.max_waiting

    @property
    def failure(self) -> str | None:
        """Why the engine failed (one line), or None while it serves: see engine_health.py."""
        return self.health.failure

    def _refuse_failed(self) -> None:
        if self.health.failure is not None:
            raise EngineFailed(f"the model engine failed ({self.health.failure}) and takes no new requests; retry on "
                               "another instance (the server restarts under a supervisor)")

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request; raises LinesideError if it is malformed, QueueFullError / EngineDraining if refused
        (EngineFailed, one, once the engine failed)."""
        return self.submit_all([req])[0]

    def submit_all(self, reqs: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue every request (a request's n choices) or none: all are checked, then admitted under one look at
        the queue, so a request refused partway never holds queue places that refuse the next one."""
        self._refuse_failed()
        if self.draining:
            raise EngineDraining("the server is shutting down and takes no new requests; retry on another instance")
        self._check_loop()
        ids = [req.request_id for req in reqs]
        if len(set(ids)) < len(ids):
            raise LinesideError("two requests submitted together share a request id; give each its own")
        seqs = [self._sequence(req) for req in reqs]
        with self._state:
            self._refuse_failed()  # again under the lock: the step thread may have failed the engine meanwhile
            if self.draining:  # again under the lock: close() on another thread may have let the step thread go
                raise EngineDraining("the engine was closed and takes no new requests; retry on another instance")
            # Under the lock: the step thread moves requests from _incoming to the scheduler's queue under it, and a
            # count taken halfway missed one. Queued requests that free slots will take at the next step do not
            # wait: the bound counts the rest (else a burst, or an n > 1 request, on an idle engine was refused,
            # and --max-waiting 0 refused every request). All of them fit or none is taken.
            free = self.arena.num_slots - len(self.scheduler.running)
            if len(self._incoming) + len(self.scheduler.waiting) + len(seqs) - free > self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests are already waiting; retry later")
            for seq in seqs:  # last: nothing after the check above refuses, so all are taken
                if seq.req.adapter is not None:
                    assert self.adapter_slots is not None
                    # the adapter's current load, kept until it ends (even if unloaded or replaced meanwhile)
                    seq.lora_namespace = self.adapter_slots.hold(seq.req.adapter)
                    with contextlib.suppress(AdapterSlotsFull):  # every slot in use: it waits for one (_adapter_gate)
                        seq.adapter_slot = self.adapter_slots.acquire(seq.lora_namespace)
                self._seqs[seq.req.request_id] = seq
                self._incoming.append(seq)
        self._kick()
        return [seq.handle for seq in seqs]

    def _sequence(self, req: GenerationRequest) -> Sequence:
        """``req`` checked (LinesideError / UnknownAdapter if malformed) and made into a Sequence not yet queued."""
        validate_request(req, self.vocab_size, self.max_seq_len)
        if req.session_id is not None:
            check_session_id(req.session_id)
        if req.request_id in self._seqs:
            raise LinesideError(f"request id {req.request_id!r} is already running; use a new id")
        if req.adapter is not None and self.adapter_slots is None:
            raise UnknownAdapter(f"adapter {req.adapter!r} is not served here: this engine serves no adapters")
        if not self.arena.fits_ever(len(req.prompt_ids) + min(req.max_tokens, self.max_seq_len - len(req.prompt_ids))):
            raise LinesideError(f"prompt + max_tokens need more KV than the engine's {self.arena.total_blocks} blocks "
                               f"of {self.arena.block_size}; lower max_tokens")
        handle = RequestHandle(req, on_cancel=self._kick, loop=self._loop)
        handle.metrics.arrival = self.clock()
        matcher = (self.grammar.matcher(req.constraint, after=req.constraint_after) if req.constraint is not None
                   else None)
        seq = Sequence(handle, self.tokenizer, self.eos_ids, self.max_seq_len, matcher=matcher)
        if req.prompt_logprobs is not None:
            seq.prompt_rows = prompt_logit_rows(self.vocab_size)
        return seq

    def _check_loop(self) -> None:
        """A started engine hands its events to the event loop that started it: a request submitted from another
        loop (or after that loop closed) would wait for events that never reach it."""
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop.is_closed():
            raise LinesideError("the event loop this engine was started on has closed; stop() the engine before "
                                "its loop ends and create a new LLMEngine on the new loop")
        if running is not None and running is not loop:
            raise LinesideError("this engine was started on another event loop: submit from that loop (from another "
                                "thread, through asyncio.run_coroutine_threadsafe)")

    # ---- prefill sessions ---------------------------------------------------------------------------
    def prefill(self, session_id: str, prompt_ids: list[int], stable: int, *, rank: int = 1,
                cache_salt: str | None = None) -> SessionInfo:
        """Have ``session_id`` cache the KV of ``prompt_ids[:stable]`` (computed in idle capacity; this returns at
        once), lent only to a completion of the same ``cache_salt``. Raises EngineDraining, SessionsUnsupported, SessionLimitError or LinesideError (bad input)."""
        if self.draining:
            raise EngineDraining("the server is shutting down: prefill sessions cannot be made or extended here; "
                                 "send the prompt to another instance")
        self._check_sessions()
        check_session_id(session_id)
        validate_request(GenerationRequest(prompt_ids=list(prompt_ids)), self.vocab_size, self.max_seq_len)
        if not self.arena.fits_ever(len(prompt_ids) + 1):
            raise LinesideError(f"the prompt needs more KV than the engine's {self.arena.total_blocks} blocks of "
                               f"{self.arena.block_size}; shorten it")
        with self._state:
            now = self.clock()
            self.expire_sessions()
            info = self.scheduler.update_session(session_id, list(prompt_ids[:stable]), len(prompt_ids), now, rank,
                                                 salted("", cache_salt))
        self._kick()
        return info

    @property
    def max_lora_rank(self) -> int:
        """The adapter slots' rank (0: the backend has no LoRA graph)."""
        return int(getattr(self.backend, "max_lora_rank", 0) or 0)

    def add_adapter(self, adapter: LoraAdapter, *, replace: bool = False) -> None:
        """Serve ``adapter`` from now on (a runtime load; already read and checked against the slots): requests may
        name it at once; it is written into a slot when the first one runs. ``replace`` (vLLM's load_inplace): a
        served adapter of that name is replaced, its requests in flight finishing on the old weights."""
        slots = self._runtime_slots()
        check_fits(adapter, self.max_lora_rank, self._lora_targets(),
                   "this server's adapter slots (--max-lora-rank)")
        with self._state:
            slots.add(adapter, replace=replace)
        self._kick()

    def remove_adapter(self, name: str) -> None:
        """Stop serving ``name``: new requests naming it are refused (UnknownAdapter); requests already waiting or
        running finish with it, and its slot frees when the last of them ends."""
        slots = self._runtime_slots()
        with self._state:
            slots.remove(name)
        self._kick()  # an idle adapter's slot is emptied at the next step

    def _runtime_slots(self) -> AdapterSlots:
        if self.adapter_slots is None:
            raise LinesideError("this engine has no LoRA adapter slots; start it with lora=LoraServing(...) on a "
                                "bundle built with --max-lora-rank")
        return self.adapter_slots

    def _lora_targets(self) -> tuple[LoraTarget, ...]:
        lg = self.bundle.manifest.lora
        return () if lg is None else tuple(LoraTarget(t) for t in lg.targets)

    def session(self, session_id: str) -> SessionInfo | None:
        """A session's state, or None when there is no such session (never made, expired, released)."""
        self._check_sessions()
        check_session_id(session_id)
        with self._state:
            self.expire_sessions()
            s = self.scheduler.sessions.get(session_id)
            return None if s is None else s.info(self.clock())

    def release_session(self, session_id: str) -> bool:
        """End a session now (its client gave the prompt up); False when there is no such session."""
        self._check_sessions()
        check_session_id(session_id)
        with self._state:
            s = self.scheduler.sessions.get(session_id)
            if s is None:
                return False
            self.scheduler.release_session(s)
            # a completion already here that names it (running on its KV or not) must not keep it alive again
            for seq in self._seqs.values():
                if seq.req.session_id == session_id:
                    seq.session_deleted = True
        self._kick()
        return True

    def expire_sessions(self) -> int:
        """Release the sessions past their TTL (also done each step and at each stats read); how many."""
        with self._state:
            return self.scheduler.expire_sessions(self.clock())

    @property
    def keeps_sessions(self) -> bool:
        """Whether prefill sessions can be kept (not with --max-sessions 0, nor with whole-state tensors)."""
        return self.scheduler.sessions is not None

    def _check_sessions(self) -> None:
        if not self.keeps_sessions:
            why = ("its decode state has whole-state tensors (DeepSeek-V4's compressor state and window are replaced "
                   "each step), which cannot be cut back to a shared prefix" if self.whole_state
                   else "it was started with no sessions (max_sessions 0)")
            raise SessionsUnsupported(f"this engine keeps no prefill sessions: {why}; send the whole prompt to "
                                      "the completion endpoint")

    def _drop_sessions(self) -> None:
        with self._state:
            store = self.scheduler.sessions
            for s in list(store.by_id.values()) if store is not None else []:
                self.scheduler.release_session(s)

    @property
    def grammar(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer, made on first use (about a second: it
        reads the whole vocabulary); its cache makes a repeated constraint cost a copy."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids,
                                                              self.max_cached_grammars)
            return self._grammar

    @property
    def grammar_ready(self) -> bool:
        return self._grammar is not None

    def stats(self) -> EngineStats:
        with self._state:
            return self._stats()

    def _stats(self) -> EngineStats:
        a, s = self.arena, self.scheduler
        store = s.sessions
        if store is not None:
            self.expire_sessions()
        used = a.used_blocks
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting) + len(self._incoming), num_slots=a.num_slots,
            kv_usage=used / a.total_blocks, kv_blocks_used=used, kv_blocks_reserved=a.reserved_blocks,
            kv_blocks_total=a.total_blocks, prefix_cache_hits=a.prefix_hits, prefix_cache_hit_tokens=a.prefix_hit_tokens,
            prompt_tokens_total=self._prompt_total, generated_tokens_total=s.generated_tokens, steps=self._steps,
            preemptions=s.preemptions, spec_draft_tokens_total=s.spec_drafted,
            spec_accepted_tokens_total=s.spec_accepted, spec_verify_rows_total=s.spec_steps,
            spec_acceptance=(ACCEPTANCE_BUCKETS, tuple(s.spec_rate_counts), s.spec_rate_sum),
            **({} if self.kv_bytes is None else dict(
                kv_dtype=self.kv_bytes.dtype, kv_bytes_per_token=self.kv_bytes.bytes_per_token,
                kv_capacity_bytes=self.kv_bytes.capacity_bytes,
                kv_bytes_used=round(a.held_tokens * self.kv_bytes.bytes_per_token
                                    + a.occupied * self.kv_bytes.sequence_bytes / max(1, a.num_slots)))),
            requests=dict(self._outcomes), session_pinned_blocks=s.session_pinned_blocks(),
            failed_steps_consecutive=self.health.consecutive, failed_steps_total=self.health.failed_total,
            engine_failed=self.health.failure is not None,
            **({} if self._grammar is None else dict(
                grammars_cached=self._grammar.cached,
                grammar_compiles=self._grammar.stats.compiled + self._grammar.stats.refused)),
            **({} if self.adapter_slots is None else self.adapter_slots.stats()),
            **({} if store is None else dict(
                sessions=len(store), session_hits=store.hits, session_tokens_saved=store.tokens_saved,
                session_prefill_tokens=store.prefill_tokens, sessions_expired=store.expired,
                sessions_evicted=store.evicted)))

    # ---- the step thread ---------------------------------------------------------------------------
    def _kick(self) -> None:
        """Wake the step thread (safe from any thread)."""
        self._wake.set()

    def _run(self) -> None:
        """The step thread: postprocess a step, plan the next one and start it at once, all in one hold of the
        state lock between two backend runs. A step's events are handed to the event loop just before the next
        step's backend run, so the loop writes them while that step runs (handed earlier, the loop's writes would
        contend with the planning for the GIL)."""
        events: list[tuple[Sequence, TokenEvent]] = []
        done: tuple[StepPlan, StepOutcome] | None = None  # the step just run, to postprocess
        while True:
            self._wake.clear()  # before reading _exit: a stop/close that sets it after this still wakes the wait below
            if self._exit or self._loop_gone():
                break
            try:
                with self._state:
                    if done is not None:
                        events += self._postprocess(*done)
                        done = None
                    self._intake()
                    events += self._retire(self.scheduler.expire())
                    plan = self.scheduler.schedule()
                    if self.adapter_slots is not None:
                        plan.adapter_loads = self.adapter_slots.take_pending()
                self._post(events)
                events = []
                if plan.empty:
                    self._idle()
                    continue
                done = plan, self._execute(plan)
                self._steps += 1
                if self.step_log is not None:
                    self.step_log.append((len(plan.decode), plan.prefill_tokens))
                judgement = self.health.record(done[1].verdict())
                if judgement != Judgement.SERVING:
                    with self._state:  # the failing step's requests end with its error, freeing their slots
                        events += self._postprocess(*done)
                        done = None
                    if self._judge(judgement) == Judgement.FAILED:
                        events += self._fail()
            except Exception as e:  # an engine bug must not leave clients waiting forever
                done = None
                msg = error_line(e)
                with self._state:
                    events += self._end_all(FinishReason.ERROR, msg)
                verdict = StepVerdict(failed=1, error=msg, fatal=isinstance(e, BackendLost))
                if self._judge(self.health.record(verdict)) == Judgement.FAILED:
                    events += self._fail()
                self._post(events)
                events = []
        with self._state:
            if done is not None:  # stopped right after a step: its tokens still reach their requests
                events += self._postprocess(*done)
            events += self._end_all(FinishReason.CANCELLED)  # close() without stop: nothing will step them again
        self._post(events)

    def _end_all(self, reason: FinishReason, error: str | None = None, *,
                 engine_failed: bool = False) -> list[tuple[Sequence, TokenEvent]]:
        """(Under the state lock) end every request in flight, each on its own: one that fails to end can't keep
        the others waiting."""
        events: list[tuple[Sequence, TokenEvent]] = []
        for seq in list(self._seqs.values()):
            with contextlib.suppress(Exception):
                ev = self.scheduler.abort(seq, reason, error)
                if ev is not None:
                    ev.engine_failed = engine_failed
                events += self._retire([(seq, ev)])
        return events

    def _judge(self, judgement: Judgement) -> Judgement:
        """(Step thread) the limit of failed steps reached: the probe decides whether the engine failed."""
        return self.health.judge_probe(self._probe()) if judgement == Judgement.PROBE else judgement

    def _probe(self) -> str | None:
        """(Step thread, after a step) the warm-up's forward on a free slot: None when the backend answers (the
        failing requests were their own), else its error's line. A slot's cached KV is forgotten before it is
        overwritten; with no slot free (sessions hold them), the backend can't be told apart from its requests."""
        with self._state:
            free = [i for i, owner in enumerate(self.arena.owner) if owner is None]
            if not free:
                return "no free slot to probe the backend with"
            slot = free[0]
            self.arena.truncate(slot, 0)  # its prefix-cache entry would name KV the probe overwrites
        ids = [int(self.bundle.config.bos_token_id or 0)] * max(1, min(4, self.max_seq_len - 1))
        try:
            with self._step_lock:
                if self._closed:
                    return "the engine was closed"
                self.backend.reset_slot(slot)
                self.backend.forward(StepBatch.single(slot, ids, 0))
                self.backend.reset_slot(slot)
        except Exception as e:  # noqa: BLE001 - the probe's answer is whether it raises
            return error_line(e)
        log.warning("%d model steps failed in a row, but a probe forward worked: the failing requests were their "
                    "own; the engine keeps serving", self.health.consecutive)
        return None

    def _fail(self) -> list[tuple[Sequence, TokenEvent]]:
        """(Step thread) the engine just failed: stop stepping, refuse new requests, and end the ones still waiting
        or running as refused by a failed engine (a server's 503: retry elsewhere) rather than leave them hanging."""
        failure = self.health.failure
        assert failure is not None
        log.error("the model engine failed and serves no more requests: %s", failure)
        self.ready, self._exit = False, True
        with self._state:
            events = self._end_all(FinishReason.ERROR, f"the model engine failed: {failure}", engine_failed=True)
        if self.on_failure is not None:
            try:
                self.on_failure(failure)
            except Exception:  # noqa: BLE001 - the engine has failed either way; the listener's bug is logged
                log.exception("engine failure listener failed")
        return events

    def _postprocess(self, plan: StepPlan, out: StepOutcome) -> list[tuple[Sequence, TokenEvent]]:
        """(Under the state lock) apply a step's outcome to its sequences; their events, retired where final."""
        return self._retire(self.scheduler.postprocess(plan, out.sampled, out.errors, logprobs=out.logprobs,
                                                       accepted=out.accepted, session_error=out.session_error,
                                                       settle_error=out.settle_error, prompt_logprobs=out.prompt_logprobs))

    def _idle(self) -> None:
        """Wait for work; with sessions held, wake by their next expiry to release their blocks."""
        with self._state:
            store = self.scheduler.sessions
            due = store.next_expiry() if store is not None else None
        # bounded even with nothing due: an event loop closed without stop() is noticed (_loop_gone) and the thread ends
        self._wake.wait(IDLE_CHECK_S if due is None else min(IDLE_CHECK_S, max(0.01, due - self.clock())))

    def _loop_gone(self) -> bool:
        """The event loop the handles live on has closed without stop(): nobody can receive events any more, so the
        step thread ends (else it idled for the life of the process, keeping the engine and its backend alive)."""
        loop = self._loop
        if loop is None or not loop.is_closed():
            return False
        self.draining, self.ready, self._exit = True, False, True
        return True

    def _adapter_gate(self, seq: Sequence) -> bool:
        """(Under the state lock, from ``schedule``) give a waiting request the slot its adapter needs, if one is free
        or idle now; the write is queued and runs before this step's forward calls."""
        assert self.adapter_slots is not None and seq.req.adapter is not None
        try:
            seq.adapter_slot = self.adapter_slots.acquire(seq.lora_namespace)
        except AdapterSlotsFull:
            return False
        return True

    def _intake(self) -> None:
        while self._incoming:
            seq = self._incoming.popleft()
            if seq.status == SequenceStatus.FINISHED:  # ended before it got here (stop, or a failed step)
                continue
            self._prompt_total += len(seq.prompt)
            self.scheduler.add(seq)

    def _retire(self, events: Iterable[tuple[Sequence, TokenEvent | None]]) -> list[tuple[Sequence, TokenEvent]]:
        """The events to hand over (under the state lock); a final one also retires its request here."""
        out = []
        for seq, ev in events:
            if ev is None:  # it had finished already
                continue
            if ev.finish_reason is not None:
                self._outcomes[ev.finish_reason] = self._outcomes.get(ev.finish_reason, 0) + 1
                self._seqs.pop(seq.req.request_id, None)
                if self.adapter_slots is not None and seq.adapter_slot:
                    self.adapter_slots.release(seq.adapter_slot)  # once: a request has one final event
                if self.adapter_slots is not None and seq.req.adapter is not None and seq.lora_namespace:
                    self.adapter_slots.drop(seq.lora_namespace)  # an unloaded load goes with its last request
            out.append((seq, ev))
        return out

    def _post(self, events: list[tuple[Sequence, TokenEvent]]) -> None:
        """Hand events to their handles on the event loop (from the step thread)."""
        loop = self._loop
        if not events or loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is listening any more
            loop.call_soon_threadsafe(_push, events)

    def _abort(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a request from the event loop (stop): its final event goes to its handle at once."""
        with self._state:
            events = self._retire([(seq, self.scheduler.abort(seq, reason, error))])
        _push(events)

    def _execute(self, plan: StepPlan) -> StepOutcome:
        """The step's backend calls and sampling (never beside ``close``)."""
        with self._step_lock:
            if self._closed:
                raise LinesideError("the engine was closed")
            return run_step(self.backend, plan, self._model_proposer)

    def warm_up(self) -> None:
        """One prefill and one decode step on slot 0, then forget it (first runs allocate and pick kernels).
        ``start`` does it unless done before: `serve` calls it on the loading thread, while the web stack
        is still importing, so it is off the path to ready."""
        with self._step_lock:
            if self._warmed:
                return
            be = self.backend
            # a prompt chunk (the int8 prefill graph's first run) and a decode step after it, within the context
            # (a bundle may be built with --max-seq-len 2)
            ids = [int(self.bundle.config.bos_token_id or 0)] * max(1, min(4, self.max_seq_len - 1))
            be.reset_slot(0)
            be.forward(StepBatch.single(0, ids, 0))
            be.forward(StepBatch.single(0, ids[:1], len(ids)))
            be.reset_slot(0)
            self._warmed = True

    def __repr__(self) -> str:
        return f"LLMEngine({self.model_name!r}, backend={self.backend_name}, slots={self.arena.num_slots})"



def _push(events: list[tuple[Sequence, TokenEvent]]) -> None:
    """Event loop: queue each event on its request's handle."""
    for seq, ev in events:
        seq.handle._push(ev)


def in_thread(fn: Callable[..., T], *args: Any, name: str) -> Future[T]:
    """Run ``fn(*args)`` on a daemon thread of its own; the future carries its result or its error."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _spec_max_rows(backend: Backend, spec: SpeculativeConfig | None) -> int | None:
    """Decode rows up to which a step speculates: the config's, else the backend's ``spec_max_rows`` (onnxruntime's
    cpu graph runs each multi-token row as its own call, so beside other rows a verification is a whole extra
    forward), else any."""
    if spec is None:
        return None
    return spec.max_rows if spec.max_rows is not None else getattr(backend, "spec_max_rows", None)
