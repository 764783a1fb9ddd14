"""A reasoning model's thinking apart from its answer: ``serve --reasoning-parser deepseek_r1`` (vLLM's parser).

DeepSeek-R1 and its Distill models (QwQ, Qwen3 in thinking mode too) write their reasoning, then ``</think>``, then
the answer; R1's chat template opens ``<think>\\n`` in the generation prompt, so the output usually holds only the
closing tag. As vLLM's ``deepseek_r1`` parser: the text before ``</think>`` is the message's ``reasoning_content``
(and ``reasoning``, vLLM's newer name for it), the text after it the ``content``; a ``<think>`` the model writes
itself is dropped; an output that never closes its reasoning is all reasoning (content null). Where the prompt has
already closed it (its last tag is ``</think>``: a template with thinking switched off, an assistant prefill past
it) the whole output is the answer. Tool calls are read from the answer only, and a structured output's grammar
starts after ``</think>`` (``GenerationRequest.constraint_after``), as vLLM applies both with a reasoning parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lineside.errors import LinesideError
from lineside.runtime.stop import partial_suffix

START, END = "<think>", "</think>"
PARSERS = ("none", "deepseek_r1", "auto")  # --reasoning-parser; auto: deepseek_r1 when the template knows the tags


@dataclass(frozen=True)
class ThinkTokens:
    """The tokenizer's ids of ``<think>`` and ``</think>`` (each one token in R1's vocabulary), its
    end-of-sequence ids, which end a chat template's earlier turns, and whether ``</think>`` is a special token
    (``end_hidden``: decoding drops its text, so only its id can end the reasoning)."""

    start_id: int
    end_id: int
    turn_ends: frozenset[int] = frozenset()
    end_hidden: bool = False

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkTokens | None:
        """The tags' ids when both are single tokens of ``tokenizer`` (lineside's Tokenizer), else None."""
        start, end = tokenizer.token_id(START), tokenizer.token_id(END)
        ends = frozenset(int(t) for t in getattr(tokenizer, "eos_token_ids", None) or ())
        if start is None or end is None:
            return None
        is_special = getattr(tokenizer, "is_special", None)
        return cls(int(start), int(end), ends, bool(is_special(int(end))) if is_special is not None else False)

    def thinking_after(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the output begins inside the reasoning: the prompt's last tag is not a ``</think>`` of the turn
        being generated (no tag at all counts as inside, as vLLM's parser assumes R1's reasoning comes first). A
        ``</think>`` with an end-of-sequence token after it closed an earlier, ended turn — Qwen3's template keeps
        the reasoning of a tool loop's earlier steps and opens no ``<think>`` for the next, which the model writes."""
        ended = False
        for t in reversed(prompt_ids):
            if t in self.turn_ends:
                ended = True
            elif t == self.end_id:
                return ended
            elif t == self.start_id:
                return True
        return True


def resolve(name: str, tokenizer: Any, chat_template: str | None) -> ThinkTokens | None:
    """The parser ``serve --reasoning-parser NAME`` runs (None: none). ``auto`` is deepseek_r1 when the chat
    template knows a tag (R1's opens ``<think>``; its first release only cut earlier turns at ``</think>``) and the
    tokenizer has both, else none; deepseek_r1 on a tokenizer without them is one line (as vLLM refuses to start)."""
    if name == "none":
        return None
    think = ThinkTokens.of(tokenizer)
    if name == "auto":
        return think if think is not None and knows_tags(chat_template) else None
    if think is None:
        raise LinesideError(f"--reasoning-parser deepseek_r1: this model's tokenizer has no {START} / {END} tokens "
                            "(it is not a reasoning model such as DeepSeek-R1-Distill); leave the option out")
    return think


def knows_tags(chat_template: str | None) -> bool:
    """Whether a chat template writes or cuts at a reasoning tag (what ``auto`` turns the parser on for)."""
    return START in (chat_template or "") or END in (chat_template or "")


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning handling: the tags, whether its output starts inside the reasoning, and whether the
    response carries the reasoning (vLLM's ``include_reasoning``; false: the answer alone)."""

    think: ThinkTokens
    thinking: bool
    include: bool = True

    @property
    def constraint_after(self) -> int | None:
        """The token a structured output waits for: ``</think>`` while the output starts in the reasoning."""
        return self.think.end_id if self.thinking else None

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.think, self.thinking)


