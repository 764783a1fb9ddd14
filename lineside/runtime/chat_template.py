"""Chat templates given by the user (``--chat-template``, a request's ``chat_template``): loaded, compiled in the
same sandbox the bundle's own template runs in, and checked on a minimal conversation before they are used.

``--chat-template`` takes what vLLM's does: a path to a Jinja file, or the template text itself when it is not
a file (text with ``{``, ``}`` or a newline; as vLLM does, ``\\n``-style escapes in such text are decoded, so a
one-line shell argument can hold newlines). Templates shipped with lineside are named by ``builtin:NAME``
(``lineside/data/templates/NAME.jinja``).
"""

from __future__ import annotations

import codecs
import contextvars
import functools
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lineside.errors import LinesideError

JINJA_CHARS = "{}\n"
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "data" / "templates"
BUILTIN = "builtin:"
# What the server sets itself: a request's chat_template_kwargs may not replace these.
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token",
                             "eos_token", "raise_exception", "strftime_now"})
_PROBE = [{"role": "user", "content": "Hello"}]


class ChatTemplateError(LinesideError):
    """A template that cannot be read, does not parse, or fails on a minimal conversation (one line)."""


def builtin_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def load_chat_template(value: str, option: str = "--chat-template") -> str:
    """The template text ``value`` stands for: a file's contents, a shipped template, or ``value`` itself."""
    if not value.strip():
        raise ChatTemplateError(f"{option} is empty; give a Jinja file, the template text or builtin:NAME")
    if value.startswith(BUILTIN):
        name = value[len(BUILTIN):]
        path = TEMPLATES_DIR / f"{name}.jinja"
        if name not in builtin_templates():  # a name, not a path: builtin:../x reads nothing outside the folder
            raise ChatTemplateError(f"{option} {value}: no such shipped template; the shipped ones are "
                                    f"{', '.join(BUILTIN + n for n in builtin_templates()) or 'none'}")
        return path.read_text(encoding="utf-8")
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except IsADirectoryError:
        raise ChatTemplateError(f"{option} {value}: is a directory; give a Jinja file or the template text") from None
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{option} {value}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        if not any(c in value for c in JINJA_CHARS):
            raise ChatTemplateError(f"{option} {value}: looks like a file path but cannot be read "
                                    f"({e.strerror or e}); give a readable Jinja file or the template text") from None
        return _unescape(value)
    if not text.strip():
        raise ChatTemplateError(f"{option} {value}: the file is empty")
    return text


def template_option(value: str, option: str = "--chat-template") -> str:
    """The text of ``--chat-template VALUE``, read and checked (one line naming the option when it is unreadable,
    not Jinja, or fails on a one-message conversation)."""
    text = load_chat_template(value, option)
    one = value.splitlines()[0] if value.strip() else value
    shown = repr(one[:40] + "...") if len(one) > 40 or one != value else value
    check_chat_template(text, f"{option} {shown}")
    return text


