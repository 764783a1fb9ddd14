"""OpenAI request bodies → the runtime's GenerationRequests: prompt hygiene, tokenization, limits.

Every refusal is an APIError(400) with one line naming the parameter and what to send instead.
"""

from __future__ import annotations

import reprlib
from dataclasses import replace
from typing import Any

from lineside.errors import LinesideError
from lineside.request_class import read_member
from lineside.runtime.invisible import strip_invisible
from lineside.runtime.request import (
    EMPTY_PROMPT,
    MODES,
    PRIORITIES,
    GenerationRequest,
    Mode,
    Priority,
    check_prompt_ids,
)
from lineside.runtime.sampling import SamplingParams, sampler_seed
from lineside.runtime.sampling_defaults import SamplingDefaults
from lineside.runtime.sessions import check_session_id
from lineside.runtime.structured import Constraint
from lineside.server import prompt_limits
from lineside.server.errors import APIError
from lineside.server.schemas import ChatCompletionRequest, CompletionRequest
from lineside.server.unicode_check import check_unicode

MAX_STOP = 16
MAX_PROMPTS = 64


def clean_text(text: str, param: str) -> str:
    """Strip the BOM and zero-width characters; refuse text that is not valid Unicode (lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"'{param}' is not valid UTF-8 (it contains a lone surrogate escape); "
                            "send valid Unicode text", "invalid_utf8", param=param) from None
    return strip_invisible(text)


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param=param)


# vLLM's extras this server does not do, with the value that means "off" (what clients send by default)
VLLM_UNSUPPORTED = {"bad_words": [], "allowed_token_ids": [],
                    "truncate_prompt_tokens": None, "use_beam_search": False,
                    "logits_processors": [], "return_tokens_as_token_ids": False,
                    "guided_whitespace_pattern": None, "structural_tag": None, "priority": 0}
# what to send instead, where this server has another way to say it
_INSTEAD = {"priority": "; send the X-Priority header (high, normal or low) instead"}


def check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse what this server does not do rather than silently ignore it, and strings no tokenizer can encode."""
    check_unicode(req)
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options is only allowed when stream is true; send \"stream\": true or leave "
                  "stream_options out", "stream_options")
    check_unsupported(req)
    check_best_of(req)


def check_unsupported(req: Any) -> None:
    """A 400 naming the first of vLLM's extras this server does not do that ``req`` (chat, completions or
    /v1/responses) sets to anything but its default: each changes the answer, so none is silently dropped."""
    for name, off in VLLM_UNSUPPORTED.items():
        value = getattr(req, name)
        if value is not None and not (value == off and type(value) is type(off)):
            # reprlib: a 10,000-word bad_words list is named by its first few, not echoed whole into one line
            raise bad(f"{name}={reprlib.repr(value)} is not supported by this server; remove it"
                      f"{_INSTEAD.get(name, '')}", name,
                      "unsupported_value")


MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")  # the first one set counts


def check_min_tokens(req: Any, budgets: list[int]) -> None:
    """vLLM's min_tokens may not exceed max_tokens: the one asked for (chat's max_completion_tokens or max_tokens,
    completions' max_tokens, /v1/responses' max_output_tokens), else what each prompt leaves of the context (its
    default max_tokens, as vLLM's)."""
    n = req.min_tokens or 0
    param = next((name for name in MAX_TOKENS_FIELDS if getattr(req, name, None)), None)
    requested = None if param is None else getattr(req, param)
    if requested is not None and n > requested:
        raise bad(f"min_tokens ({n}) is more than {param} ({requested}); lower min_tokens to at most {requested}",
                  "min_tokens")
    if budgets and n > min(budgets):
        raise bad(f"min_tokens ({n}) is more than the {min(budgets)} tokens this request may generate (max_tokens "
                  "not given: its default, at most what the context leaves after the prompt); lower min_tokens or "
                  "send max_tokens", "min_tokens")


METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's limits on metadata


