"""create_app: the FastAPI application serving one bundle (or an engine the caller built)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lineside.bundle import default_model_names
from lineside.runtime.engine import LoraServing
from lineside.runtime.engine_health import DEFAULT_MAX_FAILED_STEPS
from lineside.runtime.sampling_defaults import SamplingDefaults, resolve_generation_config
from lineside.runtime.serving import ServingEngine
from lineside.runtime.speculative.config import SpeculativeConfig
from lineside.runtime.structured import DEFAULT_CACHED_GRAMMARS
from lineside.server import errors, health, lora_api, openai_api, prefill_api, tokenize_api
from lineside.server.browser_guard import BrowserGuard, BrowserPolicy, CorsSettings, GuardedCors
from lineside.server.head_requests import HeadAsGet
from lineside.server.lora_dirs import AdapterDirs
from lineside.server.metrics import ServerMetrics
from lineside.server.middleware import BodyRefused, ServerMiddleware
from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import SloPolicy
from lineside.server.state import ServerState

# A page on an allowed origin may send any request header (vLLM's default, and the OpenAI JS SDK sends its own
# x-stainless-* set): the origin is what is trusted, a header adds nothing a trusted page couldn't send. Exposed: the
# headers clients act on (the SDKs' retries read Retry-After and x-should-retry), which a browser hides otherwise.
_CORS_HEADERS = ["*"]
_CORS_EXPOSED = ["x-request-id", "retry-after", "x-should-retry", "x-lineside-degraded"]


def create_app(bundle_path_or_engine: str | os.PathLike[str] | ServingEngine, *, api_key: str | None = None,
               request_timeout: float | None = None, max_waiting: int = 256, latency_log: str | Path | None = None,
               drain_timeout: float = 30.0, backend: str = "auto", num_slots: int = 8, threads: int | None = None,
               max_body_bytes: int | None = None, served_model_names: list[str] | None = None,
               bind_host: str = "127.0.0.1", allowed_hosts: list[str] | None = None,
               allowed_origins: list[str] | None = None, metrics_public: bool = False,
               openapi: bool = False, tokenizer_processes: int = 0,
               fallback: str | os.PathLike[str] | ServingEngine | None = None, slo_policy: SloPolicy | None = None,
               slo_guard: SloGuard | None = None, engine_future: Future[ServingEngine] | None = None,
               speculative: SpeculativeConfig | None = None, session_ttl: float = 30.0,
               max_sessions: int = 64, lora: LoraServing | None = None, chat_template: str | None = None,
               trust_request_chat_template: bool = False, tool_call_parser: str = "auto",
               exclude_tools_when_tool_choice_none: bool = False,
               max_stored_responses: int = 256, max_stored_responses_mb: int = 64,
               sampling_defaults: SamplingDefaults | None = None,
               reasoning_parser: str = "none", root_path: str = "", allow_runtime_lora: bool = False,
               lora_dirs: Sequence[str | os.PathLike[str]] = (),
               max_cached_grammars: int = DEFAULT_CACHED_GRAMMARS,
               max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS) -> FastAPI:
    """The OpenAI-compatible app. Given a path, the engine loads in the background after startup
    (so /health answers and /health/ready is 503 meanwhile); given an engine, it is started and used.
    ``bind_host`` decides the default Host allow-list; ``openapi`` serves /openapi.json (behind the key when one
    is set); no /docs or /redoc pages: they load their scripts from a CDN. ``max_body_bytes``: default derived
    from the model's context (prompt_limits.body_limit), at most 32 MiB. ``tokenizer_processes``: worker processes
    for long prompts, started once the model is ready (`lineside serve` uses 1); 0 tokenizes in threads.
    ``fallback`` / ``slo_policy`` turn the SLO guard on (slo/guard.py); ``slo_guard``: one the caller built.
    ``engine_future``: the bundle's engine, already being built on another thread (it is awaited, not built).
    ``session_ttl`` / ``max_sessions``: prefill sessions (POST /v1/prefill) of the engine built here.
    ``lora``: the LoRA adapters the bundle's engine serves (each a model named by the adapter).
    ``chat_template``: template text that renders chats instead of the bundle's (checked by the caller:
    runtime/chat_template.py); ``trust_request_chat_template``: accept a request's own ``chat_template``;
    ``tool_call_parser``: how ``auto`` tool calls are read (tool_calls.PARSERS; auto: from the template);
    ``exclude_tools_when_tool_choice_none``: tool_choice none leaves the tools out of the prompt (vLLM's flag; by
    default they are rendered and only not parsed);
    ``max_stored_responses``: /v1/responses kept for ``previous_response_id`` and GET (0: none);
    ``max_stored_responses_mb``: and at most this many MiB of their JSON (the newest kept whatever its size);
    ``sampling_defaults``: what a request gets for a sampling field it leaves out (None: the bundle's
    generation_config.json, as `serve --generation-config auto`);
    ``reasoning_parser``: none | deepseek_r1 | auto, a reasoning model's thinking apart from its answer (reasoning.py);
    ``root_path``: the path prefix a reverse proxy serves this under (vLLM's --root-path, as `serve` checks it): routes
    answer with it and without it, so a proxy that keeps the prefix and one that strips it both reach them;
    ``allow_runtime_lora``: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; 404 otherwise);
    ``lora_dirs``: the directories those loads may read adapters from (none given: every lora_path is refused);
    ``max_cached_grammars``: compiled structured-output grammars the engine built here keeps (LRU, >= 1);
    ``max_failed_steps``: model steps failing in a row after which that engine is failed (runtime/engine_health.py):
    /health and /health/ready answer 503, and `serve` exits 1."""
    source = bundle_path_or_engine
    if isinstance(source, os.PathLike):
        source = Path(source)
    metrics = ServerMetrics(latency_log)
    if sampling_defaults is None:  # the bundle's own (an engine built elsewhere: the one it was built from)
        tokenizer_dir = (Path(source) / "tokenizer" if isinstance(source, (str, Path))
                         else getattr(getattr(source, "bundle", None), "tokenizer_dir", None))
        sampling_defaults = (SamplingDefaults() if tokenizer_dir is None
                             else resolve_generation_config("auto", tokenizer_dir))
    engine_kwargs = dict(backend=backend, num_slots=num_slots, max_waiting=max_waiting, threads=threads,
                         session_ttl=session_ttl, max_sessions=max_sessions, max_cached_grammars=max_cached_grammars,
                         max_failed_steps=max_failed_steps)
    if speculative is not None:
        engine_kwargs["speculative"] = speculative
    state = ServerState(source, engine_kwargs,
                        metrics, request_timeout=request_timeout, drain_timeout=drain_timeout,
                        api_key=api_key or None, served_model_names=served_model_names,
                        tokenizer_processes=tokenizer_processes, engine_future=engine_future, lora=lora,
                        chat_template=chat_template, trust_request_chat_template=trust_request_chat_template,
                        tool_call_parser=tool_call_parser,
                        exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
                        max_stored_responses=max_stored_responses,
                        max_stored_responses_mb=max_stored_responses_mb,
                        sampling_defaults=sampling_defaults, reasoning_parser=reasoning_parser)
    if slo_guard is None and (fallback is not None or slo_policy is not None):
        fallback_name = (default_model_names(Path(fallback), None)[0]
                         if isinstance(fallback, (str, os.PathLike)) else None)
        slo_guard = SloGuard(slo_policy or SloPolicy(), fallback=fallback, fallback_name=fallback_name,
                             engine_kwargs=state.engine_kwargs)
    if slo_guard is not None:
        slo_guard.attach(metrics.registry)
        state.slo = slo_guard
        metrics.listeners.append(slo_guard.observe)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="lineside", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible API for a lineside bundle", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if openapi else None)
    # set on the app (as vLLM does), not through the constructor's deprecated parameter: FastAPI puts it in each
    # request's scope, and Starlette's routing matches the path with the prefix removed when it is there
    app.root_path = root_path
    app.state.lineside = state
    app.state.lora_dirs = AdapterDirs.of(lora_dirs)
    errors.install(app)

    @app.exception_handler(BodyRefused)
    async def _body_refused(request: Request, exc: BodyRefused) -> JSONResponse:
        if exc.status_code in (400, 413):
            state.metrics.reject("invalid")
        return errors.error_response(exc.status_code, str(exc.detail), exc.code, headers=exc.headers)

    app.include_router(openai_api.router)
    app.include_router(prefill_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(health.router)
    if allow_runtime_lora:  # not mounted otherwise: the routes are 404, as vLLM's without its env var
        app.include_router(lora_api.router)
    # the last added runs first: CORS (preflights, and its headers on every answer, refusals included), then
    # Host / Origin / Content-Type, then key, drain, body, and last HEAD as GET (the checks see the client's HEAD)
    app.add_middleware(HeadAsGet, router=app.router)
    app.add_middleware(ServerMiddleware, state=state, max_body_bytes=max_body_bytes, metrics_public=metrics_public)
    policy = BrowserPolicy.for_bind(bind_host, allowed_hosts, allowed_origins)
    # a body refused there (415) is an invalid request, counted as a malformed body's 400 is
    app.add_middleware(BrowserGuard, policy=policy, on_invalid=lambda scope: errors.count_invalid(state, scope),
                       on_forbidden=lambda scope: errors.count_invalid(state, scope, outcome="forbidden"))
    # the protocol layer's refusals made before the app runs (431) read it too, to carry the same headers
    app.state.cors = None
    if policy.allowed_origins:
        app.state.cors = cors = CorsSettings(tuple(sorted(policy.allowed_origins)), tuple(_CORS_EXPOSED))
        app.add_middleware(GuardedCors, allow_origins=list(cors.origins),
                           allow_methods=["GET", "HEAD", "POST", "DELETE"], allow_headers=_CORS_HEADERS,
                           expose_headers=list(cors.expose), max_age=600)
    return app


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lineside")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "dev"
