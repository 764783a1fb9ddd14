"""Runtime helpers (the tiny and SmolLM2 bundles are the root conftest's tiny_bundle and smol_bundle)."""

from __future__ import annotations

import asyncio

import pytest


def run(coro):
    """Run one test coroutine on a fresh event loop."""
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


BYTE_EOS = 2  # the byte tokenizer's EOS id in ``byte_grammar``


@pytest.fixture(scope="module")
def byte_grammar(tmp_path_factory):
    """A grammar compiler over a 300-token byte tokenizer (token = byte + 3): a test walks any text byte by byte."""
    from lineside.runtime.structured import GrammarCompiler
    from lineside.runtime.tokenizer import Tokenizer
    from tests.tiny_tokenizer import write_byte_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(d, 300)
    return GrammarCompiler.for_tokenizer(Tokenizer(d, {"eos_token_ids": [BYTE_EOS]}), 300, [BYTE_EOS])


def grammar_takes(compiler, constraint, text: str) -> bool:
    """Whether ``constraint`` accepts ``text`` as a whole answer, fed byte by byte through ``byte_grammar``."""
    m = compiler.matcher(constraint)
    return all(m.accept(compiler.tokenizer.tokenize_bytes(bytes([b]))[0]) for b in text.encode()) and m.accepting
