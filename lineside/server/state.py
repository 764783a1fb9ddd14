"""The server's lifecycle: loading the engine in the background, readiness, in-flight count, draining.

Loading happens after the socket is open so /health answers (and /health/ready says 503) while a
large engine loads and warms up; draining refuses new work with 503 and waits for in-flight requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lineside.bundle import default_model_names
from lineside.runtime.chat_template import TemplateLimits
from lineside.runtime.sampling_defaults import SamplingDefaults
from lineside.runtime.serving import ServingEngine
from lineside.server.metrics import ServerMetrics
from lineside.server.reasoning import ThinkTokens, knows_tags, resolve
from lineside.server.response_store import ResponseStore
from lineside.server.template_renders import TemplateRenders
from lineside.server.tokenize_pool import PooledTokenizer

if TYPE_CHECKING:
    from lineside.server.slo.guard import SloGuard

log = logging.getLogger("lineside.server")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): what time-to-ready is measured from."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return None


class ServerState:
    """Everything the handlers share: the engine, readiness, drain flag and metrics."""

    def __init__(self, source: str | os.PathLike[str] | ServingEngine, engine_kwargs: dict[str, Any],
                 metrics: ServerMetrics, *,
                 request_timeout: float | None, drain_timeout: float, api_key: str | None,
                 served_model_names: list[str] | None = None, tokenizer_processes: int = 0,
                 engine_future: Future[ServingEngine] | None = None, lora: Any = None,
                 chat_template: str | None = None, trust_request_chat_template: bool = False,
                 tool_call_parser: str = "auto", exclude_tools_when_tool_choice_none: bool = False,
                 max_stored_responses: int = 256,
                 max_stored_responses_mb: int = 64,
                 sampling_defaults: SamplingDefaults | None = None, reasoning_parser: str = "none"):
        self.source = source  # a bundle path, or an LLMEngine the caller built
        # An engine already being built on another thread (`serve` starts it before importing the web stack).
        self.engine_future = engine_future
        self.ready_s: float | None = None  # process start -> ready, seconds
        self._names = [name for name in (served_model_names or []) if name]
        self._given_names = bool(self._names)
        self.engine_kwargs = engine_kwargs
        self.lora = lora  # the primary engine's LoraServing (never the fallback's: another bundle)
        self.chat_template = chat_template  # --chat-template's text (None: the bundle's own renders chats)
        self.trust_request_chat_template = trust_request_chat_template
        # what one render of a request's own template may do (None: runtime/chat_template's defaults for the context)
        self.template_limits: TemplateLimits | None = None
        # where those renders run: a few threads of their own (asyncio's default pool serves every request)
        # (each refused one counted in lineside_requests_total, as a full waiting queue's 429 is)
        self.template_renders = TemplateRenders(on_refused=lambda: self.metrics.reject("too_many_template_renders"))
        self.tool_call_parser = tool_call_parser  # auto (from the template) | hermes | llama3_json
        # vLLM's opt-out: tool_choice none leaves the tools out of the prompt (by default rendered, not parsed)
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.reasoning_parser = reasoning_parser  # none | deepseek_r1 | auto (reasoning.py)
        self.think: ThinkTokens | None = None  # the <think> / </think> ids once loaded, when reasoning is parsed
        # what a request gets for a sampling field it leaves out (serve --generation-config)
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        # /v1/responses kept for previous_response_id
        self.responses = ResponseStore(max_stored_responses, max_stored_responses_mb << 20)
        self.engine: ServingEngine | None = None if isinstance(source, (str, Path)) else source
        self.owns_engine = self.engine is None
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.drain_timeout = drain_timeout
        self.api_key = api_key
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.inflight = 0
        self.tegrastats = False
        self.started_at = int(time.time())
        self.on_load_error: Callable[[str], None] | None = None
        # told on the event loop once the engine failed (its step failures past --max-failed-steps): `serve` exits 1
        self.on_engine_failure: Callable[[str], None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.drain_started = asyncio.Event()  # requests whose body is still arriving give up when it is set
        self._hurry = asyncio.Event()  # a second exit signal: the drain stops waiting for what is in flight
        self._load_task: asyncio.Task | None = None
        self._warm_task: asyncio.Future | None = None
        self.tokenizer_processes = tokenizer_processes
        self._tokenizer: PooledTokenizer | None = None
        self.slo: SloGuard | None = None  # the degradation ladder, when serving with --fallback / --slo-policy

    # ---- model ---------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The id responses and GET /v1/models show: the first served name."""
        return self.served_names[0]

    @property
    def listed_names(self) -> list[str]:
        """What GET /v1/models lists: the names given with --served-model-name, else only the first."""
        return self._names if self._given_names else self.served_names[:1]

    @property
    def served_names(self) -> list[str]:
        """Names a request's ``model`` may use (vLLM's --served-model-name); the first is the id shown."""
        if not self._names:
            if isinstance(self.source, (str, Path)):
                self._names = default_model_names(Path(str(self.source)), None)
            else:
                bundle = getattr(self.engine, "bundle", None)
                self._names = (default_model_names(bundle.path, bundle.manifest.to_json_dict()) if bundle is not None
                                       else [str(self.engine.model_name)])
        return self._names

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters served beside the base model: each is a model of its own (parent: the base)."""
        slots = getattr(self.engine, "adapter_slots", None)
        return list(slots.names) if slots is not None else []

    async def start(self) -> None:
        """Begin loading (returns at once; readiness follows when the engine is up and warm)."""
        self.tegrastats = _start_tegrastats()
        self._load_task = asyncio.create_task(self._load())

    async def _load(self) -> None:
        from lineside.errors import LinesideError

        try:
            if self.engine is None and self.engine_future is not None:
                self.engine = await asyncio.wrap_future(self.engine_future)
            elif self.engine is None:
                from lineside.runtime.engine import LLMEngine

                extra = {} if self.lora is None else {"lora": self.lora}
                self.engine = await asyncio.to_thread(LLMEngine, self.source, **self.engine_kwargs, **extra)
            if self.reasoning_parser != "none":
                # auto: on when a template that may render knows a tag; think_for asks the one a request renders
                tok = self.engine.tokenizer
                templates = [self.chat_template] if self.chat_template else list(tok.chat_templates.values())
                found = [resolve(self.reasoning_parser, tok, t) for t in templates or [None]]
                self.think = next((t for t in found if t is not None), None)
            if hasattr(self.engine, "on_failure"):  # an engine that can fail (LLMEngine): hear of it on this loop
                loop = asyncio.get_running_loop()
                self.engine.on_failure = lambda msg: loop.call_soon_threadsafe(self._engine_failed, msg)
            await self.engine.start()  # warms the backend up before it reports ready
            if self.slo is not None:  # the fallback loads and warms before the server reports ready
                await self.slo.start(self.engine, self.model_name)
            self.ready = True
            self.ready_s = process_age_s()
            # The long-prompt worker (a spawned interpreter: ~1 s; without one, the long-prompt counting plan:
            # ~0.5 s) is built after ready, not before it: a long prompt in its first second waits for it, as it
            # would have waited for the server.
            self._warm_task = asyncio.create_task(asyncio.to_thread(self.tokenizer.warm))
            log.info("model %s ready on %s", self.model_name, getattr(self.engine, "backend_name", "?"))
        except asyncio.CancelledError:
            raise
        except LinesideError as e:
            self._fail(str(e))
        except Exception as e:  # noqa: BLE001 - the server must report it, not die silently
            log.exception("loading the model failed")
            self._fail(f"loading the model failed: {type(e).__name__}: {e}")

    def _fail(self, msg: str) -> None:
        self.load_error = msg
        log.error("%s", msg)
        if self.on_load_error is not None:
            self.on_load_error(msg)

    def _engine_failed(self, msg: str) -> None:
        log.error("the model engine failed: %s; readiness and liveness now answer 503", msg)
        if self.on_engine_failure is not None:
            self.on_engine_failure(msg)

    @property
    def engine_failure(self) -> str | None:
        """Why the engine failed and serves no more (one line), or None: /health and /health/ready answer 503."""
        failure = getattr(self.engine, "failure", None)
        return failure if isinstance(failure, str) else None

    def think_for(self, template: str | None) -> ThinkTokens | None:
        """The reasoning tags a request rendered with ``template`` is parsed by: ``auto`` reads that template (a
        bundle's "tool_use" template may know no tag while its default cuts at ``</think>``: a tool call would
        otherwise be taken for reasoning)."""
        if self.reasoning_parser == "auto" and not knows_tags(template):
            return None
        return self.think

    @property
    def tokenizer(self) -> PooledTokenizer:
        """The engine's tokenizer for request encoding: long prompts go to a worker process (tokenize_pool)."""
        inner = self.engine.tokenizer
        if self._tokenizer is None or self._tokenizer._inner is not inner:
            self._tokenizer = PooledTokenizer(inner, self.tokenizer_processes)
        return self._tokenizer

    @property
    def engine_ready(self) -> bool:
        return self.ready and bool(getattr(self.engine, "ready", True))

    # ---- in-flight and drain ---------------------------------------------------------------------
    def enter(self) -> None:
        self.inflight += 1
        self.metrics.http_inflight.set(self.inflight)
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        self.metrics.http_inflight.set(self.inflight)
        if self.inflight <= 0:
            self._idle.set()

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new work, wait for in-flight requests (up to timeout); True when all finished."""
        self.draining = True
        self.drain_started.set()
        timeout = self.drain_timeout if timeout is None else timeout
        log.info("draining: %d request(s) in flight, waiting up to %.1fs", self.inflight, timeout)
        idle, hurry = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait({idle, hurry}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for waiter in (idle, hurry):
            waiter.cancel()
        if self._idle.is_set():
            return True
        log.warning("%s: %d request(s) still in flight are cancelled",
                    "second exit signal" if self._hurry.is_set() else "drain timeout", self.inflight)
        if self.engine is not None:
            await self.engine.stop(0.0)  # cancels what is left; their responses end with an error
        if self.slo is not None:
            await self.slo.stop(0.0)
        try:
            await asyncio.wait_for(self._idle.wait(), 2.0)
        except asyncio.TimeoutError:
            pass
        return False

    def hurry(self) -> None:
        """End a drain now: what is in flight is cancelled as at its timeout (a second SIGTERM or Ctrl-C)."""
        self._hurry.set()

    async def stop(self) -> None:
        """Stop the engine (cancelling anything still running) if this server started it."""
        self.draining = True
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            try:
                await self._load_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self.engine is not None:
            try:
                await self.engine.stop(0.0 if self.inflight == 0 else min(self.drain_timeout, 5.0))
            except Exception:  # noqa: BLE001 - shutting down: log, keep going
                log.exception("engine stop failed")
        if self.slo is not None:
            await self.slo.stop(0.0 if self.inflight == 0 else min(self.drain_timeout, 5.0))
        if self._warm_task is not None:  # a worker still starting is let finish, then shut down with the pool
            try:
                await self._warm_task
            except Exception:  # noqa: BLE001 - warm() reports its own failure
                pass
        if self._tokenizer is not None:
            await asyncio.to_thread(self._tokenizer.close)
        self.template_renders.close()
        if self.tegrastats:
            from lineside.jetson.gpu_health import stop_tegrastats

            stop_tegrastats()
        self.metrics.close()


def _start_tegrastats() -> bool:
    """On a Jetson, sample tegrastats in the background for /health/gpu and /metrics; False elsewhere."""
    try:
        from lineside.jetson.gpu_health import start_tegrastats

        return start_tegrastats()
    except Exception:  # noqa: BLE001 - device extras must never stop the server
        return False
