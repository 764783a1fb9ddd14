"""/health (alive), /health/ready (503 until loaded and warm, while draining, and once the engine failed),
/health/gpu, /metrics.

A failed engine (runtime/engine_health.py: its backend failed step after step) makes both /health and /health/ready
answer 503 naming the cause: the process can only fail requests, so a probe, gateway or supervisor must stop sending
it traffic and restart it (`serve` also exits 1 by itself)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from lineside.server.metrics import CONTENT_TYPE
from lineside.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.lineside


def engine_failed(failure: str) -> JSONResponse:
    """The 503 a failed engine's health routes answer: status and reason (what `lineside fleet` reads), and the
    cause as an OpenAI error object."""
    return JSONResponse({"status": "failed", "reason": failure,
                         "error": {"message": f"the model engine failed: {failure}; restart the server",
                                   "type": "service_unavailable", "param": None, "code": "engine_failed"}},
                        status_code=503)


@router.get("/health", summary="Liveness: the process answers (503 once its engine failed)",
            responses={503: {"description": "the engine failed; restart the process"}})
async def health(request: Request) -> Any:
    state = _state(request)
    if state.engine_failure is not None:
        return engine_failed(state.engine_failure)
    body = {"status": "ok", "ready": state.engine_ready and not state.draining, "draining": state.draining}
    if state.slo is not None:
        body["slo"] = state.slo.status().to_json()
    return body


@router.get("/health/ready", summary="Readiness: 200 once the model is loaded and warm; 503 otherwise",
            responses={503: {"description": "loading, failed to load, draining, or the engine failed"}})
async def ready(request: Request) -> JSONResponse:
    state = _state(request)
    if state.engine_failure is not None:
        return engine_failed(state.engine_failure)
    if state.draining:
        return JSONResponse({"status": "draining", "in_flight": state.inflight}, status_code=503)
    if state.load_error:
        return JSONResponse({"status": "failed", "reason": state.load_error}, status_code=503)
    if not state.engine_ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    return JSONResponse({"status": "ready", "model": state.model_name,
                         "backend": getattr(state.engine, "backend_name", None),
                         "backend_reason": getattr(state.engine, "backend_reason", None), "ready_after_s": state.ready_s})


def gpu_state() -> dict[str, Any]:
    """The Jetson part's GPU reader when it is installed; a clear 'no GPU' answer otherwise."""
    try:
        from lineside.jetson.gpu_health import gpu_health
    except ImportError as e:
        return {"gpu": False, "reason": f"GPU health reader unavailable ({e})"}
    try:
        return gpu_health()
    except Exception as e:  # noqa: BLE001 - a health endpoint answers, it does not crash
        return {"gpu": False, "reason": f"GPU health check failed: {e}"}


@router.get("/health/gpu", summary="GPU state (NVML or Jetson sysfs); {gpu: false, reason} without a GPU")
async def gpu(request: Request) -> dict[str, Any]:
    return await asyncio.to_thread(gpu_state)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(request: Request) -> Response:
    state = _state(request)
    if state.engine is not None:
        try:
            fallback = state.slo.fallback if state.slo is not None else None
            others: list[Any] = [fallback.stats()] if fallback is not None and fallback is not state.engine else []
            if state.slo is not None and state.slo.held:  # batch requests held at the level-1 gate wait too
                others.append({"waiting": state.slo.held})
            state.metrics.update_engine(state.engine.stats(), others=others)
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is stopping
            pass
    if state.tegrastats:
        device = await asyncio.to_thread(gpu_state)
        state.metrics.update_device({name: float(value) for name, value in (device.get("metrics") or {}).items()
                                     if isinstance(value, (int, float))})
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
