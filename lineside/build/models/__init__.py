"""Model families: each module parses its config, names its tensors and emits its graphs."""

from __future__ import annotations

import importlib
from types import ModuleType

from lineside.errors import ConfigError

_FAMILIES = {"llama": "lineside.build.models.dense", "qwen2": "lineside.build.models.dense",
             "deepseek_v4": "lineside.build.models.deepseek_v4"}


def family_module(architecture: str) -> ModuleType:
    """The module with ``required_tensors(cfg)`` and ``emit_graph(...)`` for an architecture."""
    if architecture not in _FAMILIES:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_FAMILIES))}")
    return importlib.import_module(_FAMILIES[architecture])
