"""What the server hands the engine and gets back: requests, token events, handles, per-request timings.

Plain data plus one handle per request: the handle is an async iterator of ``TokenEvent``s that
ends after the event carrying ``finish_reason``, and ``cancel()`` frees the request's KV at the
next engine step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from uuid import uuid4

import numpy as np

from lineside.errors import LinesideError
from lineside.runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from lineside.runtime.structured import Constraint
from lineside.strenum import StrEnum


class Priority(StrEnum):
    """X-Priority: within a mode, high is served before normal before low."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


class Mode(StrEnum):
    """X-Mode: batch requests rank below every realtime priority."""

    REALTIME = "realtime"
    BATCH = "batch"


class FinishReason(StrEnum):
    """Why a request ended; ``stop`` and ``length`` are OpenAI's, the rest end the response with an error."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens (or the context) reached
    CANCELLED = "cancelled"  # the client went away, or the engine stopped
    TIMEOUT = "timeout"  # the request's timeout passed
    ERROR = "error"  # the backend failed on this request


PRIORITIES = tuple(Priority)  # in serving order; "high, normal, low" in messages
MODES = tuple(Mode)


class QueueFullError(LinesideError):
    """The waiting queue is at ``max_waiting``: the server answers 429 / 503 and the client retries later."""


class EngineDraining(LinesideError):
    """The engine is stopping and takes no new requests."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)  # stop strings: matched across tokens, not in the output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's include_stop_str_in_output: the stop string (or stop token's text) that ended the answer is kept in it
    include_stop_str: bool = False
    # vLLM's skip_special_tokens: False writes every special token's text into the answer (True: only keep_special_ids)
    skip_special: bool = True
    priority: Priority = Priority.NORMAL
    mode: Mode = Mode.REALTIME
    timeout_s: float | None = None  # from arrival (submit) to the last token
    speculative: bool = True  # False: never speculate for this request (the engine's --speculative otherwise)
    request_id: str = field(default_factory=lambda: uuid4().hex)
    constraint: Constraint | None = None  # the output follows this grammar and ends when it is complete
    # the grammar starts after this token (a reasoning model's </think>): the text before it is free
    constraint_after: int | None = None
    logprobs: int | None = None  # None: no logprobs; n: each token's logprob and its n most likely alternatives
    # None: none; n: each prompt token's logprob after the first (the model's own, from the logits at the position
    # before it) and its n most likely alternatives, on the request's first event (completions' ``echo``)
    prompt_logprobs: int | None = None
    session_id: str | None = None  # a prefill session whose KV this prompt may extend (sessions.py)
    keep_session: bool = False  # keep this prompt's KV in that session for the next turn (else it ends with it)
    # a next turn will likely extend this answer (a chat): its KV is recomputed for prefix reuse while the engine idles
    # (scheduler.py); False spares that prefill where no next turn comes (a one-off completion)
    settle_answer: bool = True
    adapter: str | None = None  # the LoRA adapter to generate with (a served model name); None: the base model
    # vLLM's cache_salt: only requests with this same salt reuse each other's cached prefix KV (None: the shared
    # pool), so another tenant cannot learn from a prefix hit's speed what someone else's prompt began with
    cache_salt: str | None = None
    # special tokens the text keeps (a tool parser's markers, Mistral's [TOOL_CALLS]); all others are skipped
    keep_special_ids: frozenset[int] = frozenset()


def base_rank(req: GenerationRequest) -> int:
    """0 is served first: realtime high/normal/low = 0/1/2, batch high/normal/low = 3/4/5."""
    return rank_of(req.priority, req.mode)


def rank_of(priority: Priority, mode: Mode) -> int:
    return PRIORITIES.index(priority) + (3 if mode == Mode.BATCH else 0)


EMPTY_PROMPT = "the prompt is empty after tokenization; give some text"  # the server's budget check says it too


