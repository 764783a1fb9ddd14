"""Which LoRA adapters a server offers and where each comes from: the bundle's own, or ``--lora-modules``.

The catalog reads every adapter once when the server starts (so a bad one fails the start, in one line,
and a request never waits on disk); which of them sit in the backend's slots is ``AdapterSlots``' business.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lineside.bundle import Bundle
from lineside.errors import LinesideError
from lineside.lora import AdapterError, LoraAdapter, check_name, read_adapter

if TYPE_CHECKING:
    from lineside.runtime.engine import LoraServing


DEFAULT_RUNTIME_SLOTS = 4  # --max-loras when it is not given: up to this many slots (as many as there are adapters)


def runtime_adapter(bundle: Bundle, name: str, path: str, *, max_rank: int,
                    locate: Callable[[str], Path] | None = None) -> LoraAdapter:
    """An adapter loaded into a running server (POST /v1/load_lora_adapter), checked as ``--lora-modules`` checks
    one (its name is checked by the caller): the PEFT directory, every shape against the base, its rank and linears
    against the slots. ``locate``: the directory a client's path names, raising where it may not be read."""
    from lineside.lora import LoraTarget, check_fits

    if not path.strip():
        raise AdapterError("lora_path is empty; give the PEFT adapter directory (adapter_config.json and "
                           "adapter_model.safetensors) as the server sees it")
    if any(ord(c) < 32 or ord(c) == 127 for c in path.strip()):  # it is echoed in every refusal and logged: one line
        raise AdapterError("lora_path holds a control character (a newline, a tab, ...); give the adapter "
                           "directory's path as the server sees it")
    lg = bundle.manifest.lora
    if lg is None:
        raise AdapterError(f"bundle {bundle.path} has no LoRA graphs; rebuild it with --max-lora-rank R")
    where = locate(path.strip()) if locate is not None else Path(path.strip()).expanduser()
    adapter = read_adapter(where, bundle.config, name)
    check_fits(adapter, max_rank, tuple(LoraTarget(t) for t in lg.targets), "this server's --max-lora-rank")
    return adapter


def bundle_adapter(bundle: Bundle, name: str) -> LoraAdapter:
    """The adapter ``name`` carried in the bundle (``lineside lora add``)."""
    entry = bundle.manifest.adapters.get(name)
    if entry is None and bundle.manifest.lora is None:  # `lora add` would refuse it too: say the first step
        raise AdapterError(f"bundle {bundle.path} has no LoRA graphs, so no adapter {name!r}; rebuild it with "
                           "--max-lora-rank R (R: the largest adapter rank), then `lineside lora add` the adapter")
    if entry is None:
        have = ", ".join(sorted(bundle.manifest.adapters)) or "none"
        raise AdapterError(f"bundle {bundle.path} has no adapter {name!r} (it has: {have}); add one with "
                           f"`lineside lora add {bundle.path} ADAPTER_DIR --name {name}`")
    return read_adapter(bundle.file(entry.dir), bundle.config, name)


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules name=DIR`` (vLLM's convention)."""

    name: str
    path: Path


def parse_lora_module(text: str) -> LoraModule:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise LinesideError(f"--lora-modules {text!r}: give NAME=ADAPTER_DIR (a PEFT adapter directory)")
    return LoraModule(check_name(name.strip()), Path(path.strip()).expanduser())


def parse_lora_modules(values: list[str]) -> list[LoraModule]:
    """Every ``--lora-modules`` value: ``NAME=DIR`` (several joined by commas) or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (its commas are the object's; ``base_model_name`` is the
    base this server serves anyway, so it is not read)."""
    out: list[LoraModule] = []
    for value in values:
        if value.strip().startswith("{"):
            out.append(_json_module(value))
        else:
            out += [parse_lora_module(m) for m in value.split(",") if m.strip()]
    return out


def _json_module(text: str) -> LoraModule:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LinesideError(f"--lora-modules {text!r}: not valid JSON ({e.msg}); give NAME=ADAPTER_DIR or "
                            '\'{"name": "NAME", "path": "ADAPTER_DIR"}\'') from None
    name, path = (obj.get("name"), obj.get("path")) if isinstance(obj, dict) else (None, None)
    if not (isinstance(name, str) and name.strip() and isinstance(path, str) and path.strip()):
        raise LinesideError(f'--lora-modules {text!r}: the JSON form needs "name" and "path" strings (vLLM\'s '
                            '{"name": "NAME", "path": "ADAPTER_DIR"})')
    return LoraModule(check_name(name.strip()), Path(path.strip()).expanduser())


class AdapterCatalog:
    """Adapters by served name, read and checked against the base model."""

    def __init__(self, adapters: dict[str, LoraAdapter]):
        self.adapters = adapters

    @classmethod
    def load(cls, bundle: Bundle, modules: list[LoraModule], *, include_bundle: bool = True) -> AdapterCatalog:
        out: dict[str, LoraAdapter] = {}
        if include_bundle:
            for name in bundle.manifest.adapters:
                out[name] = bundle_adapter(bundle, name)
        for m in modules:
            if m.name in out:
                raise LinesideError(f"--lora-modules: adapter name {m.name!r} is given twice (or is the bundle's "
                                    "own); choose another name")
            out[m.name] = read_adapter(m.path, bundle.config, m.name)
        return cls(out)

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    @property
    def max_rank(self) -> int:
        return max((a.rank for a in self.adapters.values()), default=0)

    def get(self, name: str) -> LoraAdapter | None:
        return self.adapters.get(name)


def serving_config(bundle: Bundle, modules: list[LoraModule], *, max_loras: int | None,
                   max_rank: int | None, runtime: bool = False) -> LoraServing | None:
    """What `serve` serves besides the base model: the bundle's adapters and ``--lora-modules``, in
    ``max_loras`` slots of rank ``max_rank`` (defaults: up to 4 slots, the bundle's slot rank). None when there
    are no adapters. Every adapter is read and checked here, before the server binds its socket. ``runtime``
    (``--allow-runtime-lora``): slots even with no adapter yet (4 by default), for adapters loaded later."""
    from lineside.lora import LoraTarget, check_fits
    from lineside.runtime.engine import LoraServing
    from lineside.runtime.lora_stack import LoraSlotsConfig

    if not modules and not bundle.manifest.adapters and not runtime:
        if max_loras:
            raise LinesideError("--max-loras: there are no adapters to serve; add one to the bundle with `lineside "
                                "lora add`, name one with --lora-modules NAME=DIR, or load them at runtime with "
                                "--allow-runtime-lora")
        return None
    lg = bundle.manifest.lora
    if lg is None:
        what = "--lora-modules" if modules or bundle.manifest.adapters else "--allow-runtime-lora"
        raise LinesideError(f"bundle {bundle.path} has no LoRA graphs, so it cannot serve {what}; rebuild it "
                            "with --max-lora-rank R (R: the largest adapter rank to serve)")
    catalog = AdapterCatalog.load(bundle, modules)
    rank = int(max_rank or lg.max_rank)
    targets = tuple(LoraTarget(t) for t in lg.targets)
    for adapter in catalog.adapters.values():
        check_fits(adapter, rank, targets, "--max-lora-rank" if max_rank else f"bundle {bundle.path}")
    default = DEFAULT_RUNTIME_SLOTS if runtime else min(len(catalog.adapters), DEFAULT_RUNTIME_SLOTS)
    slots = LoraSlotsConfig(max_loras=int(max_loras or default), max_rank=rank)
    slots.check()
    return LoraServing(adapters=catalog.adapters, slots=slots)