def _unescape(text: str) -> str:
    """vLLM decodes escapes in template text given inline (``\\n`` → newline); only ASCII text, whose decoding
    cannot mangle other characters."""
    if "\\" not in text or not text.isascii():
        return text
    try:
        return codecs.decode(text, "unicode_escape")
    except UnicodeDecodeError:
        return text


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson filter: keeps non-ASCII by default, takes json.dumps' layout arguments."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def environment() -> Any:
    """The sandbox chat templates render in (as transformers': trim_blocks, lstrip_blocks, loop controls, the
    ``{% generation %}`` block rendered as its body, raise_exception, strftime_now, its tojson)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_extension()])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


@functools.cache
def _generation_extension() -> type:
    from jinja2.ext import Extension  # jinja2 is imported where templates are compiled, not with this module

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens with it): its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


# ---- the bounded sandbox a request's own template renders in ------------------------------------------------
# Steps: loop iterations and calls, per token of the model's context. Measured (tests/server/
# test_request_template_parity.py) on the real templates the tests carry, conversations filling the context with the
# fewest tokens a turn can take (empty messages, one-letter names, `{}` arguments): at most 5.5 steps per token on
# plain turns (builtin:deepseek_v4, whose merging of tool results and user text makes it the costliest), 16.7 with
# eight parallel calls a turn; every other template 2.6 or less. 256 per token leaves 15 times the worst of these.
STEPS_PER_TOKEN = 256
STEPS = 500_000  # the least a server gets (a small context)
DEADLINE_S = 2.0  # wall-clock seconds of one render: the least a server gets (a small context)
# the deadline grows with the context as the steps do, from the same base: 2 s for the 500,000 steps of a
# 1,953-token context, so 1.024 ms per context token (a 4,096-token model: 4.2 s; 32,768 tokens: 33.6 s)
DEADLINE_PER_TOKEN_S = DEADLINE_S * STEPS_PER_TOKEN / STEPS
CHARS_PER_TOKEN = 32  # the rendered text and every string in between: this many characters per context token
MIN_CHARS = 1 << 16
_LIMIT = "the limit on a request's template"


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a request's template may do: ``max_steps`` loop iterations and calls, ``deadline_s``
    seconds, ``max_chars`` characters in its output and in any string, list or number (in digits) it builds."""

    max_chars: int
    max_steps: int = STEPS
    deadline_s: float = DEADLINE_S

    @classmethod
    def for_context(cls, max_seq_len: int) -> TemplateLimits:
        """The defaults for a model of ``max_seq_len`` tokens: size, steps and deadline grow with the context (a
        longer conversation fits, and its steps take their time), each from its floor."""
        return cls(max_chars=max(CHARS_PER_TOKEN * int(max_seq_len), MIN_CHARS),
                   max_steps=max(STEPS_PER_TOKEN * int(max_seq_len), STEPS),
                   deadline_s=max(DEADLINE_PER_TOKEN_S * int(max_seq_len), DEADLINE_S))


class TemplateLimitError(ChatTemplateError):
    """A request's template went past one of its TemplateLimits."""


class _Budget:
    __slots__ = ("limits", "steps", "deadline")

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.steps = 0
        self.deadline = time.monotonic() + limits.deadline_s

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise TemplateLimitError(f"chat_template: rendering took more than {self.limits.max_steps} steps (loop "
                                     f"iterations and calls), {_LIMIT}")
        if time.monotonic() >= self.deadline:
            raise TemplateLimitError(f"chat_template: rendering ran past {self.limits.deadline_s:g} s, {_LIMIT}")


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("lineside_template_budget", default=None)


def _step() -> None:
    budget = _budget.get()
    if budget is not None:
        budget.step()


def _too_big(limits: TemplateLimits) -> TemplateLimitError:
    return TemplateLimitError(f"chat_template: rendering builds a value of more than {limits.max_chars} characters, "
                              f"{_LIMIT} ({CHARS_PER_TOKEN} per token of the model's context)")


def _size(x: Any) -> int:
    """What ``x`` costs in characters: a string's or a sequence's length, an integer's digits (about)."""
    if isinstance(x, bool):
        return 1
    if isinstance(x, int):
        return x.bit_length() * 3 // 10 + 1
    try:
        return len(x)
    except TypeError:
        return 0


_DIGITS = re.compile(r"\d{7,}")


def _check_args(limits: TemplateLimits, args: tuple[Any, ...], kwargs: dict[str, Any], fmt: Any = None) -> None:
    """Before a call: no integer argument beyond the size limit (a width, a count, lipsum's n), no width beyond it
    inside a format string ``fmt``, no argument bigger than the limit."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limits.max_chars:
            raise _too_big(limits)
        if _size(a) > limits.max_chars:
            raise _too_big(limits)
    if isinstance(fmt, str) and any(int(m) > limits.max_chars for m in _DIGITS.findall(fmt)):
        raise _too_big(limits)


def _joined_size(sep: Any, items: list[Any]) -> int:
    return len(str(sep)) * max(len(items) - 1, 0) + sum(_size(x) if isinstance(x, str) else 8 for x in items)


def _replaced_size(s: Any, old: Any, new: Any) -> int:
    if not isinstance(s, str) or not isinstance(old, str) or not isinstance(new, str):
        return 0
    return len(s) + (len(s) + 1 if old == "" else s.count(old)) * len(new)


def _checked_result(limits: TemplateLimits, out: Any) -> Any:
    if isinstance(out, (str, list, tuple, int)) and _size(out) > limits.max_chars:
        raise _too_big(limits)
    return out


def _counted(iterable: Any) -> Any:
    """A for loop's iterable in the bounded sandbox: one step per item."""
    budget = _budget.get()
    if budget is None:
        yield from iterable
        return
    for item in iterable:
        budget.step()
        yield item