def is_int(x: object) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_prompt_ids(ids: Sequence[int], vocab_size: int, max_seq_len: int | None = None) -> None:
    """The prompt rules every entry point shares (engine submit, `lineside generate`/`logits`, the server's
    token-id prompts): not empty, every id in the vocabulary and, given a context, room to generate."""
    if len(ids) == 0:  # (len: a numpy array has no single truth value)
        raise LinesideError(EMPTY_PROMPT)
    odd = [i for i in ids if not is_int(i)]
    if odd:  # int() would have made 5.7 token 5 and "5" token 5: another prompt than the one given
        raise LinesideError(f"token ids must be integers, got {odd[0]!r} ({type(odd[0]).__name__})")
    bad = [i for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise LinesideError(f"token id {bad[0]} is out of vocabulary (valid ids: 0..{vocab_size - 1})")
    if max_seq_len is not None and len(ids) >= max_seq_len:
        raise LinesideError(f"prompt has {len(ids)} tokens; this model's context is {max_seq_len} "
                           "(shorten the prompt)")


def validate_request(req: GenerationRequest, vocab_size: int, max_seq_len: int) -> None:
    """Refuse a malformed request at submit with one line (the server turns it into a 400); a priority or
    mode given as a plain string becomes its enum here."""
    if req.priority not in PRIORITIES:
        raise LinesideError(f"priority {req.priority!r} is not one of {', '.join(PRIORITIES)}")
    if req.mode not in MODES:
        raise LinesideError(f"mode {req.mode!r} is not one of {', '.join(MODES)}")
    req.priority, req.mode = Priority(req.priority), Mode(req.mode)
    check_prompt_ids(req.prompt_ids, vocab_size, max_seq_len)
    req.prompt_ids = [int(i) for i in req.prompt_ids]
    if not is_int(req.max_tokens):
        raise LinesideError(f"max_tokens must be an integer, got {req.max_tokens!r}")
    if req.max_tokens < 0:  # 0: the prompt is computed (scored, cached) and nothing is generated
        raise LinesideError(f"max_tokens must be ≥ 0, got {req.max_tokens}")
    if req.sampling.min_tokens > req.max_tokens:
        raise LinesideError(f"min_tokens ({req.sampling.min_tokens}) must be ≤ max_tokens ({req.max_tokens})")
    if req.timeout_s is not None and not (isinstance(req.timeout_s, (int, float)) and req.timeout_s > 0):
        raise LinesideError(f"timeout must be > 0 seconds, got {req.timeout_s}")
    if any(not isinstance(s, str) or not s for s in req.stop):
        raise LinesideError("stop strings must be non-empty strings")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise LinesideError(f"logprobs must be 0..{MAX_TOP_LOGPROBS} alternatives per token, got {req.logprobs}")
    if req.prompt_logprobs is not None and not (is_int(req.prompt_logprobs)
                                                and 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS):
        raise LinesideError(f"prompt_logprobs must be 0..{MAX_TOP_LOGPROBS} alternatives per token, "
                            f"got {req.prompt_logprobs!r}")
    if req.constraint_after is not None and not (is_int(req.constraint_after) and 0 <= req.constraint_after < vocab_size):
        raise LinesideError(f"constraint_after must be a token id in 0..{vocab_size - 1}, got {req.constraint_after!r}")
    req.sampling.validate()


@dataclass
class TokenEvent:
    text: str  # new complete UTF-8 text since the last event (may be "")
    token_ids: list[int]  # tokens generated since the last event (a final EOS / stop token is not included)
    finish_reason: FinishReason | None  # None while running
    prompt_tokens: int
    completion_tokens: int  # tokens the model generated so far, counting a final EOS / stop token
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token in token_ids, when asked for
    # with ``error``: the request's own input ended it (its grammar past the grammar engine's limits once
    # generating), so servers answer it as the client's error (400 invalid_request_error), not their own failure
    client_error: bool = False
    # with ``client_error``: the OpenAI error code servers answer with (grammar_too_large, grammar_dead_end)
    error_code: str | None = None
    # with ``client_error``: the request field that carried the grammar (the OpenAI error's ``param``)
    error_param: str | None = None
    # with ``error``: the engine failed (engine_health.py), not this request: servers answer 503 so the client
    # retries on another instance, as a refused request would be
    engine_failed: bool = False
    # vLLM's stop_reason, on a STOP event: the stop string that ended the text, or the request's stop token id
    # that was sampled; None when the model's EOS (or a grammar, or anything else) ended it
    stop_reason: int | str | None = None
    # the request's first event, when it asked for prompt_logprobs: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None
    # characters of the text decoded so far (this event's tokens' and earlier) that are held back as a possible
    # stop string's start: a later event sends them before its own text. A reader placing a token that decodes
    # to nothing (a special </think>) in the text counts them as coming before it
    held_chars: int = 0


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) for TTFT / TPOT / ITL; ``token_times`` has one entry per token."""

    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None  # first admitted to a slot
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    prefix_reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    preemptions: int = 0
    spec_drafted: int = 0  # proposed tokens the model scored for this request
    spec_accepted: int = 0  # of those, kept

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


class RequestHandle:
    """One submitted request: ``async for ev in handle`` streams its events; ``cancel()`` stops it."""

    def __init__(self, request: GenerationRequest, on_cancel: Callable[[], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None):
        """``loop``: the event loop the engine hands this handle's events to (None: the engine is not started)."""
        self.request = request
        self._loop = loop
        self.request_id = request.request_id
        self.metrics = RequestMetrics()
        self.finish_reason: FinishReason | None = None
        self.cancel_requested = False
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._on_cancel = on_cancel
        self._done = False

    def cancel(self) -> None:
        """Ask the engine to stop this request; its KV is freed at the next step (a no-op once finished)."""
        if self.finish_reason is None and not self.cancel_requested:
            self.cancel_requested = True
            if self._on_cancel is not None:
                self._on_cancel()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _push(self, ev: TokenEvent) -> None:
        """Engine side (event-loop thread): queue one event."""
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
        self._queue.put_nowait(ev)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        if self._done:  # else a second `async for` ended at once, as if the request had produced nothing
            raise LinesideError(f"request {self.request_id}'s events were already consumed")
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise LinesideError(f"request {self.request_id} is read on another event loop than its engine's, which "
                                "hands its events to its own loop: read it there")
        while not self._done:
            ev = await self._queue.get()
            if ev.finish_reason is not None:
                self._done = True
            yield ev

    async def result(self) -> tuple[str, list[int], TokenEvent]:
        """Consume the whole stream (once): (all text, all token ids, the final event)."""
        text, ids, last = [], [], None
        async for ev in self:
            text.append(ev.text)
            ids.extend(ev.token_ids)
            last = ev
        assert last is not None  # the stream ends with its final event
        return "".join(text), ids, last
