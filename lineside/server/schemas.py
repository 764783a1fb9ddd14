"""Request and response bodies in OpenAI's shapes (pydantic), so the OpenAPI schema documents them.

Requests accept the fields stock OpenAI clients send; unknown extra fields are ignored. Types are strict,
as OpenAI's: no true for 1, no "yes" for true, no integer past 2**31 - 1 (a 400 names the field). Fields the
runtime cannot honour (n > 1, logprobs, tools, ...) are declared so they can be refused with a clear 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's reasoning_effort values, and DeepSeek's "max" (its V4 encoder's strongest setting)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
INT32_MAX = 2**31 - 1  # the largest count a field may give: beyond it a 400 names the field, nothing is clamped
_REQ = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)  # no bool→int, no "yes"→true


class StreamOptions(BaseModel):
    model_config = _REQ
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool | None = False


class TextPart(BaseModel):
    model_config = _REQ
    type: Literal["text"] = "text"
    text: str


class OtherPart(BaseModel):
    """Any non-text content part (image_url, input_audio, ...): refused with a clear message."""

    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(BaseModel):
    model_config = _REQ
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: which call it answers
    # an earlier assistant turn's thinking, as vLLM takes it back (templates such as builtin:deepseek_v4 keep it
    # within a tool-call chain)
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Sampling(BaseModel):
    """Parameters shared by chat and text completions."""

    model_config = _REQ
    model: str | None = Field(None, description="the served model's name (GET /v1/models); absent means that one, "
                                                "any other name is a 404 model_not_found")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM's: any value > 0 (1: off); seen tokens' "
                                             "positive logits are divided by it, negative ones multiplied")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="any 64-bit integer, as OpenAI's")
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=64, description="choices per prompt (independent samples; n x prompts <= 64)")
    # OpenAI's completions field, on chat too (vLLM's chat drops it): n alone, or a 400 naming it
    best_of: int | None = Field(None, ge=1, le=INT32_MAX, description="samples the n choices are the best of: only "
                                                                      "n itself (the default) is served")
    logprobs: Any = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) → a bias of -100..100 "
                                                               "(clamped to it) added to its logit before sampling")
    user: str | None = None
    # OpenAI's, on completions too as vLLM takes it (undeclared there it was an unknown field, silently dropped)
    response_format: dict[str, Any] | None = Field(None, description="text | json_object | json_schema: the "
                                                                     "output's format (grammar-constrained)")
    # vLLM's structured outputs (one at most, response_format included): grammar-constrained decoding
    guided_json: Any = Field(None, description="a JSON schema (object or JSON text) the output must follow")
    guided_regex: Any = Field(None, description="a regular expression the whole output must match")
    guided_choice: Any = Field(None, description="a list of strings, one of which is the output")
    guided_grammar: Any = Field(None, description="a Lark or GBNF (llama.cpp) grammar")
    structured_outputs: Any = Field(None, description="vLLM's newer form: {json | regex | choice | grammar | json_object}")
    guided_decoding_backend: str | None = None  # accepted and ignored: llguidance is the one backend
    ignore_eos: bool | None = Field(None, description="vLLM's: go on past the end-of-sequence token (max_tokens "
                                                      "and stop strings still end the answer)")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="vLLM's: token ids that end the answer as EOS does (their text left out); each below "
                          "the vocabulary size, as vLLM checks them")
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX, description="vLLM's: EOS and stop_token_ids are masked "
                                   "and stop strings do not match until this many tokens are generated (at most "
                                   "max_tokens; a complete structured output still ends the answer)")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM's: keep the stop string (or the stop "
                                                    "token's text) that ended the answer at its end")
    skip_special_tokens: bool | None = Field(None, description="vLLM's: false writes special tokens' text into the "
                                             "answer (default true: skipped)")
    spaces_between_special_tokens: bool | None = Field(
        None, description="vLLM's (default true). The byte-level BPE and SentencePiece tokenizers served here put no "
                          "space between special tokens, so true and false write the same text, as vLLM's and "
                          "transformers' fast tokenizers decode them")
    # vLLM's sampling extras this server does not do: each changes the answer, so one set is refused
    # (request_mapping.check_common) rather than dropped with the unknown fields; at their defaults they pass
    bad_words: Any = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    priority: Any = None  # vLLM's scheduling priority (0: none); this server's classes come from X-Priority
    speculative: bool | None = Field(None, description="false: no speculative decoding for this request "
                                                       "(default: the server's --speculative)")
    session_id: str | None = Field(None, description="a prefill session (POST /v1/prefill) whose KV this prompt "
                                                     "extends; the X-Session-Id header says the same")
    keep_session: bool | None = Field(None, description="true: the session keeps this prompt's KV for the next "
                                                        "turn (default: it ends with this completion)")
    cache_salt: str | None = Field(None, min_length=1, description="vLLM's: only requests sending this same salt "
                                   "reuse each other's cached prompt prefix (and prefill sessions), so another "
                                   "user cannot time a cache hit to learn a prompt; a non-empty string")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # OpenAI's: string pairs within its limits (request_mapping.check_metadata), as /v1/responses takes them
    metadata: dict[str, str] | None = None
    # vLLM's extras for an assistant prefill: the prompt ends inside the last message, which the model continues
    add_generation_prompt: bool | None = Field(None, description="default true; false with continue_final_message")
    continue_final_message: bool | None = Field(None, description="continue the last message (assistant prefill)")
    add_special_tokens: bool | None = Field(False, description="vLLM's: true puts the BOS the tokenizer adds to a "
                                                               "text (if any) in front of the template's, not doubled")
    echo: bool | None = Field(False, description="vLLM's: a last message of the assistant's role goes in front of "
                                                 "the answer's content (the whole message, not only what was added)")
    chat_template: str | None = Field(None, description="vLLM's: Jinja text to render this chat with, or the name "
                                                        "of one of the bundle's templates (needs the server's "
                                                        "--trust-request-chat-template)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: extra variables for the chat "
                                                                          "template, e.g. {\"enable_thinking\": false}")
    documents: list[dict[str, Any]] | None = Field(None, description="vLLM's: documents for a retrieval chat template "
                                                                   "(its variable documents), each an object of "
                                                                   "strings, e.g. {\"title\": ..., \"text\": ...}")
    include_reasoning: bool | None = Field(None, description="vLLM's: false leaves a reasoning model's thinking out "
                                                             "of the response (serve --reasoning-parser)")
    reasoning_effort: ReasoningEffort | None = Field(None, description="OpenAI's; handed to the chat template as the "
                                                                     "variable reasoning_effort, as vLLM does (DeepSeek-V4: "
                                                                     "thinking on, 'none' off, 'max' the encoder's prefix)")
    # OpenAI's output modalities and hosted web search: only text is served, so asking for more is refused
    # (request_mapping.check_chat) rather than dropped with the unknown fields
    modalities: list[str] | None = Field(None, description="[\"text\"] only: this server writes no audio")
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a string, a list of strings, token ids, or a list of token-id lists")
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX, description="default 16, as OpenAI's; 0 only with echo "
                                                                         "(the prompt, scored, and nothing more)")
    echo: bool | None = Field(False, description="the prompt in front of the text (with logprobs: its tokens' too, "
                                                 "the first one's null)")
    add_special_tokens: bool | None = Field(True, description="vLLM's: false leaves out the BOS the model adds in front "
                                                              "of a text prompt, as /tokenize counts")
    suffix: str | None = None


# ---- responses ---------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, description="serve --reasoning-parser: the thinking before the "
                                                            "answer (vLLM's field; also as 'reasoning')")
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str
    stop_reason: int | str | None = Field(None, description="vLLM's: the stop string or stop token id "
                                                           "that ended the answer (null: EOS, length)")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str
    stop_reason: int | str | None = Field(None, description="vLLM's: the stop string or stop token id "
                                                           "that ended the answer (null: EOS, length)")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lineside"
    max_model_len: int | None = None
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    code: str | int | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# Documented for every POST endpoint so the schema (and schemathesis) knows them.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in ((400, "invalid request"), (401, "missing or wrong API key"),
                       (404, "the model named is not served here (model_not_found)"),
                       (408, "the request exceeded the server's request timeout"),
                       (413, "request body too large"), (429, "waiting queue full"),
                       (503, "model loading or server draining"))
}


# ---- token counting (vLLM's /tokenize and /detokenize) --------------------------------------------------
class _TokenizeCommon(BaseModel):
    model_config = _REQ
    model: str | None = Field(None, description="as on the generation routes; a LoRA adapter counts as its base")
    return_token_strs: bool | None = Field(False, description="vLLM's: also the vocabulary entry of each token")
    with_pieces: bool | None = Field(False, description="llama.cpp's: each token as {id, piece}, piece its text "
                                                        "(or its bytes as a list when they are not UTF-8)")


class TokenizeCompletionRequest(_TokenizeCommon):
    prompt: str = Field(..., description="text, counted as /v1/completions counts a prompt")
    add_special_tokens: bool | None = Field(True, description="true: BOS where the model wants one (as completions)")


class TokenizeChatRequest(_TokenizeCommon):
    messages: list[ChatMessage] = Field(..., min_length=1)
    reasoning_effort: ReasoningEffort | None = None  # as chat completions render it
    add_generation_prompt: bool | None = Field(None, description="default true; false with continue_final_message")
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = Field(False, description="true: BOS on top of what the template writes")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _REQ
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
