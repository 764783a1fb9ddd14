"""POST /tokenize, POST /detokenize, GET /version: vLLM's token-counting routes (same paths, bodies and answers).

A factory application budgets a prompt against the context before sending it, so a count must be exactly the
``usage.prompt_tokens`` the generation routes report for the same input: a ``prompt`` is cleaned and encoded as
/v1/completions encodes it, ``messages`` rendered and encoded as /v1/chat/completions does (``openai_api.chat_prompt``,
the same template, tools and options). Unlike the generation routes, a text longer than the context is counted,
not refused: that count is what the client asks for (vLLM answers it too); the body limit bounds the work. The
paths are vLLM's, without a /v1 prefix (vLLM has none); auth, body limits, readiness and the ``model`` check are the
generation routes'.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

import lineside
from lineside.server import request_mapping
from lineside.server.errors import APIError
from lineside.server.openai_api import _check_model, _offload, chat_prompt_off_loop, encode_chat_prompt
from lineside.server.prefill_api import _json_body
from lineside.server.schemas import (
    ERROR_RESPONSES,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from lineside.server.state import ServerState
from lineside.server.unicode_check import check_unicode

router = APIRouter()
_INLINE_IDS = 8192  # decode (and answer) longer id lists in a thread


def _state(request: Request) -> ServerState:
    return request.app.state.lineside


def _validated(model: type[BaseModel], raw: Any) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:  # pydantic's errors as a model-typed route gives them (errors.py words them)
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def _parse(raw: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's two bodies, told apart by ``prompt`` (text) or ``messages`` (a chat): one of them, not both."""
    if not isinstance(raw, dict):
        raise APIError(400, "request body must be a JSON object with 'prompt' (text) or 'messages' (a chat)",
                       "invalid_request")
    if "prompt" in raw and "messages" in raw:
        raise APIError(400, "send either 'prompt' (text) or 'messages' (a chat), not both", "invalid_request",
                       param="messages")
    if "prompt" not in raw and "messages" not in raw:
        raise APIError(400, "missing required field 'prompt' (text to count) or 'messages' (a chat to count)",
                       "missing_field", param="prompt")
    return _validated(TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest, raw)


_BODY_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["prompt"],
    "properties": {"prompt": {"type": "string", "description": "text (or 'messages', a chat as in chat completions)"},
                   "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"},
                   "model": {"type": "string"}}}}}}}


@router.post("/tokenize", responses=ERROR_RESPONSES, openapi_extra=_BODY_DOC)
async def tokenize(request: Request) -> Any:
    """A prompt's (or a chat's) token ids and count, as the generation routes count them, and the context."""
    state = _state(request)
    body = _parse(await _json_body(request))
    _check_model(state, body.model)  # an adapter shares its base model's tokenizer
    check_unicode(body)
    if isinstance(body, TokenizeChatRequest):
        # add_special_tokens: BOS on top of the template's, as chat completions encode it
        ids = await encode_chat_prompt(state, await chat_prompt_off_loop(state, body), max_tokens=None)
    else:
        text = request_mapping.clean_text(body.prompt, "prompt")  # as /v1/completions cleans it
        add = None if body.add_special_tokens is not False else False  # None: what the model adds (completions)
        ids = await _offload(len(text), functools.partial(state.tokenizer.encode, text, add), param="prompt")
    compiler = await asyncio.to_thread(lambda: state.engine.grammar) if body.with_pieces else None
    answer = functools.partial(_answer, state.engine.tokenizer, compiler, ids, int(state.engine.max_seq_len),
                               bool(body.return_token_strs))
    # a long prompt's strings, pieces and JSON (600 k tokens: about 0.5 s of Python) are built off the event loop,
    # which meanwhile answers /health and streams
    return await asyncio.to_thread(answer) if len(ids) > _INLINE_IDS else answer()


def _answer(tok: Any, compiler: Any, ids: list[int], max_model_len: int, token_strs: bool) -> JSONResponse:
    """The /tokenize answer, rendered (``compiler``: the token → bytes table when pieces are asked for)."""
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    if token_strs:
        answer["token_strs"] = [tok.id_to_token(i) or "" for i in ids]
    if compiler is not None:
        answer["tokens"] = _pieces(compiler, ids)
    return JSONResponse(answer)


def _pieces(compiler: Any, ids: list[int]) -> list[dict[str, Any]]:
    """llama.cpp's ``with_pieces``: each id with its text, or its bytes as a list when they are not UTF-8 alone
    (the token → bytes table logprobs use)."""
    out = []
    for i in ids:
        raw = compiler.token_bytes(i)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": i, "piece": piece})
    return out


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> Any:
    """Token ids back to text, special tokens included (vLLM's answer: what the tokenizer decodes)."""
    state = _state(request)
    _check_model(state, body.model)
    tok = state.engine.tokenizer
    size = int(tok.vocab_size)
    for index, token in enumerate(body.tokens):
        if token >= size:
            raise APIError(400, f"tokens.{index}: token id {token} is outside the vocabulary (ids 0 to {size - 1})",
                           "invalid_value", param="tokens")
    decode = functools.partial(tok.decode, body.tokens, skip_special=False)
    text = await asyncio.to_thread(decode) if len(body.tokens) > _INLINE_IDS else decode()
    return {"prompt": text}


@router.get("/version", summary="The lineside version serving (vLLM's GET /version)")
async def version() -> dict[str, str]:
    return {"version": lineside.__version__}
