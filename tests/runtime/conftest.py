"""Runtime helpers (the tiny and SmolLM2 bundles are the root conftest's tiny_bundle and smol_bundle)."""

from __future__ import annotations

import asyncio


def run(coro):
    """Run one test coroutine on a fresh event loop."""
    return asyncio.run(asyncio.wait_for(coro, timeout=60))
