"""Which chat template renders a request: the request's own ``chat_template`` (vLLM's field; only with
``--trust-request-chat-template``, as vLLM), else the server's ``--chat-template``, else the bundle's; and the
request's ``chat_template_kwargs`` (extra variables, e.g. ``enable_thinking``). Each bad value is a 400 naming
its field."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from lineside.errors import LinesideError
from lineside.runtime.chat_template import (
    ChatTemplateError,
    TemplateLimits,
    check_chat_template,
    check_kwargs,
)
from lineside.server.errors import APIError


@dataclass(frozen=True)
class Rendering:
    given: str | None  # the template text to render with; None: the bundle's own
    effective: str  # the template that renders (what tool-call detection reads)
    kwargs: dict[str, Any] | None
    param: str | None  # the request field a render failure is blamed on
    limits: TemplateLimits | None = None  # a request's own template text: rendered within these (bounded sandbox)

    def options(self) -> dict[str, Any]:
        """Keyword arguments for Tokenizer.encode_chat / stable_chat_ids."""
        return {"chat_template": self.given, "template_kwargs": self.kwargs, "template_limits": self.limits}

    @contextmanager
    def blamed(self) -> Iterator[None]:
        """A render failure inside as a 400 naming the request's template field when it sent one (else as is)."""
        try:
            yield
        except LinesideError as e:
            if self.param is None or getattr(e, "param", None):  # an error naming its own field is that field's
                raise
            raise APIError(400, str(e), "invalid_value", param=self.param) from None


def rendering(state: Any, body: Any, tools: list[dict[str, Any]] | None = None) -> Rendering:
    """The template and variables ``body`` (a chat request) renders with on this server; ``tools``: what the
    template is given as its tools (tool_calls.offered), which picks the bundle's "tool_use" template."""
    given = state.chat_template
    limits = None
    kwargs = request_kwargs(body)  # first: a request's template is checked with its variables
    param = "chat_template_kwargs" if kwargs else None  # {} adds nothing a failure could be blamed on
    if body.chat_template is not None:
        if not state.trust_request_chat_template:
            raise APIError(400, "chat_template in a request is refused: this server renders with its own template "
                                "(start it with --trust-request-chat-template to accept one, or --chat-template to "
                                "set one); remove the field", "unsupported_value", param="chat_template")
        if not body.chat_template.strip():
            raise APIError(400, "chat_template is empty; send the template's text or leave it out", "invalid_value",
                           param="chat_template")
        tok = state.engine.tokenizer
        # the name of one of the bundle's templates ("tool_use", "rag"), as transformers' apply_chat_template
        # (which vLLM hands the field to) takes it; else Jinja text, checked here
        given = getattr(tok, "chat_templates", {}).get(body.chat_template)
        if given is None:
            limits = request_template_limits(state)
            try:
                check_chat_template(body.chat_template, "chat_template", bos_token=tok.bos_token or "",
                                    eos_token=tok.eos_token or "", kwargs=kwargs, limits=limits)
            except ChatTemplateError as e:
                raise APIError(400, str(e), "invalid_value", param="chat_template") from None
            given = body.chat_template
        param = "chat_template"
    return Rendering(given, _effective(state, given, tools), _with_documents(_with_effort(kwargs, body), body), param,
                     limits)


def request_kwargs(body: Any) -> dict[str, Any] | None:
    """vLLM's ``chat_template_kwargs`` of a chat or /v1/responses body, checked (a 400 naming it); None for none."""
    given = getattr(body, "chat_template_kwargs", None)
    if given is None:
        return None
    try:
        return check_kwargs(given) or None
    except ChatTemplateError as e:
        raise APIError(400, str(e), "invalid_value", param="chat_template_kwargs") from None


def _with_documents(kwargs: dict[str, Any] | None, body: Any) -> dict[str, Any] | None:
    """The request's ``documents`` as the template variable of that name, as vLLM and transformers hand them to a
    retrieval template (Command-R's, Granite's); each an object of strings, else a 400 naming it. A ``documents``
    in ``chat_template_kwargs`` wins, as vLLM merges those last."""
    docs = getattr(body, "documents", None)
    if docs is None or (kwargs and "documents" in kwargs):
        return kwargs
    for i, doc in enumerate(docs):
        bad = next((k for k, v in doc.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise APIError(400, f"documents[{i}].{bad}: a document is an object of strings, e.g. "
                                "{\"title\": \"...\", \"text\": \"...\"}; send its value as text", "invalid_value",
                           param=f"documents[{i}].{bad}")
    return {**(kwargs or {}), "documents": [dict(d) for d in docs]}


def _with_effort(kwargs: dict[str, Any] | None, body: Any) -> dict[str, Any] | None:
    """The request's ``reasoning_effort`` as the template variable of that name, as vLLM hands it to a chat template
    (DeepSeek-V4's reads it); a ``reasoning_effort`` in ``chat_template_kwargs`` is the request's own choice and wins."""
    effort = getattr(body, "reasoning_effort", None)
    if effort is None or (kwargs and "reasoning_effort" in kwargs):
        return kwargs
    return {**(kwargs or {}), "reasoning_effort": effort}


def request_template_limits(state: Any) -> TemplateLimits:
    """What one render of a request's own template may do on this server: the server's ``template_limits`` when
    set (tests set small ones), else runtime/chat_template's defaults for the model's context."""
    return getattr(state, "template_limits", None) or TemplateLimits.for_context(state.engine.max_seq_len)


def renders_request_template(state: Any, body: Any) -> bool:
    """Whether rendering ``body`` runs a template the request sent (then off the event loop: it may take up to
    its limits' deadline)."""
    return getattr(body, "chat_template", None) is not None and bool(state.trust_request_chat_template)


def server_rendering(state: Any, tools: list[dict[str, Any]] | None = None, body: Any = None) -> Rendering:
    """The server's template, for bodies that carry no template of their own (/v1/responses): its
    ``chat_template_kwargs`` and ``reasoning_effort`` (/v1/responses' reasoning.effort) reach it as chat's do."""
    kwargs = request_kwargs(body)
    return Rendering(state.chat_template, _effective(state, state.chat_template, tools), _with_effort(kwargs, body),
                     "chat_template_kwargs" if kwargs else None)


NO_TEMPLATE = ("this model has no chat template (its tokenizer defines none), so chat messages cannot be rendered "
               "into its prompt format; start the server with --chat-template FILE (or builtin:NAME), or send the "
               "prompt text to /v1/completions")


def _effective(state: Any, given: str | None, tools: list[dict[str, Any]] | None) -> str:
    """The template that renders: ``given``, else the bundle's for these tools (its "tool_use" one for a chat with
    tools, as the tokenizer picks it); a bundle without one refuses chat (a 400, as vLLM refuses it) instead of a
    made-up transcript the model was never trained on."""
    template = given or state.engine.tokenizer.template_for(tools)
    if not template:
        raise APIError(400, NO_TEMPLATE, "invalid_value", param="messages")
    return template