def check_metadata(metadata: dict[str, str] | None) -> None:
    """A 400 naming ``metadata`` past OpenAI's limits (16 pairs, keys up to 64 characters, values up to 512), as
    OpenAI answers, on /v1/chat/completions and /v1/responses alike (the schemas make its keys and values strings)."""
    meta = metadata or {}
    if len(meta) > METADATA_PAIRS:
        raise bad(f"metadata: {len(meta)} pairs; at most {METADATA_PAIRS}", "metadata")
    for key, value in meta.items():
        if len(key) > METADATA_KEY:
            raise bad(f"metadata: a key of {len(key)} characters; at most {METADATA_KEY}", "metadata")
        if len(value) > METADATA_VALUE:
            raise bad(f"metadata: the value of {key!r} has {len(value)} characters; at most {METADATA_VALUE}",
                      f"metadata.{key}")


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    check_metadata(req.metadata)
    # the deprecated functions / function_call: tools / tool_choice say the same
    if req.functions:
        raise bad("'functions' is OpenAI's deprecated form; send them as 'tools' "
                  "([{\"type\": \"function\", \"function\": {...}}])", "functions", "unsupported_value")
    if req.function_call not in (None, "none", "auto"):
        raise bad("'function_call' is OpenAI's deprecated form; send 'tool_choice' instead", "function_call",
                  "unsupported_value")
    for modality in req.modalities or ():
        if modality != "text":
            raise bad(f"modalities: {modality!r} output is not supported (this server writes text only); send "
                      "[\"text\"] or leave modalities out", "modalities", "unsupported_value")
    if req.audio is not None:
        raise bad("audio output is not supported (this server writes text only); leave 'audio' out", "audio",
                  "unsupported_value")
    if req.web_search_options is not None:
        raise bad("web_search_options: this server has no web search; leave it out", "web_search_options",
                  "unsupported_value")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.max_tokens == 0 and not req.echo:
        raise bad("max_tokens 0 generates nothing; send at least 1, or echo: true to get the prompt back (with "
                  "logprobs: its tokens' logprobs)", "max_tokens")
    if req.suffix:
        raise bad("suffix (fill-in-the-middle) is not supported by this server; remove it", "suffix",
                  "unsupported_value")


def check_best_of(req: ChatCompletionRequest | CompletionRequest) -> None:
    """OpenAI's and vLLM's ``best_of``: how many samples to draw for the ``n`` returned, n when left out. best_of
    equal to n returns every sample (what n alone does); fewer than n is a 400 as there; more needs ranking the
    samples, which this server does not do. Chat is checked alike: vLLM's chat drops the field, which answered a
    client asking for the best of several with one plain sample."""
    n = req.n or 1
    if req.best_of is None or req.best_of == n:
        return
    if req.best_of < n:
        raise bad(f"best_of ({req.best_of}) must be at least n ({n}): it counts the samples n are returned from; "
                  f"send best_of={n} or leave it out", "best_of")
    raise bad(f"best_of={req.best_of} with n={n} (keeping the best {n} of {req.best_of} samples) is not supported; "
              f"send best_of={n} or leave it out", "best_of", "unsupported_value")


def chat_template_options(req: ChatCompletionRequest) -> dict[str, bool]:
    """vLLM's add_generation_prompt / continue_final_message; continuing implies no new assistant turn."""
    continuing = bool(req.continue_final_message)
    if continuing and req.add_generation_prompt:
        raise bad("continue_final_message and add_generation_prompt cannot both be true: continuing the last "
                  "message opens no new turn; send add_generation_prompt false", "add_generation_prompt")
    new_turn = not continuing if req.add_generation_prompt is None else bool(req.add_generation_prompt)
    return {"add_generation_prompt": new_turn, "continue_final_message": continuing}