def _concat(*parts: Any) -> str:
    """The ``~`` operator in the bounded sandbox, its size checked before it is built."""
    budget = _budget.get()
    texts = [str(p) for p in parts]
    if budget is not None and sum(map(len, texts)) > budget.limits.max_chars:
        raise _too_big(budget.limits)
    return "".join(texts)


def _bounded_filter(limits: TemplateLimits, name: str, fn: Any) -> Any:
    """A filter that takes a step and stays within the size limit; the filter's own flags (pass_context, ...)
    kept. Which argument is the value depends on those flags: every argument is checked."""

    @functools.wraps(fn)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _step()
        plain = [a for a in args if not _is_jinja_context(a)]
        _check_args(limits, tuple(plain), kwargs, plain[1] if name == "format" and len(plain) > 1 else
                    plain[0] if name == "format" and plain else None)
        if name == "join" and plain:
            items = list(plain[0])
            sep = plain[1] if len(plain) > 1 else kwargs.get("d", "")
            if _joined_size(sep, items) > limits.max_chars:
                raise _too_big(limits)
            plain_args = [items, *plain[1:]]
            args = tuple(a for a in args if _is_jinja_context(a)) + tuple(plain_args)
        if name == "replace" and len(plain) >= 3 and _replaced_size(str(plain[0]), plain[1], plain[2]) \
                > limits.max_chars:
            raise _too_big(limits)
        return _checked_result(limits, fn(*args, **kwargs))

    return bounded


def _is_jinja_context(a: Any) -> bool:
    """The argument pass_context / pass_eval_context / pass_environment give a filter (not the template's)."""
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(a, (Context, EvalContext, Environment))


@functools.lru_cache(maxsize=8)
def bounded_environment(limits: TemplateLimits) -> Any:
    """The sandbox of ``environment()`` with bounds on work and size, for a request's own template (rendered with
    render_bounded): each loop iteration and each call is a step (a budget of steps and a deadline, checked at
    each); ``*``, ``**``, ``%``, ``+``, ``~``, the filters and the calls the template makes refuse to build a
    value beyond ``limits.max_chars``. What it renders is what environment() renders, or a TemplateLimitError."""
    from jinja2 import nodes
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    base = environment()

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+", "//", "/"})

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):  # every loop's items counted
                loop.iter = nodes.Call(nodes.ImportedName(f"{__name__}._counted"), [loop.iter], [], None, None,
                                       lineno=loop.lineno)
            for concat in list(tree.find_all(nodes.Concat)):  # ~ : its size checked before it is built
                call = nodes.Call(nodes.ImportedName(f"{__name__}._concat"), concat.nodes, [], None, None,
                                  lineno=concat.lineno)
                concat.__class__ = nodes.Call  # in place: the node's parent keeps pointing at it
                for field in nodes.Call.fields:
                    setattr(concat, field, getattr(call, field))
                del concat.nodes
            for block in tree.find_all(nodes.AssignBlock):  # {% set x %}...: its text checked once built
                block.filter = nodes.Filter(None, "_lineside_sized", [], [], None, None, lineno=block.lineno) \
                    if block.filter is None else nodes.Filter(block.filter, "_lineside_sized", [], [], None, None,
                                                              lineno=block.lineno)
            return tree

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _step()
            if isinstance(__obj, LoopContext) and args:  # a recursive loop's loop(items): those items counted too
                args = (_counted(args[0]), *args[1:])
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format, keeping the method
            receiver = getattr(method, "__self__", None)
            name = getattr(method, "__name__", "")
            fmt = receiver if isinstance(receiver, str) and name in ("format", "format_map") else None
            _check_args(limits, args, kwargs, fmt)
            if isinstance(receiver, str) and name == "join" and args:
                items = list(args[0])
                if _joined_size(receiver, items) > limits.max_chars:
                    raise _too_big(limits)
                args = (items, *args[1:])
            if isinstance(receiver, str) and name == "replace" and len(args) >= 2 \
                    and _replaced_size(receiver, args[0], args[1]) > limits.max_chars:
                raise _too_big(limits)
            return _checked_result(limits, super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _step()
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and _size(left) * right > limits.max_chars:
                raise _too_big(limits)
            if operator == "*":
                if isinstance(left, int) and isinstance(right, int):
                    if _size(left) + _size(right) > limits.max_chars:
                        raise _too_big(limits)
                elif isinstance(right, int) and not isinstance(right, bool) and _size(left) * right > limits.max_chars \
                        or isinstance(left, int) and not isinstance(left, bool) and _size(right) * left > limits.max_chars:
                    raise _too_big(limits)
            if operator == "%" and isinstance(left, str):
                _check_args(limits, right if isinstance(right, tuple) else (right,), {}, left)
            if operator == "+" and _size(left) + _size(right) > limits.max_chars:
                raise _too_big(limits)
            return _checked_result(limits, super().call_binop(context, operator, left, right))

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[type(e) for e in base.extensions.values()])
    env.globals.update(base.globals)
    env.filters.update(base.filters)
    env.filters = {name: _bounded_filter(limits, name, fn) for name, fn in env.filters.items()}
    env.filters["_lineside_sized"] = lambda s: _checked_result(limits, s)
    env.tests = dict(env.tests)
    return env


