"""Encode a text with an early stop at a token limit, so refusing a prompt longer than the context costs about
the context's worth of tokenizing, not the whole prompt's (a 660k-character prompt took 5-9 s to refuse).

A long text is counted in pieces cut just before a space or tab that follows a non-space character. For the
pre-tokenizers the project's tokenizers use (GPT-2 byte-level, and ``Split`` regexes of the llama.cpp family:
Llama 3, Qwen2, SmolLM, DeepSeek-V3) such a position is always a pre-token boundary: no alternative that
matches a non-space character goes on into a following space or tab, a match may only *start* with one, and
none looks behind. So each piece encodes to exactly the ids the whole text has there, and the running count
is the true count of the text read so far: stopping once it passes the limit refuses only what cannot fit.
Tokenizers outside that family (SentencePiece normalizers that prepend ``▁`` per call, Metaspace, other
normalizers, added tokens that swallow spaces) are encoded whole instead; :func:`cuts_are_exact` decides,
from the tokenizer's structure and a probe that compares piecewise with whole encodings. A long stretch with
no cut (``abab...``: one pre-token, slow to encode), and any text far longer than the limit, is first bounded
from below by its bytes (ByteCounts) and refused from that when it cannot fit. A text that fits is always encoded whole at the end, so the ids
returned are the tokenizer's own.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from lineside.errors import LinesideError

log = logging.getLogger("lineside.runtime")

# A cut: a space or tab whose previous character is not whitespace (Python's \s covers Unicode White_Space).
_CUT = re.compile(r"(?<=\S)[ \t]")
_PRE_TOKENIZERS = {"ByteLevel", "Split", "Sequence", "Digits", "Whitespace", "WhitespaceSplit", "Punctuation",
                   "BertPreTokenizer"}
_NORMALIZERS = {None, "NFC"}  # NFC never composes across a space; NFKC can turn a character into one
_ANCHORS = ("(?<", "\\b", "\\B", "\\A", "\\z", "\\Z")  # a Split regex that looks behind or anchors can't be cut
_PROBE_WORDS = ["Hello", "world", "it's", "don't", "x1", "42", "3.14", "12345", "a.b", "(ok)", "--", "::",
                "\u00e9t\u00e9", "e\u0301", "\u4e2d\u6587", "\u3072\u3089", "\u041f\u0440\u0438", "\U0001f600",
                "\u00a0", "\n", "\r\n", "\t", "  ", "   ", "\n\n", "'s", "'LL", ".\n", "!\n\n", "_x", "$5", "<|x|>"]


class PromptTooLong(LinesideError):
    """The text has more tokens than the limit: ``tokens`` were counted in its first ``chars_read`` characters."""

    def __init__(self, tokens: int, chars_read: int, limit: int):
        super().__init__(f"the prompt has more than {limit} tokens ({tokens} in its first {chars_read} characters)")
        self.tokens, self.chars_read, self.limit = tokens, chars_read, limit

    def __reduce__(self) -> tuple[Any, ...]:  # crosses the tokenizer worker's process boundary
        return PromptTooLong, (self.tokens, self.chars_read, self.limit)


@dataclass
class TokenBudget:
    """The most tokens a prompt may have, and those counted so far (across a chat prompt's segments)."""

    limit: int
    used: int = 0
    chars: int = 0

    def take(self, tokens: int, chars: int) -> None:
        """Count tokens already encoded (no refusal here: once the work is done the caller's exact count, with
        its precise message, decides; the early stop is for work not yet done)."""
        self.used += tokens
        self.chars += chars


def piece_chars(limit: int) -> int:
    """Characters per counted piece: a text up to this long is encoded whole at once (as cheap as counting)."""
    return max(256, 2 * limit)


class ByteCounts:
    """Every vocabulary entry and added token of a byte-level tokenizer as (byte, count) pairs, for a lower bound on
    the tokens of a stretch of text without encoding it. Tokens partition the stretch's bytes; give byte ``x`` the
    weight ``w[x] = 1 / (most copies of x in one token)`` where it occurs in the stretch; then no token weighs more
    than ``W`` (the heaviest entry), so the stretch has at least ``sum(count[x] * w[x]) / W`` tokens. A run of
    ``abab...`` or ``====...`` is bounded this way far above what the longest token alone gives."""

    def __init__(self, entries: list[bytes]):
        import numpy as np

        self._np = np
        flat = np.frombuffer(b"".join(entries), np.uint8).astype(np.int64)
        owner = np.repeat(np.arange(len(entries), dtype=np.int64), [len(e) for e in entries])
        pairs, n = np.unique(owner * 256 + flat, return_counts=True)  # (entry, byte) pairs, sorted by entry
        self.byte = (pairs % 256).astype(np.intp)
        self.count = n.astype(np.float64)
        first = np.r_[True, pairs[1:] // 256 != pairs[:-1] // 256]
        self.starts = np.flatnonzero(first).astype(np.intp)
        most = np.zeros(256, np.float64)
        np.maximum.at(most, self.byte, self.count)
        self.most = np.maximum(most, 1.0)

    def at_least(self, data: bytes) -> int:
        """Fewest tokens ``data`` (a stretch's UTF-8 bytes) can be split into."""
        np = self._np
        present = np.bincount(np.frombuffer(data, np.uint8), minlength=256).astype(np.float64)
        weight = np.where(present > 0, 1.0 / self.most, 0.0)
        heaviest = np.add.reduceat(weight[self.byte] * self.count, self.starts).max()
        return int(np.ceil(float(present @ weight) / heaviest - 1e-9)) if heaviest > 0 else 0


class CountPlan:
    """How one tokenizer's long texts may be counted: in pieces (``exact_cuts``), and, for a byte-level vocabulary,
    with a lower bound on a long stretch without a cut (ByteCounts, built on first use: ~0.3 s for 49k entries)."""

    def __init__(self, tok: Any, exact_cuts: bool):
        self._tok = tok
        self.exact_cuts = exact_cuts
        self.nfc = tok.normalizer is not None  # (NFC, the only one allowed): the bound holds for ASCII stretches
        self._bytes: ByteCounts | None | bool = False  # False: not built yet

    @classmethod
    def for_tokenizer(cls, tok: Any) -> CountPlan:
        return cls(tok, cuts_are_exact(tok))

    @property
    def bytes(self) -> ByteCounts | None:
        if self._bytes is False:
            entries = byte_level_token_bytes(self._tok) if self.exact_cuts else None
            self._bytes = ByteCounts(entries) if entries else None
        return self._bytes  # type: ignore[return-value]

    def at_least(self, stretch: str) -> int | None:
        """Fewest tokens ``stretch`` can have (None: no bound known for this tokenizer or text)."""
        if self.bytes is None or (self.nfc and not stretch.isascii()):
            return None
        return self.bytes.at_least(stretch.encode("utf-8"))


def encode_within(tok: Any, text: str, budget: TokenBudget | None, plan: CountPlan | None) -> list[int]:
    """``tok.encode(text).ids`` (no special tokens added), or PromptTooLong as soon as the budget is exceeded;
    ``plan`` (:class:`CountPlan`) says whether the text may be counted in pieces first."""
    if budget is None:
        return tok.encode(text, add_special_tokens=False).ids
    size = piece_chars(budget.limit)
    if plan is not None and plan.exact_cuts and len(text) > size:
        counted = budget.used
        if len(text) > 4 * size:  # far longer than the limit needs: its bytes alone may prove it cannot fit
            at_least = plan.at_least(text)  # (~2-10 ms for 331k characters; tokenizing them takes ~1 s)
            if at_least is not None and counted + at_least > budget.limit:
                raise PromptTooLong(counted + at_least, budget.chars + len(text), budget.limit)
        start = 0
        while start < len(text):
            cut = _CUT.search(text, start + size)
            end = cut.start() if cut else len(text)
            piece = text[start:end]
            if len(piece) > 2 * size:  # a long stretch without a cut: slow to encode; bound it from below first
                at_least = plan.at_least(piece)
                if at_least is not None and counted + at_least > budget.limit:
                    raise PromptTooLong(counted + at_least, budget.chars + end, budget.limit)
            n = len(tok.encode(piece, add_special_tokens=False).ids)
            if counted + n > budget.limit:
                raise PromptTooLong(counted + n, budget.chars + end, budget.limit)
            counted += n
            start = end
        ids = tok.encode(text, add_special_tokens=False).ids
        if counted - budget.used != len(ids):  # the probe missed a case: say so (the ids are still exact)
            log.warning("counting this tokenizer's encodings in pieces gave %d tokens, the whole text %d; "
                        "please report it (the early stop may refuse prompts that fit)", counted - budget.used,
                        len(ids))
    else:
        ids = tok.encode(text, add_special_tokens=False).ids
    budget.take(len(ids), len(text))
    return ids


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character each byte is written as in the vocabulary → the byte
    (printable Latin-1 bytes stand for themselves, the other 68 are shifted to U+0100 and up)."""
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in direct]
    table = {chr(b): b for b in direct}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def byte_level_token_bytes(tok: Any) -> list[bytes] | None:
    """The bytes of every vocabulary entry and added token, longest first; None unless the vocabulary is
    byte-level (every entry spelled in GPT-2's byte alphabet) behind a ByteLevel pre-tokenizer."""
    try:
        pre = json.dumps(json.loads(tok.pre_tokenizer.__getstate__()))
        vocab = tok.get_vocab(with_added_tokens=False)
        added = [a.content for a in tok.get_added_tokens_decoder().values()]
    except Exception:  # noqa: BLE001 - nothing to inspect: no bound
        return None
    if '"ByteLevel"' not in pre:
        return None
    table = _byte_decoder()
    if not set("".join(vocab)) <= table.keys():  # a character outside the byte alphabet: not byte-level
        return None
    to_bytes = str.maketrans({c: chr(b) for c, b in table.items()})
    entries = dict.fromkeys(text.translate(to_bytes).encode("latin-1") for text in vocab)
    entries.update(dict.fromkeys(a.encode("utf-8") for a in added))
    return sorted((b for b in entries if b), key=len, reverse=True)


def cuts_are_exact(tok: Any) -> bool:
    """Whether counting ``tok``'s encodings in pieces (see the module doc) gives exactly the whole text's ids:
    a pre-tokenizer and normalizer of the family argued for, no added token that a cut could split or that
    strips the space after it, and a probe text encoded both ways."""
    try:  # each component's own JSON: the whole tokenizer's (vocabulary and merges) costs ~0.1 s to write out
        normalizer = None if tok.normalizer is None else json.loads(tok.normalizer.__getstate__()).get("type")
        pre = None if tok.pre_tokenizer is None else json.loads(tok.pre_tokenizer.__getstate__())
        added = list(tok.get_added_tokens_decoder().values())
    except Exception:  # noqa: BLE001 - a tokenizer we cannot inspect is encoded whole
        return False
    if normalizer not in _NORMALIZERS or not pre or not _pre_tokenizer_ok(pre):
        return False
    if any(a.rstrip or _CUT.search(a.content) for a in added):
        return False
    return _probe(tok, [a.content for a in added[:16]])


def _pre_tokenizer_ok(pre: dict[str, Any]) -> bool:
    kind = pre.get("type")
    if kind not in _PRE_TOKENIZERS:
        return False
    if kind == "Sequence":
        return all(_pre_tokenizer_ok(p) for p in pre.get("pretokenizers") or [])
    if kind == "Split":
        pattern = pre.get("pattern") or {}
        text = pattern.get("Regex", pattern.get("String", ""))
        return isinstance(text, str) and not any(a in text for a in _ANCHORS)
    return True


def _probe(tok: Any, added: list[str]) -> bool:
    """Texts mixing letters, digits, punctuation, scripts, whitespace and the tokenizer's added tokens, encoded
    whole and cut at every cut: the same ids."""
    vocabulary = _PROBE_WORDS + added
    n = len(vocabulary)
    seps = [" ", "  ", "\t", " \t", "", "\n ", " \n", "", "   "]
    for stride in (1, 7, 11):
        words = [vocabulary[(i * stride + i // n) % n] for i in range(2 * n)]
        text = "".join(w + seps[i % len(seps)] for i, w in enumerate(words)) + " end"
        whole = tok.encode(text, add_special_tokens=False).ids
        cuts = [m.start() for m in _CUT.finditer(text)]
        ids: list[int] = []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            ids += tok.encode(text[a:b], add_special_tokens=False).ids
        if ids != whole:
            return False
    return True
