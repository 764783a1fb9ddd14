"""Refuse a prompt that cannot fit the context before tokenizing it: tokenization holds the GIL for most of
its run (measured: a 2.4 MB text stalls other threads by up to 1 s at a time), so a 30 MB prompt would stall
every request. No token covers more than the longest vocabulary entry's UTF-8 bytes (byte-level ``Ġ``,
SentencePiece ``▁`` and ``<0x..>`` spellings are at least as long as what they encode), and a character is at
least a byte, so a text longer than ``max_seq_len × that`` characters has more tokens than the context holds.
For a byte-level vocabulary the bytes are the entries' own (``Ġ`` is one byte, not its two UTF-8 bytes).
A text under the bound is counted with an early stop while it is tokenized (runtime/bounded_encode)."""

from __future__ import annotations

import weakref
from typing import Any

from lineside.runtime.bounded_encode import PromptTooLong
from lineside.server.errors import APIError

_BOUNDS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (cached per tokenizer)."""
    try:
        return _BOUNDS[tokenizer]
    except (KeyError, TypeError):
        pass
    exact = getattr(tokenizer, "max_token_bytes", None)
    longest = exact() if callable(exact) else None  # a byte-level vocabulary: its entries' own bytes
    if longest is not None:
        _BOUNDS[tokenizer] = max(longest, 1)
        return _BOUNDS[tokenizer]
    longest = 1
    for i in range(int(tokenizer.vocab_size)):
        t = tokenizer.id_to_token(i)
        if t:
            longest = max(longest, len(t.encode("utf-8")))
    try:
        _BOUNDS[tokenizer] = longest
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return longest


def text_bound(tokenizer: Any, max_seq_len: int) -> int:
    """Characters beyond which a text certainly tokenizes to more than ``max_seq_len`` tokens."""
    return int(max_seq_len) * max_token_chars(tokenizer)


MAX_BODY_BYTES = 32 << 20


def body_limit(tokenizer: Any, max_seq_len: int, max_prompts: int = 64) -> int:
    """The largest request body worth reading for this model: its text bound in escaped JSON (up to 6 bytes a
    character) or ``max_prompts`` token-id prompts filling the context, at least 1 MiB, at most 32 MiB; bigger
    bodies get a 413 from their Content-Length before a byte is parsed."""
    wanted = 6 * text_bound(tokenizer, max_seq_len) + max_prompts * int(max_seq_len) * 12 + (64 << 10)
    return min(MAX_BODY_BYTES, max(1 << 20, wanted))


def check_texts(texts: list[str], tokenizer: Any, max_seq_len: int, *, param: str) -> None:
    """400 context_length_exceeded, without tokenizing, when the texts together cannot fit the context."""
    total = sum(len(t) for t in texts)
    bound = text_bound(tokenizer, max_seq_len)
    if total > bound:
        raise APIError(400, f"'{param}' has {total} characters, so at least {total // max_token_chars(tokenizer)} "
                            f"tokens, but the model's context is {max_seq_len} tokens (at most {bound} characters "
                            "can fit); shorten it", "context_length_exceeded", param=param)


def prompt_named(param: str, tools: int = 0) -> str:
    """How a context 400 names the prompt: ``'param'``, or with the tools rendered into it (listed by the chat
    template or described in a system message: their schemas can be most of a short chat's tokens, as OpenAI's
    error counts tokens "in the functions")."""
    if not tools:
        return f"'{param}'"
    return f"'{param}' with the {tools} tool{'' if tools == 1 else 's'} rendered into the prompt"


def shorten(param: str, tools: int = 0, plain: str = "shorten it") -> str:
    """What a context 400 asks the client to cut: ``plain`` without tools, else the messages or the tools."""
    return f"shorten '{param}' or send fewer or shorter tools" if tools else plain


def too_long(e: PromptTooLong, *, param: str, tools: int = 0) -> APIError:
    """The 400 for a prompt found, while tokenizing, to have more tokens than the context leaves room for
    (``tools``: how many tools are rendered into it)."""
    return APIError(400, f"{prompt_named(param, tools)} has more than {e.limit} tokens (its first {e.chars_read} "
                         f"characters already make at least {e.tokens}), but the model's context is {e.limit + 1} "
                         f"tokens, which leaves no room to generate; {shorten(param, tools)}",
                    "context_length_exceeded", param=param)


def chat_texts(body: Any) -> list[str]:
    """Every message's text (string content, text and refusal parts, names) from a ChatCompletionRequest, untouched."""
    out: list[str] = []
    for m in body.messages:
        if isinstance(m.content, str):
            out.append(m.content)
        elif m.content:
            out.extend(t for p in m.content for t in (getattr(p, "text", None), getattr(p, "refusal", None))
                       if isinstance(t, str))
        if m.name:
            out.append(m.name)
    return out


def prompt_texts(body: Any) -> list[str]:
    """The string prompts of a CompletionRequest (token-id prompts are checked by count, not here)."""
    p = body.prompt
    if isinstance(p, str):
        return [p]
    return [x for x in p if isinstance(x, str)]