# the probes' conversations are a few short messages; no wall-clock deadline: their answers are cached per template
# text and decide how the bundle's own template renders, so a stalled process must not cache a wrong one (the
# steps and sizes still bound a request's template)
_PROBE_LIMITS = TemplateLimits(max_chars=MIN_CHARS, deadline_s=math.inf)


def render_bounded(compiled: Any, limits: TemplateLimits, variables: dict[str, Any]) -> str:
    """``compiled`` (from bounded_environment(limits)) rendered with ``variables`` within ``limits``; past one, a
    TemplateLimitError naming it."""
    token = _budget.set(_Budget(limits))
    try:
        out: list[str] = []
        size = 0
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > limits.max_chars:
                raise _too_big(limits)
            out.append(chunk)
        return "".join(out)
    except RecursionError:
        raise TemplateLimitError("chat_template: its macros call themselves deeper than Python's recursion limit "
                                 f"({sys.getrecursionlimit()}), {_LIMIT}") from None
    finally:
        _budget.reset(token)


def compile_template(text: str, what: str, limits: TemplateLimits | None = None) -> Any:
    """The compiled template; a syntax error is one line naming ``what`` and the line. ``limits``: compiled in the
    bounded sandbox (a request's template; render it with render_bounded)."""
    from jinja2 import TemplateSyntaxError

    try:
        return (environment() if limits is None else bounded_environment(limits)).from_string(text)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"{what}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    except Exception as e:  # noqa: BLE001 - jinja raises a few other types on odd input
        raise ChatTemplateError(f"{what}: not a valid Jinja template ({e})") from None


