"""What the server uses of an engine, as a Protocol: the server depends on this, not on LLMEngine's insides.

``LLMEngine`` implements it; an engine a caller builds and hands to ``create_app`` must offer the same.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from lineside.bundle import Bundle
from lineside.runtime.request import GenerationRequest, RequestHandle
from lineside.runtime.sessions import SessionInfo
from lineside.runtime.structured import GrammarCompiler
from lineside.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:  # the stats type lives with the engine that counts them
    from lineside.lora import LoraAdapter
    from lineside.runtime.adapter_slots import AdapterSlots
    from lineside.runtime.engine import EngineStats


@runtime_checkable
class ServingEngine(Protocol):
    """Every member the server reads or calls (server/state.py, openai_api.py, health.py)."""

    bundle: Bundle  # the manifest's model name is a served alias
    model_name: str  # the name served when no bundle path is known
    backend_name: str  # "onnxruntime" | "tensorrt", for /health and the log
    backend_reason: str | None  # why --backend auto chose it (/health/ready, bench); None: the caller gave it
    tokenizer: Tokenizer  # encode / encode_chat / vocab_size for request mapping
    max_seq_len: int  # the context budgets are checked against
    vocab_size: int  # prompt token ids are checked against
    ready: bool  # warmed up and stepping (/health/ready)
    grammar: GrammarCompiler  # structured outputs and tool calls: checks constraints; token bytes for logprobs
    capacity: int  # sequences it holds at once, running and waiting: more choices in one request never fit
    adapter_slots: AdapterSlots | None  # the LoRA adapters it serves (each a model named by the adapter), or None
    keeps_sessions: bool  # prefill sessions can be kept (POST /v1/prefill, keep_session)

    def warm_up(self) -> None:
        """Run the backend once so its first request does not allocate (`serve` calls it on the loading thread;
        ``start`` does it otherwise)."""
        ...

    async def start(self) -> None:
        """Warm the backend up (unless done), then start the step loop."""
        ...

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_timeout`` s, cancel the rest."""
        ...

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request; raises QueueFullError / EngineDraining / LinesideError (a 4xx/5xx)."""
        ...

    def submit_all(self, reqs: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue every request (one request's n choices) or none, raising as ``submit`` does."""
        ...

    def stats(self) -> EngineStats:
        """Live counters for /metrics."""
        ...

    def prefill(self, session_id: str, prompt_ids: list[int], stable: int, *, rank: int = 1,
                cache_salt: str | None = None) -> SessionInfo:
        """Cache ``prompt_ids[:stable]``'s KV under a prefill session (POST /v1/prefill), for completions of the
        same ``cache_salt``; returns at once."""
        ...

    def session(self, session_id: str) -> SessionInfo | None:
        """A prefill session's state, None when there is none."""
        ...

    def release_session(self, session_id: str) -> bool:
        """End a prefill session now; False when there is none."""
        ...


@runtime_checkable
class AdapterServing(ServingEngine, Protocol):
    """What `serve --allow-runtime-lora`'s routes use besides (server/lora_api.py): an engine without these simply
    serves no runtime adapters."""

    max_lora_rank: int  # the slots' rank: a runtime adapter above it is refused

    def add_adapter(self, adapter: LoraAdapter, *, replace: bool = False) -> None:
        """Serve ``adapter`` from now on; raises AdapterInUse for a name served already, unless ``replace``."""
        ...

    def remove_adapter(self, name: str) -> None:
        """Stop serving ``name`` (requests already using it finish with it); raises UnknownAdapter."""
        ...


@runtime_checkable
class ReportsFailure(ServingEngine, Protocol):
    """An engine that can fail for good (LLMEngine past --max-failed-steps, engine_health.py): the server reads
    ``failure`` for /health and sets ``on_failure`` to hear of it; an engine without these never fails so."""

    failure: str | None  # why it failed (one line), or None while it serves
    on_failure: Callable[[str], None] | None  # called from the step thread once it fails

def serves_adapters(engine: ServingEngine) -> bool:
    """Whether ``engine`` has AdapterServing's members besides ServingEngine's, looked up without running them:
    ``isinstance`` with a runtime-checkable protocol reads every member on Python 3.11, and the engine's ``grammar``
    property builds the structured-output compiler (about a second of reading the vocabulary)."""
    return all(inspect.getattr_static(engine, name, None) is not None
               for name in ("max_lora_rank", "add_adapter", "remove_adapter"))
