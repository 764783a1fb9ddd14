"""Tokenizer and chat template from a bundle's ``tokenizer/`` directory.

Encoding uses the ``tokenizers`` library on the bundle's tokenizer.json; the chat template is
the checkpoint's own Jinja template rendered in a sandbox, as transformers does.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lineside.errors import BundleError, LinesideError
from lineside.runtime.bounded_encode import CountPlan, TokenBudget, byte_level_token_bytes, encode_within

log = logging.getLogger("lineside.runtime")

if TYPE_CHECKING:
    from lineside.bundle import Bundle
    from lineside.runtime.chat_template import TemplateLimits


class Tokenizer:
    """Text ↔ ids plus the chat template; plain data in, plain data out."""

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> Tokenizer:
        """The bundle's tokenizer: its ``tokenizer/`` files plus the manifest's BOS/EOS and chat template. A
        DeepSeek-V4 bundle whose checkpoint has no chat template (V4 ships a Python encoder instead) gets the shipped
        port of that encoder's format, ``builtin:deepseek_v4``; a checkpoint's own template still wins."""
        tok = cls(bundle.tokenizer_dir, bundle.manifest.tokenizer)
        if not tok.chat_templates and bundle.architecture == "deepseek_v4":
            from lineside.runtime.chat_template import load_chat_template

            tok.chat_template = load_chat_template("builtin:deepseek_v4")
        return tok

    def __init__(self, tok_dir: Path, manifest_tok: dict[str, Any] | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        tok_dir = Path(tok_dir)
        tj = tok_dir / "tokenizer.json"
        if not tj.is_file():
            raise BundleError(f"{tok_dir}: tokenizer.json missing; rebuild the bundle")
        try:
            self._tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # the Rust parser raises plain Exception; its message is one line
            raise BundleError(f"{tj}: not a tokenizer the tokenizers library can load ({str(e).splitlines()[0]}); "
                              "rebuild the bundle from a checkpoint with a valid tokenizer") from None
        cfg: dict[str, Any] = {}
        tc = tok_dir / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise BundleError(f"{tc}: not valid JSON ({e}); rebuild the bundle") from None
        if not isinstance(cfg, dict):
            raise BundleError(f"{tc}: not a JSON object; rebuild the bundle")
        info = _checked_record(manifest_tok)
        named = _named_templates(cfg.get("chat_template"), tok_dir)
        default = _template_text(info.get("chat_template") or cfg.get("chat_template"), tok_dir)
        self.chat_template = default  # the "default" template; setting it (--chat-template) drops the named ones
        self.chat_templates = {**({"default": default} if default else {}),
                               **{k: v for k, v in named.items() if k != "default"}}
        self.bos_token_id: int | None = info.get("bos_token_id")
        self.eos_token_ids: list[int] = list(info.get("eos_token_ids") or [])
        self.add_bos: bool = bool(info.get("add_bos_token", cfg.get("add_bos_token", False)))
        self.bos_token = self._token_text(cfg.get("bos_token"), self.bos_token_id)
        eos_first = self.eos_token_ids[0] if self.eos_token_ids else None
        self.eos_token = self._token_text(cfg.get("eos_token"), eos_first)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._compiled = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a tokenizer worker process gets a copy): the compiled template and the text-only tokenizer
        (its encode_special_tokens flag does not survive pickling) are rebuilt on first use."""
        state = {**self.__dict__, "_compiled": None}
        state.pop("_text_tok", None)
        state.pop("_control_cache", None)
        state.pop("_plan_cache", None)  # keyed by object id: decided again in the process that gets the copy
        state.pop("_prepends_cache", None)
        return state

    @property
    def chat_template(self) -> str | None:
        """The template a chat without tools renders (the checkpoint's "default")."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, text: str | None) -> None:
        self._chat_template = text
        self.chat_templates = {"default": text} if text else {}

    def template_for(self, tools: list[dict[str, Any]] | None) -> str | None:
        """The bundle's template that renders a chat: its "tool_use" one when the chat has tools (as transformers'
        apply_chat_template and vLLM pick it for Hermes-2-Pro or Command-R), else the default."""
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        return self.chat_template

    def _token_text(self, v: Any, tid: int | None) -> str | None:
        if isinstance(v, dict):
            return v.get("content")
        if isinstance(v, str):
            return v
        return self._tok.id_to_token(tid) if tid is not None else None

    # ---- encode / decode -----------------------------------------------------------------
    def encode(self, text: str, add_special: bool | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids; BOS prepended when the model wants it (and the text doesn't already start with it).
        ``max_tokens``: raise PromptTooLong as soon as the text is known to have more (bounded_encode)."""
        budget = None if max_tokens is None else TokenBudget(max_tokens)
        ids = encode_within(self._tok, text, budget, plan=self._count_plan(self._tok, budget))
        add = self.add_bos if add_special is None else add_special
        if add and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
            if budget is not None:
                budget.take(1, 0)
        return ids

    def _count_plan(self, tok: Any, budget: TokenBudget | None) -> CountPlan | None:
        """How ``tok`` (this tokenizer or its text-only twin) counts long texts (bounded_encode); decided once."""
        if budget is None:
            return None
        cache = self.__dict__.setdefault("_plan_cache", {})
        if id(tok) not in cache:
            cache[id(tok)] = CountPlan.for_tokenizer(tok)
            if not cache[id(tok)].exact_cuts:
                log.info("this tokenizer is not counted in pieces: a long prompt is tokenized whole before "
                         "its length is checked")
        return cache[id(tok)]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def warm_count_plan(self) -> None:
        """Build what counting a long prompt needs now (bounded_encode's plan and byte counts: about a second)."""
        plan = self._count_plan(self._tok, TokenBudget(1))
        if plan is not None:
            plan.at_least("warm up")

    def max_token_bytes(self) -> int | None:
        """The most bytes one token stands for, when the vocabulary is byte-level (else None: not known here)."""
        if "_max_token_bytes" not in self.__dict__:
            entries = byte_level_token_bytes(self._tok)
            self._max_token_bytes = len(entries[0]) if entries else None
        return self._max_token_bytes

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one token of the vocabulary (an added token such as ``</think>``)."""
        return self._tok.token_to_id(text)

    def is_special(self, i: int) -> bool:
        return i in self._special_ids

    @property
    def _special_ids(self) -> set[int]:
        if not hasattr(self, "_special_cache"):
            self._special_cache = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return self._special_cache

    # ---- chat ------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *, chat_template: str | None = None,
                            template_kwargs: dict[str, Any] | None = None,
                            template_limits: TemplateLimits | None = None) -> str:
        """Render messages with the model's template (OpenAI-style role/content dicts); ``tools`` (OpenAI's
        function list) is passed to templates that have a tool section, as transformers does. ``chat_template``:
        another template's text to render with (``--chat-template``, a request's); ``template_kwargs``: extra
        variables for the template (a request's ``chat_template_kwargs``); ``template_limits``: ``chat_template`` is
        a request's, rendered in the bounded sandbox (runtime/chat_template.render_bounded)."""
        template = chat_template or self.template_for(tools)
        messages = _reasoning_aliased(_developer_as_system(messages, template))
        if not template:
            # No template: a plain transcript the model can still continue.
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            return text + ("assistant:" if add_generation_prompt else "")
        bounded = template_limits if chat_template else None
        compiled = self._compiled_template(template, chat_template is None, bounded)
        # tools=None when there are none and documents=None unless the request sends some, as transformers renders (a
        # template may test `tools is not none`, `documents is not none`)
        variables = {"documents": None, **(template_kwargs or {}), "messages": messages, "tools": tools or None,
                     "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token or "",
                     "eos_token": self.eos_token or ""}
        try:
            if bounded is not None:
                from lineside.runtime.chat_template import render_bounded

                return render_bounded(compiled, bounded, variables)
            return compiled.render(**variables)
        except LinesideError:
            raise
        except Exception as e:  # jinja raises many types; the user sees one line
            raise LinesideError(f"chat template failed on these messages: {e}") from None

    def _compiled_template(self, template: str, own: bool, limits: TemplateLimits | None = None) -> Any:
        """Compiled once per template text and sandbox (the bundle's and a few given ones, newest kept)."""
        from lineside.runtime.chat_template import ChatTemplateError, compile_template

        with _TEMPLATE_LOCK:  # request threads share the tokenizer
            if self._compiled is None:
                self._compiled = {}
            key = (template, limits)
            compiled = self._compiled.get(key)
            if compiled is None:
                try:
                    compiled = compile_template(template, "the bundle's chat template" if own else "chat template",
                                                limits)
                except ChatTemplateError as e:
                    raise (BundleError(f"{e}; rebuild the bundle or serve with --chat-template") if own
                           else e) from None
                if len(self._compiled) >= _COMPILED_TEMPLATES:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[key] = compiled
            return compiled

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                    max_tokens: int | None = None, *, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    template_limits: TemplateLimits | None = None) -> list[int]:
        """``continue_final_message``: the prompt ends inside the last message (an assistant prefill the
        model continues), cut as transformers' apply_chat_template does. Special-token text inside a
        message (``<|im_start|>`` typed by a user) is encoded as text; only the template's markup is special.
        ``tools``: OpenAI's function list, for templates with a tool section. ``max_tokens``: as for encode.
        ``chat_template`` / ``template_kwargs`` / ``template_limits``: as for apply_chat_template."""
        messages, literals = self._mask_special_text(messages, chat_template or self.template_for(tools))
        text = self.apply_chat_template(messages, add_generation_prompt and not continue_final_message, tools,
                                        chat_template=chat_template, template_kwargs=template_kwargs,
                                        template_limits=template_limits)
        if continue_final_message:
            text = _cut_after_final(text, str(messages[-1].get("content") or ""))
        return self._chat_ids(text, literals, max_tokens)

    def _chat_ids(self, text: str, literals: list[str], max_tokens: int | None = None) -> list[int]:
        # The template already wrote BOS if the model wants one.
        budget = None if max_tokens is None else TokenBudget(max_tokens)
        ids = self._encode_marked(text, literals, budget)
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id) \
                and not (self.bos_token and text.startswith(self.bos_token)):
            ids = [self.bos_token_id, *ids]
            if budget is not None:
                budget.take(1, 0)
        return ids

    # ---- stable prefixes (prefill sessions) ------------------------------------------------------------
    def stable_chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                        chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                        template_limits: TemplateLimits | None = None) -> list[int]:
        """The leading ids of ``encode_chat(messages)`` that every later chat extending the last message's text
        (or adding messages after it) shares: the rendering up to the end of that text, without the trailing
        tokens a continuation could re-tokenize. What a prefill session caches."""
        masked, literals = self._mask_special_text(messages, chat_template or self.template_for(tools))
        opts: dict[str, Any] = {"chat_template": chat_template, "template_kwargs": template_kwargs,
                                "template_limits": template_limits}
        full = self.apply_chat_template(masked, True, tools, **opts)
        last = {**masked[-1], "content": str(masked[-1].get("content") or "") + _GROWS}
        grown = self.apply_chat_template([*masked[:-1], last], True, tools, **opts)
        text = full[:_common_prefix(full, grown)]  # where the last message's text could go on
        return _stable_ids(text, lambda t: self._chat_ids(t, literals), lambda t: self._encode_marked(t, literals))

    def stable_text_ids(self, text: str) -> list[int]:
        """The leading ids of ``encode(text)`` that ``encode(text + anything)`` keeps (a completion prompt's text
        is raw: a special token's opening half at the end is held back too)."""
        added = [t.content for t in self._tok.get_added_tokens_decoder().values() if len(t.content) > 1]
        cut = max((k for t in added for k in range(1, len(t)) if text.endswith(t[:k])), default=0)
        return _stable_ids(text[:len(text) - cut], self.encode,
                           lambda t: self._tok.encode(t, add_special_tokens=False).ids)


    # ---- special-token text inside messages ------------------------------------------------------
    def _control_text(self, role: str, chat_template: str | None = None) -> re.Pattern[str] | None:
        """Matches the control-token texts that must be plain text in a ``role`` message (longest first): every
        special token, and in all but assistant messages also the added tokens the chat template writes (R1's
        ``<｜User｜>`` is not marked special); assistant text keeps those (R1's template splits on ``</think>``)."""
        template = chat_template or self.chat_template
        key = ("assistant" if role == "assistant" else "other", None if role == "assistant" else template)
        cache = self.__dict__.setdefault("_control_cache", {})
        pattern = cache.get(key, False)
        if pattern is False:
            added = self._tok.get_added_tokens_decoder().values()
            texts = {t.content for t in added if t.content and (t.special or (
                key[0] == "other" and template and t.content in template))}
            ordered = sorted(texts, key=len, reverse=True)
            pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
            with _TEMPLATE_LOCK:
                if len(cache) >= 2 * _COMPILED_TEMPLATES:
                    cache.pop(next(iter(cache)))
                cache[key] = pattern
        return pattern

    def _mask_special_text(self, messages: list[dict[str, Any]],
                           chat_template: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
        """Messages whose control-token texts are replaced by markers the template passes through untouched
        (two Unicode noncharacters around an index), and the texts in marker order."""
        literals: list[str] = []

        def mark(m: re.Match[str]) -> str:
            literals.append(m.group(0))
            return f"{_MARK_OPEN}{len(literals) - 1}{_MARK_CLOSE}"

        out = []
        for msg in messages:
            d = dict(msg)
            pattern = self._control_text(str(d.get("role", "")), chat_template)
            for key in ("content", "name"):
                v = d.get(key)
                if isinstance(v, str):
                    if _MARK_OPEN in v or _MARK_CLOSE in v:  # noncharacters: never meant, and reserved here
                        v = v.replace(_MARK_OPEN, "").replace(_MARK_CLOSE, "")
                    d[key] = pattern.sub(mark, v) if pattern is not None else v
            out.append(d)
        return out, literals

    def _encode_marked(self, text: str, literals: list[str], budget: TokenBudget | None = None) -> list[int]:
        """Template text with its special tokens; each marker as its literal text with special tokens split."""
        plan = self._count_plan(self._tok, budget)
        if not literals:
            return encode_within(self._tok, text, budget, plan)
        ids: list[int] = []
        pos = 0
        for m in _MARKER.finditer(text):
            ids += self._encode_part(text[pos:m.start()], pos > 0, budget, plan)
            literal = self.encode_as_text(literals[int(m.group(1))], m.start() > 0)
            if budget is not None:
                budget.take(len(literal), len(m.group(0)))
            ids += literal
            pos = m.end()
        return ids + self._encode_part(text[pos:], True, budget, plan)

    def _encode_part(self, text: str, goes_on: bool, budget: TokenBudget | None, plan: CountPlan | None) -> list[int]:
        """Ids of a stretch of the prompt (``goes_on``: not its start)."""
        if goes_on and text and self._prepends(self._tok):
            ids = _encode_going_on(self._tok, text)
            if budget is not None:
                budget.take(len(ids), len(text))
            return ids
        return encode_within(self._tok, text, budget, plan)

    def _prepends(self, tok: Any) -> bool:
        """Whether ``tok`` starts every text it encodes with a word boundary ("▁", SentencePiece's Llama 2 / Mistral
        normalizers): then a stretch that goes on from the text before it must not be encoded as a new text."""
        cache = self.__dict__.setdefault("_prepends_cache", {})
        if id(tok) not in cache:
            def enc(t: str) -> list[int]:
                return tok.encode(t, add_special_tokens=False).ids

            cache[id(tok)] = enc(_GOES_ON + "a") != enc(_GOES_ON) + enc("a")
        return cache[id(tok)]

    def encode_as_text(self, text: str, goes_on: bool = False) -> list[int]:
        """Ids of ``text`` with special-token strings split into ordinary tokens (no BOS); ``goes_on``: the text
        continues text before it (no word boundary prepended)."""
        with _TEXT_TOKENIZER_LOCK:
            if not hasattr(self, "_text_tok"):
                from tokenizers import Tokenizer as HFTokenizer

                tok = HFTokenizer.from_str(self._tok.to_str())
                tok.encode_special_tokens = True  # a second instance: the flag is per tokenizer, and threads share it
                self._text_tok = tok
                self._added_ids = set(self._tok.get_added_tokens_decoder())
        tok = self._text_tok
        going_on = goes_on and self._prepends(tok)

        def enc(t: str, on: bool) -> list[int]:
            return _encode_going_on(tok, t) if on else tok.encode(t, add_special_tokens=False).ids

        ids = enc(text, going_on)
        if len(text) > 1 and any(i in self._added_ids for i in ids):  # a non-special added token matched whole
            return enc(text[:1], going_on) + self.encode_as_text(text[1:], True)
        return ids


def _encode_going_on(tok: Any, text: str) -> list[int]:
    """Ids of ``text`` as it goes on from text before it, for a tokenizer that prepends "▁" to each text: encoded
    behind a newline whose ids are then dropped (as transformers' non-legacy Llama tokenizer encodes behind its
    unk token); encoded alone when the newline merges with the text's start."""
    head = tok.encode(_GOES_ON, add_special_tokens=False).ids
    ids = tok.encode(_GOES_ON + text, add_special_tokens=False).ids
    return ids[len(head):] if ids[:len(head)] == head else tok.encode(text, add_special_tokens=False).ids


_GOES_ON = "\n"  # a character that stays its own token(s) in front of text
_COMPILED_TEMPLATES = 8  # compiled templates kept per tokenizer (the bundle's, --chat-template's, requests')
_MARK_OPEN, _MARK_CLOSE = "\ufdd0", "\ufdd1"
_GROWS = "\ue000"  # a private-use character standing for text the last message may still grow by
# Continuations that change how the end of a text tokenizes, in common tokenizers: a word or number going on,
# spaces and newlines merging, punctuation runs, a multi-byte letter, a combining mark (NFC).
_PROBES = ("a", "A", " a", " ", "  ", "\n", "\n\n", "1", ".", ",", "'s", "<", "é", "中", "\u0301", "\t")


def _developer_as_system(messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` role is the system role of its newer models. A template that never names it (every
    HF template but gpt-oss's) drops such a message (Qwen2.5's) or writes an unknown role under its default system
    prompt (SmolLM2's): it gets them as ``system`` messages, as vLLM and llama.cpp's server map them."""
    if template and "developer" in template:
        return messages
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names, the one templates read first


def _reasoning_aliased(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An earlier turn's thinking under each name templates read, as transformers' apply_chat_template aliases it:
    a client echoing vLLM's newer ``reasoning`` field reaches Qwen3's template (it reads ``reasoning_content``), and
    gpt-oss-style templates read ``thinking``."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _common_prefix(a: Any, b: Any) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


_TAIL_CHARS = 256


def _checked_record(record: Any) -> dict[str, Any]:
    """The manifest's tokenizer record (the manifest is not checksummed: hand edits reach here): an object whose
    bos_token_id is an id and eos_token_ids a list of ids. A string, a bare number or a list where the build writes
    one of those were tracebacks. (An EOS id may lie past the tokenizer, in the model's padding rows.)"""
    if record is None:
        return {}
    if not isinstance(record, dict):
        raise BundleError(f"the manifest's tokenizer record is {record!r}, not an object; rebuild the bundle")
    bos, eos = record.get("bos_token_id"), record.get("eos_token_ids")
    ids = ([bos] if bos is not None else []) + (eos if isinstance(eos, list) else [])
    if not (eos is None or isinstance(eos, list)) or not all(type(i) is int and i >= 0 for i in ids):
        raise BundleError(f"the manifest's tokenizer record has bos_token_id {bos!r} and eos_token_ids {eos!r}; "
                          "token ids are integers from 0: rebuild the bundle")
    return record


def _named_templates(template: Any, where: Path) -> dict[str, str]:
    """The named templates of tokenizer_config.json's list form (transformers' for several: "default",
    "tool_use", ...); a lone template's text is the default alone."""
    if not isinstance(template, list):
        return {}
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    return {k: v for k, v in named.items() if isinstance(k, str) and isinstance(v, str) and v}


def _template_text(template: Any, where: Path) -> str | None:
    """A chat template as text: named templates (a list of {name, template}, as transformers saves several) give
    their "default", else their first."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), template)
    if template is not None and not isinstance(template, str):
        raise BundleError(f"{where}: the chat template is {type(template).__name__} {str(template)[:40]!r}, not "
                          "Jinja text; rebuild the bundle")
    return template or None


_PARTIAL_WORD = re.compile(r"\w+\Z")
_WORD_START = re.compile(r"(?<=\n)[^\s]|(?<=\w) (?=\w)")


def _stable_ids(text: str, encode: Any, encode_part: Any) -> list[int]:
    """ids of ``text`` without its last word (it may go on) up to the first one some continuation in _PROBES
    tokenizes differently. Only the tail is
    probed: the text is cut at a word start at least _TAIL_CHARS from its end (after a newline, or before a space
    between two word characters: no common pre-tokenizer merges across either) and the tail encoded alone; the
    caller compares the result with the whole prompt's own ids, so a tokenizer that does merge there only costs
    cached tokens, never a wrong one."""
    text = _PARTIAL_WORD.sub("", text)  # a word may go on ("vibr" + "ation"): BPE re-merges the whole of it
    cut = 0
    for m in _WORD_START.finditer(text, 0, max(0, len(text) - _TAIL_CHARS)):
        cut = m.start()
    head, tail = (encode(text[:cut]), text[cut:]) if cut else ([], text)
    part = encode_part if cut else encode
    ids = part(tail)
    n = len(ids)
    for probe in _PROBES:
        n = min(n, _common_prefix(ids, part(tail + probe)))
    return head + ids[:n]
_MARKER = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")
_TEXT_TOKENIZER_LOCK = threading.Lock()
_TEMPLATE_LOCK = threading.Lock()


class NothingToContinue(LinesideError):
    """continue_final_message on a last message whose text the rendered chat does not hold (empty, or dropped by
    the template); ``param`` names the request field, so the server's 400 names it."""

    param = "continue_final_message"


def _cut_after_final(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's text (what follows closes the turn)."""
    if not final.strip() or final.strip() not in text:
        raise NothingToContinue("continue_final_message: the chat template does not keep the last message's text "
                           "(or it is empty), so there is nothing to continue; send it without that option")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final.lstrip():  # the template kept trailing spaces
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]

