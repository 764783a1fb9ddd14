"""Runtime fixtures: a tiny fp32 bundle (tokenizer + model) and, when installed, SmolLM2 W4A16."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="session")
def tiny_bundle(tiny_dense, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle

    out = tmp_path_factory.mktemp("rt-tiny") / "bundle"
    return build_bundle(tiny_dense("llama-gqa"), out, BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=128))


@pytest.fixture(scope="session")
def smol_bundle(smollm2_path, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle

    out = tmp_path_factory.mktemp("rt-smol") / "bundle"
    return build_bundle(smollm2_path, out, BuildOptions(quant="w4a16", flavors=("cpu",), max_seq_len=512))


def run(coro):
    """Run one test coroutine on a fresh event loop."""
    return asyncio.run(asyncio.wait_for(coro, timeout=60))
