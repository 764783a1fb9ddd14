"""create_app: the FastAPI application serving one bundle (or an engine the caller built)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from lineside.runtime.serving import ServingEngine
from lineside.server import errors, health, openai_api
from lineside.server.metrics import ServerMetrics
from lineside.server.middleware import ServerMiddleware
from lineside.server.state import ServerState

API_KEY_ENV = "LINESIDE_API_KEY"


def create_app(bundle_path_or_engine: str | os.PathLike[str] | ServingEngine, *, api_key: str | None = None,
               request_timeout: float | None = None, max_waiting: int = 256, latency_log: str | Path | None = None,
               drain_timeout: float = 30.0, backend: str = "auto", num_slots: int = 8, threads: int | None = None,
               max_body_bytes: int = 32 << 20, served_model_names: list[str] | None = None,
               engine_future: Future[ServingEngine] | None = None) -> FastAPI:
    """The OpenAI-compatible app. Given a path, the engine loads in the background after startup
    (so /health answers and /health/ready is 503 meanwhile); given an engine, it is started and used.
    ``engine_future``: the bundle's engine, already being built on another thread (it is awaited, not built)."""
    source = bundle_path_or_engine
    if isinstance(source, os.PathLike):
        source = Path(source)
    metrics = ServerMetrics(latency_log)
    state = ServerState(source, dict(backend=backend, num_slots=num_slots, max_waiting=max_waiting, threads=threads),
                        metrics, request_timeout, drain_timeout, api_key or None, served_model_names,
                        engine_future=engine_future)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="lineside", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible API for a lineside bundle")
    app.state.lineside = state
    errors.install(app)
    app.include_router(openai_api.router)
    app.include_router(health.router)
    app.add_middleware(ServerMiddleware, state=state, max_body_bytes=max_body_bytes)
    return app


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lineside")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "dev"
