"""The interface every model family implements: what the build pipeline asks of dense and DeepSeek-V4 alike.

A family module exposes ``FAMILY``, an instance of a ``ModelFamily`` subclass; leaving out a method fails
when the module is imported, not halfway through a build.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from lineside.build.checkpoint import CheckpointReader
from lineside.build.quant.grid import Int4Grid
from lineside.build.quant.spec import QuantSpec
from lineside.build.tensors import GGMLBlocks
from lineside.bundle import FlavorEntry
from lineside.config import ModelConfig

# What an emitter quantizes: a float array, carried GGUF blocks, or a GPTQ grid; a getter maps HF names to one.
Weight = np.ndarray | GGMLBlocks | Int4Grid
WeightGetter = Callable[[str], Weight]


class WeightSource(Protocol):
    """A checkpoint seen through a family's own naming (V4: official or HF names on disk); its graphs read it
    directly instead of through the pipeline's per-flavor getter."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> np.ndarray: ...


class ModelFamily(ABC):
    """Config checks, tensor names and graph emission for one family of architectures."""

    @abstractmethod
    def check_config(self, cfg: ModelConfig, flavors: tuple[str, ...]) -> None:
        """Refuse, before any work, a config these graphs cannot compute (one line)."""

    @abstractmethod
    def required_tensors(self, cfg: ModelConfig) -> list[str]:
        """Every HF tensor name the graphs read, so a missing one is named before building."""

    @abstractmethod
    def open_weights(self, cfg: ModelConfig, ckpt: CheckpointReader, where: str) -> WeightSource | None:
        """Check the checkpoint holds every tensor the graphs read, with the shapes the config implies (one
        line naming the first that does not). A family with its own naming returns the source its graphs
        read; None means they read through the pipeline's getter (GGUF blocks carried, AWQ/GPTQ applied)."""

    @abstractmethod
    def emit_graph(self, cfg: ModelConfig, weights: WeightGetter | WeightSource, spec: QuantSpec, flavor: str,
                   onnx_path: Path, max_seq_len: int, *, progress: Callable[[int], None] | None = None,
                   awq_scales: dict[str, np.ndarray] | None = None) -> FlavorEntry:
        """Write the ``flavor`` graph to ``onnx_path``; returns its manifest entry (``graph`` left empty)."""
