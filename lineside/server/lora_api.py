"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added to and removed from a running server.

vLLM's routes (its VLLM_ALLOW_RUNTIME_LORA_UPDATING; here `serve --allow-runtime-lora`, and the app mounts this
router only then, so they are 404 otherwise), reading only under `--lora-dir` (lora_dirs.py), with its bodies and its plain-text "Success: ..." answers. A loaded
adapter is checked exactly as ``--lora-modules`` checks one and is a model at once; an unloaded one is refused to new
requests while those already waiting or running on it finish with it (the engine keeps it for them). A name can be
loaded again at once, or replaced with ``load_inplace``: new requests get the new weights, those in flight the old.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from lineside.errors import LinesideError
from lineside.lora import check_name
from lineside.runtime.adapter_slots import AdapterInUse, UnknownAdapter
from lineside.runtime.adapters import runtime_adapter
from lineside.runtime.serving import AdapterServing, serves_adapters
from lineside.server.errors import APIError
from lineside.server.lora_dirs import AdapterDirs, AdapterPathRefused
from lineside.server.schemas import _REQ, ERROR_RESPONSES
from lineside.server.state import ServerState

router = APIRouter()
log = logging.getLogger("lineside.server")


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body (other extras are ignored). ``load_inplace``: replace an adapter already served under the name
    (new requests get the new weights; those in flight finish on the old)."""

    model_config = _REQ
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body (``lora_int_id`` is ignored: adapters are named here)."""

    model_config = _REQ
    lora_name: str


def _engine(request: Request) -> AdapterServing:
    """The primary engine, ready and serving adapter slots (503 while it loads or drains, 400 without slots)."""
    state: ServerState = request.app.state.lineside
    if state.draining:
        raise APIError(503, "server is shutting down; adapters cannot be loaded or unloaded now", "draining")
    if not state.engine_ready or state.engine is None:
        raise APIError(503, "model is still loading; retry when GET /health/ready answers 200", "not_ready",
                       headers={"retry-after": "1"})
    # not isinstance(engine, AdapterServing): on Python 3.11 that reads every property, building the grammar compiler
    if not serves_adapters(state.engine) or state.engine.adapter_slots is None:
        raise APIError(400, "this server has no LoRA adapter slots; start `lineside serve` with --allow-runtime-lora "
                            "on a bundle built with --max-lora-rank", "lora_not_enabled")
    return cast(AdapterServing, state.engine)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.lineside
    engine = _engine(request)
    name = body.lora_name.strip()
    try:
        check_name(name)
    except LinesideError as e:
        raise APIError(400, f"lora_name: {e}", "invalid_lora_name", param="lora_name") from None
    if name in state.served_names:
        raise APIError(400, f"lora_name {name!r} is a name of the base model; give the adapter another name",
                       "invalid_lora_name", param="lora_name")
    if name in engine.adapter_slots.served and not body.load_inplace:
        raise APIError(400, f"adapter {name!r} is already loaded; unload it first (POST /v1/unload_lora_adapter), "
                            "send load_inplace true to replace it, or choose another lora_name", "lora_already_loaded",
                       param="lora_name")
    dirs: AdapterDirs = request.app.state.lora_dirs
    located: list[Path] = []

    def locate(text: str) -> Path:
        located.append(dirs.locate(text))
        return located[0]

    try:  # reading the files and checking every shape: off the event loop
        adapter = await asyncio.to_thread(runtime_adapter, engine.bundle, name, body.lora_path,
                                          max_rank=engine.max_lora_rank, locate=locate)
    except AdapterPathRefused as e:
        raise APIError(403, str(e), "lora_path_not_allowed", param="lora_path") from None
    except LinesideError as e:  # a path the OS refuses to look up (too long, a loop) included: lora.py's one line
        msg = dirs.client_view(str(e), located[0], body.lora_path.strip()) if located else str(e)
        raise APIError(400, msg, "invalid_lora_adapter", param="lora_path") from None
    try:
        engine.add_adapter(adapter, replace=body.load_inplace)  # refuses a name loaded meanwhile (unless replacing)
    except AdapterInUse as e:
        raise APIError(400, str(e), "lora_already_loaded", param="lora_name") from None
    log.info("loaded LoRA adapter %s from %s (rank %d, %s)", name, body.lora_path, adapter.rank,
             ",".join(t.value for t in adapter.targets))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    engine = _engine(request)
    name = body.lora_name.strip()
    try:
        engine.remove_adapter(name)
    except UnknownAdapter as e:
        raise APIError(404, str(e), "model_not_found", param="lora_name") from None
    log.info("unloaded LoRA adapter %s (requests already using it finish with it)", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
