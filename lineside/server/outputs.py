"""What a response makes of each choice's events besides plain text: a reasoning model's thinking apart from its
answer (``reasoning``), tool calls parsed out of the answer (``tool_calls``), logprobs in OpenAI's shape, and the
finish reason ``tool_calls`` (``stop`` for a call a named tool_choice forced, as OpenAI's).

``OutputOptions`` is decided once per request from its fields; each choice gets a ``ChoiceOutput`` that
turns its events into stream chunks, or at the end into the message, the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lineside.runtime.request import FinishReason, TokenEvent
from lineside.runtime.sampling import TokenLogprob
from lineside.server import sse
from lineside.server.logprobs import LogprobFormatter, TextOffsets, joined
from lineside.server.reasoning import Reasoning
from lineside.server.tool_calls import CallFormat, Tool, ToolCallStream

_ANSWERED = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass(frozen=True)
class Echo:
    """Completions' ``echo``: the prompt as it goes in front of a choice's text, and its first token (the one no
    logprob scores)."""

    text: str
    first: int


@dataclass(frozen=True)
class OutputOptions:
    chat: bool
    call_format: CallFormat | None = None  # None: the text is the answer (no tools, or tool_choice none)
    tools: tuple[Tool, ...] = ()
    named: str | None = None  # the function a named tool_choice calls
    max_calls: int | None = None  # parallel_tool_calls false: 1
    top_logprobs: int | None = None  # None: no logprobs
    formatter: LogprobFormatter | None = None
    reasoning: Reasoning | None = None  # --reasoning-parser: the thinking apart from the answer (None: off)
    echo: bool = False  # completions' echo: each choice's prompt in front of its text (keys the response cache)
    chat_echo: str = ""  # chat's echo (vLLM's): the trailing assistant message's text in front of each answer
    prompt_logprobs: int | None = None  # vLLM's: alternatives per scored prompt token (None: not asked for)


class ChoiceOutput:
    """One choice's running output."""

    def __init__(self, options: OutputOptions, echo: Echo | None = None):
        """``echo``: completions' echo, the prompt that goes in front of the text (and its logprobs)."""
        self.options = options
        self.echo = echo
        self.prompt_logprobs: list[TokenLogprob] = []  # the echoed prompt's, from the engine's first event
        self._echoed = False  # streamed: the prompt's chunk is out
        self._prompt_sent = False  # streamed: the prompt_logprobs are out (or not this choice's to send)
        self.calls = (ToolCallStream(options.call_format, options.tools, options.named, options.max_calls)
                      if options.call_format is not None else None)
        self.reasoning = options.reasoning.splitter() if options.reasoning is not None else None
        self.logprobs: list[TokenLogprob] = []
        # completions' text_offset: where the next token starts in the text (after an echoed prompt)
        self._offsets = TextOffsets(len(echo.text) if echo is not None else 0)

    @property
    def wants_logprobs(self) -> bool:
        return self.options.top_logprobs is not None and self.options.formatter is not None

    def _logprobs_json(self, lps: Sequence[TokenLogprob], *, whole: bool = False) -> Any:
        """The logprobs block for ``lps`` (None when not asked for). A stream chunk without tokens has none; a
        ``whole`` answer has one even when empty (the model ended at once), as vLLM and OpenAI send it: a client
        reads ``logprobs.content`` / ``.tokens`` of every answer it asked logprobs for."""
        o = self.options
        if not self.wants_logprobs or not (lps or whole):
            return None
        assert o.formatter is not None and o.top_logprobs is not None
        if o.chat:
            return {"content": o.formatter.chat(lps, o.top_logprobs), "refusal": None}
        return o.formatter.completion(lps, o.top_logprobs, self._offsets)

    def _split(self, event: TokenEvent) -> tuple[str, str]:
        """(reasoning, answer) text of one event (all answer without a reasoning parser)."""
        if self.reasoning is None:
            return "", event.text
        reasoning, text = self.reasoning.feed(event.text, event.token_ids, event.held_chars)
        if event.finish_reason is not None:
            reasoning += self.reasoning.close()[0]
        return reasoning, text

    def prompt_block(self) -> list[Any] | None:
        """vLLM's ``prompt_logprobs`` of this choice's prompt (None when not asked for)."""
        o = self.options
        if o.prompt_logprobs is None or o.formatter is None:
            return None
        return o.formatter.prompt(self.prompt_logprobs, o.prompt_logprobs)

    def _prompt_chunk(self, writer: sse.ChunkWriter, index: int, event: TokenEvent) -> list[str]:
        """Streamed: the prompt_logprobs in a chunk of their own before the first event's text (the first chunk
        carrying them; chat: once a response, top-level as its non-streamed body has them), with the echoed prompt."""
        if self._prompt_sent or event.prompt_logprobs is None or self.options.prompt_logprobs is None:
            return []
        self._prompt_sent = True
        if self.options.chat and not writer.claim_prompt_logprobs():
            return []
        self.prompt_logprobs = event.prompt_logprobs
        echo = ""
        if self.echo is not None and not self._echoed:
            self._echoed, echo = True, self.echo.text
        return [writer.text(index, echo, self._echo_logprobs() if echo else None, prompt_logprobs=self.prompt_block())]

    def _echo_logprobs(self) -> Any:
        """The echoed prompt's logprobs block (None when logprobs were not asked for)."""
        o = self.options
        if self.echo is None or not self.wants_logprobs:
            return None
        assert o.formatter is not None and o.top_logprobs is not None
        return o.formatter.echoed_prompt(self.echo.first, self.prompt_logprobs, o.top_logprobs)

    def chunks(self, writer: sse.ChunkWriter, index: int, event: TokenEvent) -> list[str]:
        """The stream chunks for one event (reasoning, text, tool-call deltas, logprobs), before any finish chunk;
        with echo, the first one's prompt goes first in a chunk of its own, as vLLM streams it."""
        out = self._prompt_chunk(writer, index, event) if event.finish_reason in (None, *_ANSWERED) else []
        if self.options.chat_echo and not self._echoed and event.finish_reason in (None, *_ANSWERED):
            self._echoed = True  # the continued message's text, in a chunk of its own after the role's (vLLM's)
            out.append(writer.text(index, self.options.chat_echo))
        if self.echo is not None and not self._echoed and event.finish_reason in (None, *_ANSWERED):
            self._echoed = True
            self.prompt_logprobs = event.prompt_logprobs or []
            out.append(writer.text(index, self.echo.text, self._echo_logprobs()))
        lp = self._logprobs_json(event.logprobs)
        reasoning, text = self._split(event)
        if reasoning and self.options.reasoning is not None and self.options.reasoning.include:
            out.append(writer.reasoning(index, reasoning, lp))
            lp = None
        if self.calls is None:
            return [*out, writer.text(index, text, lp)] if text or lp is not None else out
        content, deltas = self.calls.feed(text) if text else ("", [])
        if event.finish_reason is not None:
            more, tail = self.calls.close()  # drops the calls that turn out malformed: this event's deltas too
            standing = len(self.calls.calls)
            content, deltas = content + more, [d for d in deltas if d.index < standing] + tail
        if content:
            out.append(writer.text(index, content, lp))
            lp = None
        for d in deltas:  # one entry a chunk, as OpenAI streams them: a client may read delta.tool_calls[0] only
            out.append(writer.tool_calls(index, [d.openai()], lp))
            lp = None
        if lp is not None:  # the tokens' text is held back (a call may be starting): their logprobs go now
            out.append(writer.text(index, "", lp))
        return out

    def collect(self, event: TokenEvent) -> None:
        """Non-streamed: keep the event's logprobs for the message (and split its reasoning off)."""
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if self.wants_logprobs:
            self.logprobs.extend(event.logprobs)
        if self.reasoning is not None:
            self._split(event)

    def message(self, text: str) -> tuple[dict[str, Any], Any]:
        """(the chat message, its logprobs) of a whole non-streamed answer (``text``: all of it; with a reasoning
        parser the answer is what ``collect`` split off)."""
        msg: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.result()
            include = self.options.reasoning is not None and self.options.reasoning.include
            msg = {"role": "assistant", "content": text, "reasoning_content": reasoning if include else None,
                   "reasoning": reasoning if include else None, "refusal": None}
            text = text or ""
        if self.calls is not None:
            content, calls = self.calls.finish(text)
            msg["content"] = content if content or msg["content"] is not None else None  # null stays null
            if calls:
                msg["tool_calls"] = [c.openai() for c in calls]
        if self.options.chat_echo:
            msg["content"] = self.options.chat_echo + (msg["content"] or "")
        return msg, self._logprobs_json(self.logprobs, whole=True)

    def text_logprobs(self) -> Any:
        """Non-streamed completions: the whole choice's logprobs block (an echoed prompt's first)."""
        block = self._logprobs_json(self.logprobs, whole=True)
        head = self._echo_logprobs()
        return block if head is None else joined(head, block)

    def text(self, parts: list[str]) -> str:
        """Non-streamed completions: the choice's text (behind the echoed prompt)."""
        return (self.echo.text if self.echo is not None else "") + "".join(parts)

    def finish_reason(self, reason: FinishReason | str) -> str:
        """``tool_calls`` when the answer ended with calls (as OpenAI reports it), else the engine's reason. A call
        forced by a named tool_choice ends with ``stop``, as OpenAI (and vLLM, to match it) ends it."""
        if self.calls is not None and self.calls.calls and reason == FinishReason.STOP and self.options.named is None:
            return "tool_calls"
        return str(reason)