def check_chat_template(text: str, what: str, *, bos_token: str = "", eos_token: str = "",
                        kwargs: dict[str, Any] | None = None, limits: TemplateLimits | None = None) -> None:
    """Compile ``text`` and render a one-message conversation with it (and ``kwargs``, the variables the request
    renders it with); one line saying what failed. ``limits``: in the bounded sandbox (a request's template)."""
    compiled = compile_template(text, what, limits)
    variables = {"documents": None, **(kwargs or {}), "messages": _PROBE, "tools": None, "add_generation_prompt": True,
                 "bos_token": bos_token, "eos_token": eos_token}
    try:
        out = compiled.render(**variables) if limits is None else render_bounded(compiled, limits, variables)
    except TemplateLimitError as e:
        raise ChatTemplateError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever the template raises, the user sees one line
        raise ChatTemplateError(f"{what}: fails to render a one-message conversation "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if "Hello" not in out:
        raise ChatTemplateError(f"{what}: renders a one-message conversation without the message's text "
                                "(it must write each message's 'content')")


@functools.lru_cache(maxsize=32)
def shows_system(text: str) -> bool:
    """Whether the template ``text`` writes a leading system message into the prompt. Gemma's raises on a system
    role ("System role not supported"), and a template may drop one: what the server itself means for the model
    there (the tools' description) must go into a user turn instead."""
    probe = [{"role": "system", "content": "SYSTEM-PROBE"}, *_PROBE]
    out = _rendered(text, probe)
    return out is not None and "SYSTEM-PROBE" in out


@functools.lru_cache(maxsize=32)
def alternates(text: str) -> bool:
    """Whether the template ``text`` demands user and assistant turns in turn (Gemma's, Mistral's, Llama 2's raise
    on two user messages in a row) while it takes them alternating: there consecutive user messages must be one."""
    def renders(messages: list[dict[str, Any]]) -> bool:
        return _rendered(text, messages) is not None

    turns = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}, {"role": "user", "content": "C"}]
    return renders(turns) and not renders([turns[0], turns[2]])


_PROBE_CALL = {"id": "probe0001", "type": "function", "function": {"name": "probe", "arguments": {}}}
# a call and its result (ids of 9 characters: Mistral's templates raise on others)
_CALLED = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
           {"role": "tool", "tool_call_id": "probe0001", "content": "R"}]


def _rendered(text: str, messages: list[dict[str, Any]], *, generation: bool = True) -> str | None:
    """``messages`` rendered with the template ``text``; None when it raises (it refuses the conversation). In the
    bounded sandbox: ``text`` may be a request's (these probes run once per template text, cached)."""
    try:
        return render_bounded(compile_template(text, "chat template", _PROBE_LIMITS), _PROBE_LIMITS,
                              dict(messages=messages, tools=None, documents=None, add_generation_prompt=generation,
                                   bos_token="", eos_token=""))
    except Exception:  # noqa: BLE001 - whatever the template raises (a limit too), it refuses this conversation
        return None


@functools.lru_cache(maxsize=32)
def system_only_with_last_user(text: str) -> bool:
    """Whether the template writes the system message only when the conversation ends with a user turn
    (Mistral-7B-Instruct-v0.3's writes it into the last user turn): after a tool result, or with the assistant's
    turn to continue, it drops the client's system text without a word."""
    system = {"role": "system", "content": "SYSTEM-PROBE"}
    shown = _rendered(text, [system, *_PROBE, {"role": "assistant", "content": "B"}, {"role": "user", "content": "C"}])
    if shown is None or "SYSTEM-PROBE" not in shown:
        return False
    ends = (_rendered(text, [system, *_PROBE, {"role": "assistant", "content": "B"}], generation=False),
            _rendered(text, [system, *_CALLED]))
    return any(out is not None and "SYSTEM-PROBE" not in out for out in ends)


@functools.lru_cache(maxsize=32)
def refuses_user_after_tool(text: str) -> bool:
    """Whether the template takes a tool result, an assistant answer, then a user turn, but refuses the user turn
    right after the tool result (Mistral-7B-Instruct-v0.3's role-alternation check skips tool messages)."""
    user = {"role": "user", "content": "C"}
    return (_rendered(text, [*_CALLED, {"role": "assistant", "content": "B"}, user]) is not None
            and _rendered(text, [*_CALLED, user]) is None)


def check_kwargs(kwargs: Any, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's extra template variables: a JSON object of names the server does not set itself."""
    if not isinstance(kwargs, dict):
        raise ChatTemplateError(f"{param} must be a JSON object of template variables, e.g. "
                                "{\"enable_thinking\": false}")
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier() or key == "self":  # self: Template.render's own
            raise ChatTemplateError(f"{param}: {key!r} is not a template variable name")
        if key in RESERVED_KWARGS:
            raise ChatTemplateError(f"{param}: {key!r} is set by the server; send it as its own field"
                                    if key in ("add_generation_prompt", "continue_final_message", "tools",
                                               "messages") else f"{param}: {key!r} is set by the server")
    return dict(kwargs)


def _raise(msg: str) -> None:
    raise LinesideError(f"chat template: {msg}")
