"""Model families: each module parses its config, names its tensors and emits its graphs (``family.py``)."""

from __future__ import annotations

import importlib

from lineside.build.models.family import ModelFamily
from lineside.errors import ConfigError

_FAMILIES = {"llama": "lineside.build.models.dense", "qwen2": "lineside.build.models.dense",
             "deepseek_v4": "lineside.build.models.deepseek_v4"}


def model_family(architecture: str) -> ModelFamily:
    """The family that builds an architecture (its module is imported on first use)."""
    if architecture not in _FAMILIES:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_FAMILIES))}")
    family = importlib.import_module(_FAMILIES[architecture]).FAMILY
    assert isinstance(family, ModelFamily), _FAMILIES[architecture]
    return family
