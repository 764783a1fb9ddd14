"""One request's generation state inside the engine: tokens, slot, sampler, detokenizer, stop matcher.

Turns each sampled token into the next ``TokenEvent`` (EOS / stop tokens, stop strings, max
tokens). Only the scheduler changes a sequence (admission, preemption, ``postprocess`` after each
step, finishing), through the fields and methods here; the engine and the step runner only read it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from lineside.runtime.detokenize import IncrementalDetokenizer
from lineside.runtime.grammar_failure import grammar_failure
from lineside.runtime.kv_manager import Namespace, salted
from lineside.runtime.request import FinishReason, GenerationRequest, RequestHandle, TokenEvent, base_rank
from lineside.runtime.sampling import Sampler, TokenLogprob
from lineside.runtime.speculative.adaptive import DraftLength
from lineside.runtime.stop import StopMatcher
from lineside.runtime.structured import GrammarMatcher
from lineside.strenum import StrEnum

_FAILED = (FinishReason.CANCELLED, FinishReason.TIMEOUT, FinishReason.ERROR)  # events that carry no prompt scores


class SequenceStatus(StrEnum):
    """Where a sequence is in its life; the scheduler moves it from one to the next."""

    WAITING = "waiting"  # queued (new or preempted), holds no slot
    PREFILL = "prefill"  # holds a slot; its fill is computed in chunks, one per step
    DECODE = "decode"  # holds a slot; one token per step (plus any proposed tokens to verify)
    FINISHED = "finished"  # ended (stop, length, cancel, timeout, error); slot released


class Sequence:
    def __init__(self, handle: RequestHandle, tokenizer: Any, eos_ids: set[int], max_seq_len: int,
                 matcher: GrammarMatcher | None = None):
        req: GenerationRequest = handle.request
        self.handle, self.req = handle, req
        self.prompt = [int(t) for t in req.prompt_ids]
        self.generated: list[int] = []
        self.tokens = list(self.prompt)  # prompt + generated: the penalty history
        self.max_tokens = min(req.max_tokens, max_seq_len - len(self.prompt))
        # min_tokens holds back EOS even with ignore_eos (vLLM's all_stop_token_ids), and the stop token ids
        self.sampler = Sampler(req.sampling, stop_ids=set(req.stop_token_ids) | set(eos_ids))
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=req.skip_special, prompt_ids=self.prompt,
                                            keep=req.keep_special_ids)
        self.stopper = StopMatcher(req.stop, include=req.include_stop_str)
        self.eos_ids = set(eos_ids)
        self.stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else self.eos_ids)
        self.min_tokens = req.sampling.min_tokens
        self.rank = base_rank(req)
        self.arrival = handle.metrics.arrival
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.computed = 0  # positions whose KV is in the slot (prompt first, then fed tokens)
        self.fill: list[int] = []  # tokens to prefill before decoding
        self.pending: int | None = None  # sampled, not yet fed to the model
        self.replay: deque[int] = deque()  # after a preemption: generated tokens to feed again, one per step
        self.deadline = None if req.timeout_s is None else self.arrival + req.timeout_s
        self.matcher = matcher  # the request's grammar state (structured output), advanced by each token
        self.logprobs = req.logprobs  # alternatives per token to report (None: no logprobs)
        self.prompt_logprobs: list[TokenLogprob] = []  # scored so far (req.prompt_logprobs), prompt token 1 on
        self._prompt_logprobs_sent = False
        self.prompt_rows: int | None = None  # most positions a prompt chunk may take logits at (set at submit)
        self.draft_length: DraftLength | None = None  # set by the scheduler when this request speculates
        self.shadow: int | None = None  # at draft length 0: the 1-token guess to check against the next sample
        self.adapter_slot = 0  # the backend's LoRA slot holding req.adapter (set at submit; 0: the base model)
        self.lora_namespace = ""  # whose KV this is for prefix reuse: "" the base model, else one load of req.adapter
        # its session was ended (DELETE) after it came: keep_session no longer keeps (or re-makes) it when it ends
        self.session_deleted = False

    # ---- scheduling ------------------------------------------------------------------------
    @property
    def cache_namespace(self) -> Namespace:
        """Whose cached prefix KV this request may reuse and offer: its adapter's load, salted by its cache_salt
        (vLLM salts the first block's hash, so no block of a salted chain matches another salt's or none)."""
        return salted(self.lora_namespace, self.req.cache_salt)

    @property
    def reserve_tokens(self) -> int:
        """Positions to reserve at admission: everything it may ever hold."""
        return len(self.prompt) + self.max_tokens

    def start_fill(self) -> tuple[list[int], int]:
        """Tokens to prefill on (re)admission and the most of them the prefix cache may supply.

        A request resumed after preemption prefills its prompt again, then feeds its generated tokens
        back one per decode step (``replay``), so its KV is rebuilt by the same kinds of steps that
        built it the first time and its continuation is the one it would have had."""
        self.fill = list(self.prompt)
        if self.scores_prompt:
            # every prompt position computed here, to give its logits: nothing from the prefix cache or a session
            # (the KV it writes is the prefill graph's, as any prompt's, so it is offered to the cache as theirs)
            self.pending, self.replay, self.prompt_logprobs = None, deque(), []
            return self.fill, 0
        if self.generated:
            self.pending, self.replay = self.generated[0], deque(self.generated[1:])
            return self.fill, len(self.fill)
        self.pending, self.replay = None, deque()
        return self.fill, len(self.fill) - 1  # the last prompt token must run to give logits

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt chunks give logits at every position: the request asked for prompt_logprobs and has not
        generated yet (re-admitted after a preemption, its prompt was scored already)."""
        return self.req.prompt_logprobs is not None and not self.generated and not self._prompt_logprobs_sent

    @property
    def samples(self) -> bool:
        """Whether the next decode step's logits are sampled (not while replaying)."""
        return not self.replay

    def effective_rank(self, now: float, aging_s: float) -> float:
        """Lower is served first; waiting lowers it so nothing starves."""
        return self.rank - (now - self.arrival) / aging_s if aging_s > 0 else float(self.rank)

    # ---- outputs ------------------------------------------------------------------------------
    def _event(self, text: str, ids: list[int], reason: FinishReason | None, error: str | None = None,
               logprob: TokenLogprob | None = None, client_error: bool = False,
               stop_reason: int | str | None = None, error_code: str | None = None,
               error_param: str | None = None) -> TokenEvent:
        scored = None
        if self.req.prompt_logprobs is not None and not self._prompt_logprobs_sent and reason not in _FAILED:
            scored, self._prompt_logprobs_sent = list(self.prompt_logprobs), True
        return TokenEvent(text=text, token_ids=ids, finish_reason=reason, prompt_tokens=len(self.prompt),
                          completion_tokens=len(self.generated), error=error,
                          logprobs=[logprob] if logprob is not None and ids else [], client_error=client_error,
                          error_code=error_code, error_param=error_param,
                          stop_reason=stop_reason, prompt_logprobs=scored, held_chars=self.stopper.waiting)

    def prompt_done(self) -> TokenEvent:
        """The final event of a request for no tokens (max_tokens 0): its prompt is computed (and scored)."""
        return self._event("", [], FinishReason.LENGTH)

    def on_token(self, tok: int, now: float, logprob: TokenLogprob | None = None) -> TokenEvent:
        """Record a sampled token at ``now`` (the engine's clock); returns its event (with ``finish_reason``
        when it ends the request). A grammar that is complete after this token ends the request too.

        Within the first ``min_tokens`` tokens neither stop tokens (the sampler masks them) nor stop strings end
        the request; a grammar does (the sampler lets a complete grammar's stop token through, as vLLM does)."""
        m = self.handle.metrics
        if m.first_token is None:
            m.first_token = now
        m.token_times.append(now)
        self.generated.append(tok)
        self.tokens.append(tok)
        self.pending = tok
        if self.matcher is not None and not self.matcher.accept(tok):  # the mask allows only what it accepts
            return self._grammar_failed(tok)
        past_min = len(self.generated) > self.min_tokens
        if tok in self.stop_ids and (past_min or self.matcher is not None):
            # the model's EOS is no stop_reason (vLLM checks it before the request's stop_token_ids)
            eos = tok not in self.req.stop_token_ids or (tok in self.eos_ids and not self.req.ignore_eos)
            # include_stop_str_in_output keeps the stop token's text (vLLM decodes it then; a skipped special's is "")
            text = self.stopper.feed(self.detok.add(tok), armed=past_min) if self.req.include_stop_str else ""
            return self._last(FinishReason.STOP, text, [], None if eos else tok)
        text = self.stopper.feed(self.detok.add(tok), armed=past_min)
        if self.stopper.stopped:
            return self._event(text, [tok], FinishReason.STOP, logprob=logprob, stop_reason=self.stopper.hit)
        if self.matcher is not None and self.matcher.finished:
            return self._last(FinishReason.STOP, text, [tok], None, logprob)
        if len(self.generated) >= self.max_tokens:
            return self._last(FinishReason.LENGTH, text, [tok], None, logprob)
        return self._event(text, [tok], None, logprob=logprob)

    def _last(self, reason: FinishReason, text: str, ids: list[int], stop_reason: int | None,
              logprob: TokenLogprob | None = None) -> TokenEvent:
        """The event that ends the request: the text still held back goes out, and where it completes a stop
        string (the last token's text behind the first bytes of a character it leaves unfinished, " " of
        " \xf0"), the answer is cut there and ends as that stop, as it would have had the character not begun."""
        text += self._flush()
        if self.stopper.hit is not None:
            reason, stop_reason = FinishReason.STOP, self.stopper.hit
        return self._event(text, ids, reason, logprob=logprob, stop_reason=stop_reason)

    def _grammar_failed(self, tok: int) -> TokenEvent:
        """The final event when the grammar took no token: past the grammar engine's limits (a huge repetition the
        compile's walk did not reach), or at text this vocabulary cannot spell (the mask held only <unk>), it is the
        request's grammar at fault, a client error naming its field; any other rejection is the engine's."""
        f = grammar_failure(self.req.constraint, tok, self.matcher.error if self.matcher is not None else None)
        return self._event(self._flush(), [], FinishReason.ERROR, f.message, client_error=f.client_error,
                           error_code=f.code, error_param=f.param if f.client_error else None)

    def abort(self, reason: FinishReason, error: str | None = None) -> TokenEvent:
        """Final event for cancel / timeout / error (text held back so far is released)."""
        return self._event(self._flush() if reason != FinishReason.CANCELLED else "", [], reason, error)

    def _flush(self) -> str:
        return self.stopper.feed(self.detok.flush()) + self.stopper.flush()