def for_prompt(think: ThinkTokens | None, prompt_ids: Sequence[int], include: bool | None = True) -> Reasoning | None:
    """The request's ``Reasoning`` on a server that parses reasoning (None on one that does not)."""
    if think is None:
        return None
    return Reasoning(think, think.thinking_after(prompt_ids), include is not False)


@dataclass
class ReasoningSplitter:
    """Splits one choice's output, fed as it comes, into (reasoning, answer) pieces: pieces concatenate to what
    ``result`` returns for the whole. Text that may be the start of a tag waits for the next piece."""

    think: ThinkTokens
    thinking: bool
    reasoning_tokens: int = 0  # tokens written inside the reasoning, </think> included (usage's reasoning_tokens)
    _held: str = ""
    _reasoning: list[str] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _closed: bool = False  # the output closed its reasoning (content is "" rather than null when empty)
    _end_counted: bool = False  # the </think> token was seen: reasoning_tokens is final
    _hidden_end: int | None = None  # a hidden </think> was generated this many characters of text from here

    def feed(self, text: str, token_ids: Sequence[int] = (), held: int = 0) -> tuple[str, str]:
        """(reasoning, answer) of the next piece of output (``token_ids``: the tokens it came from; ``held``: the
        characters before them that a stop string holds back, sent with a later piece — ``TokenEvent.held_chars``)."""
        if not self.thinking:
            self._content.append(text)
            return "", text
        self._count(token_ids)
        buf = self._held + text
        self._held = ""
        end, tag = buf.find(END), len(END)
        if self._hidden_end is not None:  # the held-back text before a hidden </think> is arriving
            if len(buf) < self._hidden_end:
                self._hidden_end -= len(buf)
                return self._reason(buf)
            end, tag, self._hidden_end = self._hidden_end, 0, None
        # a special-marked </think> decodes to nothing: its id ends the reasoning here, or, while a stop string
        # holds text back, after that text (it comes before the tag). An ordinary one ends it where its text is.
        elif end < 0 and self.think.end_hidden and self.think.end_id in token_ids:
            if held > 0:
                self._hidden_end = held
                return self._reason(buf)
            end, tag = len(buf), 0
        if end >= 0:
            self.thinking, self._closed = False, True
            reasoning, answer = buf[:end].replace(START, ""), buf[end + tag:]
            self._reasoning.append(reasoning)
            self._content.append(answer)
            return reasoning, answer
        keep = partial_suffix(buf, (START, END))
        reasoning = buf[:len(buf) - keep]
        self._held = buf[len(buf) - keep:]
        # a <think> whose end is held back is dropped once whole; the part before it goes now
        if START in reasoning:
            reasoning = reasoning.replace(START, "")
        self._reasoning.append(reasoning)
        return reasoning, ""

    def _reason(self, text: str) -> tuple[str, str]:
        """All of ``text`` is reasoning: it comes before a hidden ``</think>`` already generated."""
        reasoning = text.replace(START, "")
        self._reasoning.append(reasoning)
        return reasoning, ""

    def _count(self, token_ids: Sequence[int]) -> None:
        """Add the tokens written inside the reasoning: those up to and including the ``</think>`` token (a piece of
        several tokens may go on past it); without that token (a tag spelled in ordinary tokens) every token fed
        while the text has not closed the reasoning."""
        if self._end_counted:
            return
        ids = list(token_ids)
        if self.think.end_id in ids:
            self._end_counted = True
            ids = ids[:ids.index(self.think.end_id) + 1]
        self.reasoning_tokens += len(ids)

    def close(self) -> tuple[str, str]:
        """The end of the output: text held back as a possible tag is reasoning after all."""
        held, self._held = self._held, ""
        if held:
            self._reasoning.append(held)
        return held, ""

    def result(self) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of the whole output, as vLLM's parser returns them: reasoning None when the
        output started in the answer; content None when nothing (or nothing but ``</think>``) came after it."""
        reasoning = "".join(self._reasoning) if (self._reasoning or self._closed or self.thinking) else None
        content = "".join(self._content)
        return reasoning, (content or None)
