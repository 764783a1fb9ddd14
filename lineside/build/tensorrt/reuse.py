"""Whether an engine directory already holds the engine a build was asked for, so the build can be skipped.

Two builds of one engine at once (a service restart racing a manual `jetson ensure-engine`, two containers sharing
a bundle) take turns on its lock; the second then finds the first's engine here instead of spending minutes again.
An engine counts only when built on this machine from the bundle's graph files now, whole, and with the same
settings (engine.json's limits, profiles, precision, LoRA slots and builder options): other settings rebuild.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lineside.runtime.tensorrt.key import (
    ENGINE_FILE,
    ENGINE_JSON,
    MachineKey,
    engine_damage,
    fresh_for,
    key_of,
)

SETTINGS_FIELDS = ("limits", "profiles", "fp16", "kv_dtype", "lora", "builder")


def builder_settings(workspace_gb: float | None, opt_level: int | None) -> dict[str, Any]:
    """The builder options that change the engine's tactics but not its shapes: asked for again, they rebuild."""
    return {"workspace_gb": workspace_gb, "opt_level": opt_level}


def wanted_settings(limits: dict[str, int], profiles: list[dict[str, Any]], fp16: bool, kv_dtype: str,
                    lora: dict[str, int] | None, builder: dict[str, Any]) -> dict[str, Any]:
    """The engine.json fields a build of these options would write, as JSON reads them back."""
    out = {"limits": limits, "profiles": profiles, "fp16": fp16, "kv_dtype": kv_dtype, "lora": lora,
           "builder": builder}
    return json.loads(json.dumps(out))


def reusable_engine(d: Path, here: MachineKey, graph_sha256: str | None, content: str | None,
                    wanted: dict[str, Any]) -> bool:
    """``d`` holds a loadable engine for ``here`` built from these graph files with the ``wanted`` settings (an
    engine.json from before the builder options were recorded never matches: it is rebuilt, as before)."""
    try:
        meta = json.loads((d / ENGINE_JSON).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or key_of(meta) != here or not (d / ENGINE_FILE).is_file():
        return False
    if "builder" not in meta or not fresh_for(meta, graph_sha256, content):
        return False
    if any(meta.get(f) != wanted[f] for f in SETTINGS_FIELDS):
        return False
    return engine_damage(d, meta) is None
