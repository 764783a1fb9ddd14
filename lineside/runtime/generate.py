"""Single-stream generation and logits: the direct path used by `lineside generate` and `lineside logits`.

Prefill runs the whole prompt in one step (logits at the last position only), then decode
feeds one token per step through the backend's cache. The serving engine batches the same steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lineside.bundle import Bundle, open_bundle
from lineside.errors import LinesideError
from lineside.runtime.backend import Backend, StepBatch, has_whole_state
from lineside.runtime.detokenize import IncrementalDetokenizer
from lineside.runtime.request import FinishReason, check_prompt_ids
from lineside.runtime.sampling import Sampler, SamplingParams
from lineside.runtime.speculative.adaptive import DraftLength
from lineside.runtime.speculative.config import DraftRow, ModelProposer, Proposer, SpeculativeConfig
from lineside.runtime.speculative.proposers import check_speculation, make_proposer
from lineside.runtime.speculative.verify import scorable, verify_drafts
from lineside.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from lineside.runtime.structured import GrammarMatcher


def _rejected(matcher: GrammarMatcher, tok: int) -> LinesideError:
    """The error a stream ends with when its grammar took no sampled token: the server's one line (a
    ConstraintError naming the field, for a grammar past its limits or at text the vocabulary cannot spell)."""
    from lineside.runtime.grammar_failure import grammar_failure
    from lineside.runtime.structured import ConstraintError

    f = grammar_failure(matcher.constraint, tok, matcher.error)
    return ConstraintError(f.message, f.param) if f.client_error else LinesideError(f.message)


def compute_logits(backend: Backend, ids: list[int], mode: str = "prefill", *, slot: int = 0,
                   adapter: int = 0) -> np.ndarray:
    """float32 logits [T, vocab] for every position: one prefill step, or one decode step per token.
    ``adapter``: the LoRA adapter slot the rows use (0: the base model)."""
    check_prompt_ids(ids, backend.vocab_size)
    if len(ids) > backend.max_seq_len:  # decode would run a step per id up to the context first
        raise LinesideError(f"sequence of {len(ids)} tokens exceeds the bundle's max_seq_len {backend.max_seq_len}; "
                            f"give at most {backend.max_seq_len} ids")
    backend.reset_slot(slot)
    if mode == "prefill":
        return backend.forward(StepBatch.single(slot, ids, 0, all_logits=True, adapter=adapter))[0]
    if mode != "decode":
        raise LinesideError(f"--mode {mode!r} is not prefill or decode")
    rows = [backend.forward(StepBatch.single(slot, [t], i, adapter=adapter))[0, 0] for i, t in enumerate(ids)]
    return np.stack(rows)


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = FinishReason.LENGTH
    prompt_tokens: int = 0


class Generator:
    """Loads a bundle and generates for one request at a time (the engine does many at once)."""

    def __init__(self, bundle: Bundle | str | Path, backend: Backend | None = None, threads: int | None = None,
                 speculative: SpeculativeConfig | None = None):
        self.bundle = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
        if backend is None:
            from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

            backend = OnnxRuntimeBackend(self.bundle, num_slots=1, threads=threads)
        self.backend = backend
        self.tokenizer = Tokenizer.from_bundle(self.bundle)
        eos = set(self.tokenizer.eos_token_ids) | set(self.bundle.config.eos_token_ids)
        self.eos_ids = eos
        self.speculative = speculative
        self.adapter = 0  # the backend's LoRA slot every step uses (0: the base model; `generate --lora`)
        self.steps = 0  # decode forwards of the last stream (tokens per step = tokens / steps)
        self.drafted = self.accepted = 0  # proposed and kept tokens of the last stream
        self._proposer: tuple[SpeculativeConfig, Proposer | ModelProposer] | None = None
        self._busy = threading.Lock()  # held while a stream runs the backend (between two of its tokens)
        self._owner: object | None = None  # the stream slot 0's cache belongs to

    def stream(self, prompt_ids: list[int], max_tokens: int = 128, params: SamplingParams | None = None, *,
               stop_at_eos: bool = True, matcher: GrammarMatcher | None = None) -> Iterator[int]:
        """Yield generated token ids one by one (EOS is not yielded). ``matcher``: the output follows its
        grammar and ends when the grammar is complete. The backend's slot 0 holds one stream: a stream started
        later (this thread or another) takes it over, and the earlier one then raises instead of reading the
        other's cache; one left unfinished (abandoned, interrupted) leaves nothing behind."""
        owner, started = object(), False
        inner = self._stream(prompt_ids, max_tokens, params, stop_at_eos=stop_at_eos, matcher=matcher)
        while True:
            with self._busy:  # one forward at a time on slot 0
                if started and self._owner is not owner:
                    raise LinesideError("another stream started on this Generator and took over its cache; a "
                                        "Generator runs one stream at a time (use one per thread)")
                self._owner, started = owner, True
                try:
                    tok = next(inner)
                except StopIteration:
                    self._owner = None
                    return
            yield tok

    def _stream(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None, *,
                stop_at_eos: bool, matcher: GrammarMatcher | None) -> Iterator[int]:
        limit = self.backend.max_seq_len
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise LinesideError(f"max_tokens must be an integer ≥ 1, got {max_tokens!r}")
        check_prompt_ids(prompt_ids, self.backend.vocab_size, limit)
        max_tokens = min(max_tokens, limit - len(prompt_ids))
        sampler = Sampler(params or SamplingParams())
        if self.speculative is not None:  # before the prompt: the MTP proposer keeps what the target computes
            self._ensure_proposer()
        self.backend.reset_slot(0)
        logits = self.backend.forward(StepBatch.single(0, prompt_ids, 0, adapter=self.adapter))[0, -1]
        history = list(prompt_ids)
        pos = len(prompt_ids)
        self.steps, self.drafted, self.accepted = 1, 0, 0
        if self.speculative is not None:
            yield from self._speculate(sampler, logits, history, max_tokens, stop_at_eos, matcher)
            return
        for _ in range(max_tokens):
            allowed = None if matcher is None else matcher.allowed()
            tok = sampler.step(logits, history, len(prompt_ids), allowed=allowed).token
            if matcher is not None and not matcher.accept(tok):
                raise _rejected(matcher, tok)
            if stop_at_eos and tok in self.eos_ids:
                return
            yield tok
            history.append(tok)
            if len(history) - len(prompt_ids) >= max_tokens or (matcher is not None and matcher.finished):
                return
            logits = self.backend.forward(StepBatch.single(0, [tok], pos, adapter=self.adapter))[0, -1]
            pos += 1
            self.steps += 1

    def _speculate(self, sampler: Sampler, logits: np.ndarray, history: list[int], max_tokens: int,
                   stop_at_eos: bool, matcher: GrammarMatcher | None) -> Iterator[int]:
        """As ``stream``, each step verifying the proposer's tokens after the last one (speculative/verify.py);
        under a grammar only the drafts it accepts are proposed."""
        proposer = self._ensure_proposer()
        yield from self._verify_loop(proposer, sampler, logits, history, max_tokens=max_tokens,
                                     stop_at_eos=stop_at_eos, matcher=matcher)

    def _ensure_proposer(self) -> Proposer | ModelProposer:
        """The proposer of ``self.speculative`` (a draft model loads once)."""
        assert self.speculative is not None
        if self.adapter:
            raise LinesideError("speculative decoding does not run with a LoRA adapter; drop --speculative or --lora")
        if self._proposer is None or self._proposer[0] != self.speculative:
            check_speculation(self.backend, self.speculative)
            if self._proposer is not None and hasattr(self._proposer[1], "close"):
                self._proposer[1].close()
            self._proposer = (self.speculative, make_proposer(self.speculative, self.bundle, self.backend))
        return self._proposer[1]

    def _verify_loop(self, proposer: Proposer | ModelProposer, sampler: Sampler, logits: np.ndarray,
                     history: list[int], *, max_tokens: int, stop_at_eos: bool,
                     matcher: GrammarMatcher | None) -> Iterator[int]:
        assert self.speculative is not None
        length = DraftLength(self.speculative.num_tokens, verify_cost=float(getattr(self.backend, "verify_cost", 1.0)),
                             verify_token_cost=float(getattr(self.backend, "verify_token_cost", 0.0)),
                             draft_cost=float(getattr(proposer, "cost", 0.0)))
        prompt_len = len(history)
        whole_state = has_whole_state(self.backend)  # a rejected draft's advance of it is undone

        def grammatical(drafts: list[int]) -> list[int]:
            return drafts if matcher is None or not drafts else drafts[:matcher.validate(drafts)]

        new = [sampler.step(logits, history, prompt_len,
                            allowed=None if matcher is None else matcher.allowed()).token]
        while True:
            for tok in new:
                if matcher is not None and not matcher.accept(tok):
                    raise _rejected(matcher, tok)
                if stop_at_eos and tok in self.eos_ids:
                    return
                yield tok
                history.append(tok)
                if len(history) - prompt_len >= max_tokens or (matcher is not None and matcher.finished):
                    return
            room = min(max_tokens - (len(history) - prompt_len) - 1, self.backend.max_seq_len - len(history))
            k = min(length.budget(proposer.cheap), room)
            drafts, probs, shadow = [], None, []
            if k > 0 and hasattr(proposer, "propose_rows"):
                d = scorable(matcher, proposer.propose_rows([DraftRow(0, list(history), k, sampler, prompt_len)])[0])
                drafts, probs = d.tokens, d.probs
            elif k > 0:
                drafts = grammatical(proposer.propose(history, k))
            elif room > 0 and proposer.cheap:
                shadow = grammatical(proposer.propose(history, 1))
            ids = [history[-1], *drafts]
            saved = self.backend.save_rows([0]) if drafts and whole_state else None  # type: ignore[attr-defined]
            rows = self.backend.forward(StepBatch.single(0, ids, len(history) - 1, all_logits=True))[0]
            self.steps += 1
            if drafts:
                v = verify_drafts(sampler, rows, drafts, history, prompt_len, matcher=matcher, probs=probs)
                if saved is not None and len(v.kept) < len(drafts):  # whole state back to the accepted length
                    self.backend.restore_rows(saved, 0)  # type: ignore[attr-defined]
                    self.backend.forward(StepBatch.single(0, ids[:1 + len(v.kept)], len(history) - 1))
                length.observe(len(drafts), len(v.kept))
                self.drafted += len(drafts)
                self.accepted += len(v.kept)
                new = [*v.kept, v.token]
            else:
                new = [sampler.step(rows[0], history, prompt_len,
                                    allowed=None if matcher is None else matcher.allowed()).token]
                if shadow:  # at draft length 0, a free guess checked against the sample lets it grow back
                    length.observe(1, int(new[0] == shadow[0]))

    def generate(self, prompt: str, max_tokens: int = 128, params: SamplingParams | None = None, *,
                 chat: bool = False) -> GenerationResult:
        tok = self.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
        out = GenerationResult(prompt_tokens=len(ids))
        detok = IncrementalDetokenizer(tok, prompt_ids=ids)
        for t in self.stream(ids, max_tokens, params):
            out.token_ids.append(t)
            out.text += detok.add(t)
        out.text += detok.flush()
        # the stream stops at the context too: that is a length finish, not EOS
        limit = min(max_tokens, self.backend.max_seq_len - len(ids))
        out.finish_reason = FinishReason.LENGTH if len(out.token_ids) >= limit else FinishReason.STOP
        return out
