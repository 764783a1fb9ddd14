"""Which LoRA adapters a server offers and where each comes from: the bundle's own, or ``--lora-modules``.

The catalog reads every adapter once when the server starts (so a bad one fails the start, in one line,
and a request never waits on disk); which of them sit in the backend's slots is ``AdapterSlots``' business.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lineside.bundle import Bundle
from lineside.errors import LinesideError
from lineside.lora import AdapterError, LoraAdapter, check_name, read_adapter


def bundle_adapter(bundle: Bundle, name: str) -> LoraAdapter:
    """The adapter ``name`` carried in the bundle (``lineside lora add``)."""
    entry = bundle.manifest.adapters.get(name)
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
