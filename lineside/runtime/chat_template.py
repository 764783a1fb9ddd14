"""Chat templates given by the user (``--chat-template``, a request's ``chat_template``): loaded, compiled in the
same sandbox the bundle's own template runs in, and checked on a minimal conversation before they are used.

``--chat-template`` takes what vLLM's does: a path to a Jinja file, or the template text itself when it is not
a file (text with ``{``, ``}`` or a newline; as vLLM does, ``\\n``-style escapes in such text are decoded, so a
one-line shell argument can hold newlines). Templates shipped with lineside are named by ``builtin:NAME``
(``lineside/data/templates/NAME.jinja``).
"""

from __future__ import annotations

import codecs
import functools
import json
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


def compile_template(text: str, what: str) -> Any:
    """The compiled template; a syntax error is one line naming ``what`` and the line."""
    from jinja2 import TemplateSyntaxError

    try:
        return environment().from_string(text)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"{what}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    except Exception as e:  # noqa: BLE001 - jinja raises a few other types on odd input
        raise ChatTemplateError(f"{what}: not a valid Jinja template ({e})") from None


def check_chat_template(text: str, what: str, *, bos_token: str = "", eos_token: str = "",
                        kwargs: dict[str, Any] | None = None) -> None:
    """Compile ``text`` and render a one-message conversation with it (and ``kwargs``, the variables the request
    renders it with); one line saying what failed."""
    compiled = compile_template(text, what)
    try:
        out = compiled.render(**(kwargs or {}), messages=_PROBE, tools=None, add_generation_prompt=True,
                              bos_token=bos_token, eos_token=eos_token)
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
    try:
        out = compile_template(text, "chat template").render(messages=probe, tools=None, add_generation_prompt=True,
                                                             bos_token="", eos_token="")
    except Exception:  # noqa: BLE001 - whatever the template raises, it does not take a system message
        return False
    return "SYSTEM-PROBE" in out


@functools.lru_cache(maxsize=32)
def alternates(text: str) -> bool:
    """Whether the template ``text`` demands user and assistant turns in turn (Gemma's, Mistral's, Llama 2's raise
    on two user messages in a row) while it takes them alternating: there consecutive user messages must be one."""
    def renders(messages: list[dict[str, Any]]) -> bool:
        try:
            compile_template(text, "chat template").render(messages=messages, tools=None, add_generation_prompt=True,
                                                           bos_token="", eos_token="")
        except Exception:  # noqa: BLE001 - whatever the template raises, it refuses this conversation
            return False
        return True

    turns = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}, {"role": "user", "content": "C"}]
    return renders(turns) and not renders([turns[0], turns[2]])


_PROBE_CALL = {"id": "probe0001", "type": "function", "function": {"name": "probe", "arguments": {}}}
# a call and its result (ids of 9 characters: Mistral's templates raise on others)
_CALLED = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
           {"role": "tool", "tool_call_id": "probe0001", "content": "R"}]


def _rendered(text: str, messages: list[dict[str, Any]], *, generation: bool = True) -> str | None:
    """``messages`` rendered with the template ``text``; None when it raises (it refuses the conversation)."""
    try:
        return compile_template(text, "chat template").render(messages=messages, tools=None,
                                                              add_generation_prompt=generation, bos_token="",
                                                              eos_token="")
    except Exception:  # noqa: BLE001 - whatever the template raises, it refuses this conversation
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
