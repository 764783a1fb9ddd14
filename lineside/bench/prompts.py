"""Prompts for a load run: synthetic ones with seeded lengths drawn from a range, or a JSONL file.

Synthetic text is common English words; with a tokenizer (the bundle's, or --tokenizer) each
prompt is cut to exactly the drawn token count, otherwise one word counts as one token (close for
BPE vocabularies on common words).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lineside.errors import LinesideError

_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "not first one their its new after but who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can state "
    "about national out known university united then made under team film year three part well these high "
    "between both since war number great american world people water power system light river road house "
    "music market field small large energy model data engine factory machine sensor signal camera robot line"
).split()


@dataclass(frozen=True)
class Prompt:
    """One prompt: plain text, or chat messages; token count when known; optional per-prompt max_tokens; chat's
    tools (and tool_choice) sent with it, as an agent's requests carry them."""

    text: str
    tokens: int | None = 0  # None: not counted (no tokenizer), unknown rather than 0
    messages: tuple[dict, ...] = ()
    max_tokens: int | None = None
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict | None = None


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise LinesideError(f"no tokenizer.json at {path}; pass --tokenizer PATH/tokenizer.json or leave it out")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust parser raises a bare Exception; its first line says what it met
        raise LinesideError(f"{p}: not a tokenizer the tokenizers library can load ({(str(e).splitlines() or [type(e).__name__])[0]}); "
                            "pass a model's tokenizer.json with --tokenizer") from None


def parse_range(text: str, what: str, high: int) -> tuple[int, int]:
    """'128:512' -> (128, 512); '256' -> (256, 256); MAX at most ``high`` (past it, numpy's draw of the lengths
    raised an int64 overflow, and a schedule or a prompt that size would not fit in memory anyway)."""
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise LinesideError(f"{what} {text!r} is not MIN:MAX with 1 <= MIN <= MAX (e.g. 128:512)")
    if parts[1] > high:
        raise LinesideError(f"{what} {text!r}: MAX is at most {high}; give a smaller range")
    return parts[0], parts[1]


def _cut(tokenizer, ids: list[int], n: int) -> tuple[str, int]:
    """Text of the first n tokens; decode/encode may not round-trip, so re-check and return the real count."""
    text = tokenizer.decode(ids[:n])
    for _ in range(4):
        again = tokenizer.encode(text, add_special_tokens=False).ids
        if len(again) <= n:
            return text, len(again)
        text = tokenizer.decode(again[:n])
    return text, len(tokenizer.encode(text, add_special_tokens=False).ids)


def synthetic(count: int, length_range: tuple[int, int], seed: int = 0, tokenizer=None) -> list[Prompt]:
    """`count` prompts whose token lengths are drawn uniformly from length_range (inclusive), seeded."""
    rng = np.random.default_rng(seed)
    lo, hi = length_range
    lengths = rng.integers(lo, hi + 1, size=count)
    out = []
    for n in lengths:
        words = rng.choice(_WORDS, size=int(n))
        text = " ".join(words)
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            while len(ids) < n:  # a few words may be single tokens; pad with more words until long enough
                text += " " + " ".join(rng.choice(_WORDS, size=int(n - len(ids))))
                ids = tokenizer.encode(text, add_special_tokens=False).ids
            text, n = _cut(tokenizer, ids, int(n))
        out.append(Prompt(text=text, tokens=int(n)))
    return out


def from_jsonl(path: str | Path, tokenizer=None) -> list[Prompt]:
    """Each line: {"prompt": "..."} or {"text": "..."} or {"messages": [...]}, optional "max_tokens", and for chat
    optional "tools" (OpenAI's function tools) and "tool_choice"."""
    p = Path(path)
    # A pipe is a prompts file too (`--prompts-file <(jq ...)`): only a missing path or a directory is refused.
    if not p.exists():
        raise LinesideError(f"prompts file {path} does not exist; pass a JSONL file with one prompt per line")
    if p.is_dir():
        raise LinesideError(f"prompts file {path} is a directory; pass a JSONL file with one prompt per line")
    try:
        lines = p.read_text(encoding="utf-8-sig").splitlines()  # a BOM (Windows editors) is not part of line 1
    except UnicodeDecodeError as e:
        raise LinesideError(f"prompts file {path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                            "UTF-8") from None
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise LinesideError(f"{path}:{lineno}: not valid JSON ({e.msg}); one JSON object per line") from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict):
            raise LinesideError(f"{path}:{lineno}: expected an object with \"prompt\", \"text\" or \"messages\"")
        messages = obj.get("messages") or []
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise LinesideError(f"{path}:{lineno}: \"messages\" must be a list of {{\"role\", \"content\"}} objects")
        messages = tuple(messages)
        key = "prompt" if "prompt" in obj else "text"
        text = obj.get(key)
        if text is None and messages:
            text = "\n".join(_content_text(m.get("content")) for m in messages)
        elif text is not None and not isinstance(text, str):
            raise LinesideError(f"{path}:{lineno}: \"{key}\" must be a string, got {type(text).__name__}; write one "
                                "prompt per line")
        if not isinstance(text, str) or not text:
            raise LinesideError(f"{path}:{lineno}: no \"prompt\", \"text\" or \"messages\" in this line")
        n = len(tokenizer.encode(text, add_special_tokens=False).ids) if tokenizer is not None else None
        mt = obj.get("max_tokens")
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
            raise LinesideError(f"{path}:{lineno}: \"max_tokens\" must be an integer ≥ 1, got {mt!r}")
        tools, choice = _tools(obj, f"{path}:{lineno}")
        out.append(Prompt(text=text, tokens=n, messages=messages, max_tokens=mt, tools=tools, tool_choice=choice))
    if not out:
        raise LinesideError(f"prompts file {path} holds no prompts; write one JSON object per line, "
                            '{"prompt": ...}, {"text": ...} or {"messages": [...]}')
    return out


TOOL_CHOICES = ("none", "auto", "required")


def _tools(obj: dict, where: str) -> tuple[tuple[dict, ...], str | dict | None]:
    """A line's "tools" and "tool_choice", checked as OpenAI's chat API takes them (one line for what is wrong)."""
    tools = obj.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise LinesideError(f'{where}: "tools" must be a list of {{"type": "function", "function": {{"name": ...}}}} '
                            "objects (OpenAI's chat tools)")
    choice = obj.get("tool_choice")
    if choice is not None and not (choice in TOOL_CHOICES or isinstance(choice, dict)):
        raise LinesideError(f'{where}: "tool_choice" must be "none", "auto", "required" or '
                            f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}')
    if choice not in (None, "none") and not tools:
        raise LinesideError(f'{where}: "tool_choice" {choice!r} needs "tools" on the same line')
    return tuple(tools), choice


def _content_text(content: object) -> str:
    """A message's text: a string, or the text parts of OpenAI's list-of-parts content (not its Python repr)."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content
                       if isinstance(part, dict) and part.get("type") == "text")
    return "" if content is None else str(content)


class PromptPool:
    """Hands out prompts in order, wrapping around, so any number of requests can draw from a fixed set."""

    def __init__(self, prompts: list[Prompt]) -> None:
        if not prompts:
            raise LinesideError("no prompts to send")
        self._prompts = prompts
        self._i = 0

    def take(self, n: int) -> list[Prompt]:
        out = [self._prompts[(self._i + k) % len(self._prompts)] for k in range(n)]
        self._i += n
        return out
