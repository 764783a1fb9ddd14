"""/health (alive), /health/ready (503 until loaded and warm, and while draining), /health/gpu, /metrics."""

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


@router.get("/health", summary="Liveness: the process answers")
async def health(request: Request) -> dict[str, Any]:
    s = _state(request)
    return {"status": "ok", "ready": s.engine_ready and not s.draining, "draining": s.draining}


@router.get("/health/ready", summary="Readiness: 200 once the model is loaded and warm; 503 otherwise",
            responses={503: {"description": "loading, failed to load, or draining"}})
async def ready(request: Request) -> JSONResponse:
    s = _state(request)
    if s.draining:
        return JSONResponse({"status": "draining", "in_flight": s.inflight}, status_code=503)
    if s.load_error:
        return JSONResponse({"status": "failed", "reason": s.load_error}, status_code=503)
    if not s.engine_ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    return JSONResponse({"status": "ready", "model": s.model_name,
                         "backend": getattr(s.engine, "backend_name", None), "ready_after_s": s.ready_s})


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
    s = _state(request)
    if s.engine is not None:
        try:
            s.metrics.update_engine(s.engine.stats())
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is stopping
            pass
    if s.tegrastats:
        dev = await asyncio.to_thread(gpu_state)
        s.metrics.update_device({k: float(v) for k, v in (dev.get("metrics") or {}).items()
                                 if isinstance(v, (int, float))})
    return Response(s.metrics.render(), media_type=CONTENT_TYPE)