def with_special_tokens(ids: list[int], tokenizer: Any, add: bool | None) -> list[int]:
    """vLLM's chat ``add_special_tokens: true``: the BOS the tokenizer adds to a text (transformers'
    encode(add_special_tokens=True): only a model that adds one) in front of the template's; never doubled."""
    bos = tokenizer.bos_token_id
    wants = bool(getattr(tokenizer, "add_bos", False))
    return [bos, *ids] if add and wants and bos is not None and ids[:1] != [bos] else ids


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain role/content dicts for the chat template (text parts joined by newlines, as vLLM and
    llama.cpp's server join them: separate pieces of text, not one word)."""
    out = []
    for i, message in enumerate(req.messages):
        param = f"messages.{i}.content"
        if message.content is None:
            content = ""
        elif isinstance(message.content, str):
            content = message.content
        else:
            texts = []
            for part in message.content:
                if part.type == "refusal" and message.role == "assistant":
                    # what an OpenAI model answered when refusing, replayed in the history: its text (as vLLM)
                    refusal = getattr(part, "refusal", None)
                    if not isinstance(refusal, str):
                        raise bad("a content part of type 'refusal' needs its text as a string in 'refusal'", param)
                    texts.append(refusal)
                    continue
                if part.type == "text" and not hasattr(part, "text"):
                    raise bad("a content part of type 'text' has no 'text' field", param)
                if part.type != "text":
                    raise bad(f"content part of type {part.type!r} is not supported (this model reads text only)",
                              param, "unsupported_value")
                if not isinstance(part.text, str):
                    raise bad(f"a content part's 'text' must be a string, not {type(part.text).__name__}", param)
                texts.append(part.text)
            content = "\n".join(texts)
        plain: dict[str, Any] = {"role": message.role, "content": clean_text(content, param)}
        if message.name:
            plain["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise bad("only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
            for j, call in enumerate(message.tool_calls):
                f = call.get("function")
                if (not isinstance(f, dict) or not isinstance(f.get("name"), str)
                        or not isinstance(f.get("arguments", ""), (str, dict))):
                    raise bad('a tool call is {"id": ..., "type": "function", "function": {"name": "...", '
                              '"arguments": "{...}"}} (name a string, arguments JSON text)',
                              f"messages.{i}.tool_calls.{j}.function")
            plain["tool_calls"] = message.tool_calls
        if message.tool_call_id:
            plain["tool_call_id"] = message.tool_call_id
        if message.role == "assistant":  # the turn's thinking, for templates that write it back (as vLLM)
            for key in ("reasoning_content", "reasoning"):
                if getattr(message, key) is not None:
                    plain[key] = clean_text(getattr(message, key), f"messages.{i}.{key}")
        out.append(plain)
    return out


def completion_prompts(req: CompletionRequest, tokenizer: Any, vocab_size: int,
                       max_tokens: int | None = None) -> list[list[int]]:
    """Token ids for each prompt: a string, strings, token ids, or lists of token ids. ``max_tokens``: a text
    prompt past it raises PromptTooLong once that is known (runtime/bounded_encode)."""
    prompt = req.prompt
    add = None if req.add_special_tokens is not False else False  # None: the BOS the model wants (vLLM's default)
    if isinstance(prompt, str):
        return [tokenizer.encode(clean_text(prompt, "prompt"), add_special=add, max_tokens=max_tokens)]
    if not prompt:
        raise bad("prompt is an empty list; send a string or a list of strings", "prompt")
    if all(isinstance(item, int) for item in prompt):  # one prompt as token ids: its length is the context's business
        return [_token_id_prompt(prompt, vocab_size)]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise bad(f"prompt lists {len(prompt)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    if all(isinstance(item, str) for item in prompt):
        return [tokenizer.encode(clean_text(text, f"prompt.{i}"), add_special=add, max_tokens=max_tokens)  # type: ignore[arg-type]
                for i, text in enumerate(prompt)]
    return [_token_id_prompt(ids, vocab_size) for ids in prompt]  # type: ignore[arg-type]


def _token_id_prompt(ids: list[int], vocab_size: int) -> list[int]:
    """A prompt sent as token ids, checked as the engine checks every prompt (the context is token_budget's)."""
    try:
        check_prompt_ids(ids, vocab_size)
    except LinesideError as e:
        raise bad(str(e), "prompt") from None
    return list(ids)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range, -100..100: a bias past it is clamped to it, as vLLM does


def logit_bias(req: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias as (token id, bias) pairs: keys are token ids written as JSON strings, each below the
    vocabulary size (vLLM refuses the others too), anything else a 400 naming it; a bias past -100..100 is clamped
    to it, as vLLM and llama.cpp's server take one (a client banning a token with -1e9 works). Keys naming one id
    twice ("2" and "02") keep the last bias, as vLLM's dict of ids does."""
    pairs: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise bad(f"logit_bias key {key!r} is not a token id; send token ids as strings, e.g. {{\"1234\": -100}}",
                      "logit_bias")
        token = int(key)
        if token >= vocab_size:
            raise bad(f"logit_bias names token {token}, but the vocabulary has {vocab_size} tokens (ids 0 to "
                      f"{vocab_size - 1})", "logit_bias")
        pairs[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))  # finite: the schema refuses inf
    return tuple(sorted(pairs.items()))


def check_stop_token_ids(req: Any, vocab_size: int) -> None:
    """vLLM's stop_token_ids, each below the vocabulary size as vLLM checks them: an id past it can never be
    sampled, so the answer it was meant to end ran on to max_tokens."""
    for token in req.stop_token_ids or ():
        if token >= vocab_size:
            raise bad(f"stop_token_ids names token {token}, but the vocabulary has {vocab_size} tokens (ids 0 to "
                      f"{vocab_size - 1})", "stop_token_ids")


def sampling_params(req: Any,
                    bias: tuple[tuple[int, float], ...] = (),
                    defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """The request's sampling; a field it leaves out takes ``defaults`` (the model's generation_config.json under
    ``serve --generation-config auto``, else OpenAI's)."""
    given = defaults.filled(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                            repetition_penalty=req.repetition_penalty)
    given["top_k"] = max(0, given["top_k"])  # -1: off, as 0
    return SamplingParams(
        **given,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=sampler_seed(req.seed),
        min_tokens=req.min_tokens or 0,
        logit_bias=bias,
    )


def stop_list(req: Any) -> list[str]:
    stop = req.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stops = [text for text in stops if text != ""]
    if len(stops) > MAX_STOP:
        raise bad(f"stop lists {len(stops)} sequences; at most {MAX_STOP}", "stop")
    for text in stops:
        if len(text) > 256:
            raise bad("a stop sequence is longer than 256 characters", "stop")
    return stops


def token_budget(prompt_len: int, requested: int | None, default: int | None, *, context: int, param: str,
                 prompt_param: str, tools: int = 0) -> int:
    """max_tokens for one prompt; 400 with the numbers when prompt + max_tokens exceed the context. ``tools``: how
    many tools are rendered into the prompt (the 400 says they count, and may be cut)."""
    if prompt_len == 0:
        raise bad(EMPTY_PROMPT, prompt_param)
    room = context - prompt_len
    whose = f" ({prompt_limits.prompt_named(prompt_param, tools)})" if tools else ""
    if room < 1:
        raise bad(f"prompt{whose} has {prompt_len} tokens but the model's context is {context} tokens, which leaves "
                  f"no room to generate; {prompt_limits.shorten(prompt_param, tools, 'shorten the prompt')}", prompt_param,
                  "context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_len + requested > context:
        raise bad(f"prompt{whose} ({prompt_len} tokens) + {param} ({requested}) = {prompt_len + requested} tokens "
                  f"exceeds the model's context of {context} tokens; lower {param} to at most {room} "
                  f"or {prompt_limits.shorten(prompt_param, tools, 'shorten the prompt')}", param, "context_length_exceeded")
    return requested


def priority(headers: Any) -> tuple[Priority, Mode]:
    """(priority, mode) from the X-Priority and X-Mode headers, else from the ``lineside`` member of
    ``tracestate`` (what the fleet gateway writes: SMG forwards tracestate, not X-Priority / X-Mode)."""
    carried = read_member(headers.get("tracestate"))
    level = (headers.get("x-priority") or carried.get("priority") or "normal").strip().lower()
    mode = (headers.get("x-mode") or carried.get("mode") or "realtime").strip().lower()
    if level not in PRIORITIES:
        raise bad(f"X-Priority {level!r}{_carried_in('x-priority', headers)} is not one of {', '.join(PRIORITIES)}",
                  "X-Priority")
    if mode not in MODES:
        raise bad(f"X-Mode {mode!r}{_carried_in('x-mode', headers)} is not one of {', '.join(MODES)}", "X-Mode")
    return Priority(level), Mode(mode)


def _carried_in(header: str, headers: Any) -> str:
    """Where a bad class value came from when the request sent no such header: a client that never wrote X-Mode
    is told its tracestate header carried it."""
    return "" if headers.get(header) else " (read from the tracestate header's lineside member)"


def session_id(req: ChatCompletionRequest | CompletionRequest, headers: Any) -> str | None:
    """The prefill session a request names (body ``session_id`` or X-Session-Id; both must agree); 400 if malformed."""
    header = headers.get("x-session-id")
    given = req.session_id if req.session_id is not None else header
    if req.session_id is not None and header is not None and header != req.session_id:
        raise bad("X-Session-Id and the body's session_id name different sessions; send one", "session_id",
                  "invalid_session_id")
    if given is None:
        return None
    try:
        return check_session_id(given)
    except LinesideError as e:
        raise bad(str(e), "session_id", "invalid_session_id") from None


def check_keep_session(req: ChatCompletionRequest | CompletionRequest, session: str | None, choices: int,
                       adapter: str | None) -> None:
    """keep_session asks the session to keep this answer's KV for the next turn: refused (rather than dropped)
    where it cannot: no session named, more than one choice (which one's KV?), or a LoRA adapter (a session
    holds the base model's KV, scheduler.py)."""
    if not req.keep_session:
        return
    if session is None:
        raise bad("keep_session needs a session: name it with session_id (or X-Session-Id)", "keep_session")
    if choices > 1:
        raise bad(f"keep_session keeps one answer's KV, and this request asks for {choices} choices; send one "
                  "prompt with n=1, or leave keep_session out", "keep_session")
    if adapter is not None:
        raise bad(f"prefill sessions hold the base model's KV, not the LoRA adapter {adapter!r}'s; leave "
                  "keep_session out or send the base model's name", "keep_session")


def engine_request(ids: list[int], max_tokens: int, req: ChatCompletionRequest | CompletionRequest, *,
                   stops: list[str], priority: Priority, mode: Mode, timeout: float | None, request_id: str,
                   copy: int = 0, constraint: Constraint | None = None,
                   logprobs: int | None = None, session: str | None = None,
                   adapter: str | None = None, bias: tuple[tuple[int, float], ...] = (),
                   defaults: SamplingDefaults = SamplingDefaults(),
                   constraint_after: int | None = None,
                   keep_special_ids: frozenset[int] = frozenset(),
                   prompt_logprobs: int | None = None) -> GenerationRequest:
    """One engine request; ``copy`` j of n > 1 samples with seed + j so a seeded request's n choices differ
    (and repeat exactly with the same seed). ``bias``: the request's checked ``logit_bias``; ``constraint_after``:
    the token the constraint starts after (a reasoning model's ``</think>``); ``keep_special_ids``: the special
    tokens the text keeps (the tool parser's markers); ``prompt_logprobs``: alternatives per scored prompt token
    (completions' echo with logprobs, vLLM's prompt_logprobs: the larger of the two)."""
    sampling = sampling_params(req, bias, defaults)
    if copy and sampling.seed is not None:
        sampling = replace(sampling, seed=(sampling.seed + copy) % 2**64)
    return GenerationRequest(prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=stops,
                             priority=priority, mode=mode, timeout_s=timeout, request_id=request_id,
                             constraint=constraint, constraint_after=constraint_after if constraint is not None else None,
                             logprobs=logprobs, speculative=req.speculative is not False,
                             session_id=session, keep_session=bool(req.keep_session) and session is not None,
                             adapter=adapter, ignore_eos=bool(req.ignore_eos), cache_salt=req.cache_salt,
                             include_stop_str=bool(req.include_stop_str_in_output),
                             skip_special=req.skip_special_tokens is not False,
                             stop_token_ids=list(req.stop_token_ids or []), keep_special_ids=keep_special_ids,
                             prompt_logprobs=prompt_logprobs,
                             # a chat's answer is what its next turn extends; a completion is rarely continued
                             settle_answer=isinstance(req, ChatCompletionRequest))


def choices_per_prompt(req: ChatCompletionRequest | CompletionRequest, prompts: int) -> int:
    """OpenAI's ``n``: choices per prompt, each an independent sample; at most MAX_PROMPTS in all."""
    n = int(req.n or 1)
    if n * prompts > MAX_PROMPTS:
        raise bad(f"n={n} x {prompts} prompt(s) asks for {n * prompts} choices; at most {MAX_PROMPTS} per request",
                  "n", "too_many_choices")
    return n


def check_capacity(n: int, prompts: int, capacity: int) -> None:
    """Choices beyond what the engine holds at once (slots + waiting places) are never admitted, even when it is
    idle: a 400 naming the limit, not a 429 whose "retry later" a client would follow in vain."""
    if n * prompts > capacity:
        raise bad(f"n={n} x {prompts} prompt(s) asks for {n * prompts} choices; this server holds at most {capacity} "
                  "sequences at once (serve --num-slots + --max-waiting): lower n or split the prompts",
                  "n" if n > 1 else "prompt", "too_many_choices")
