"""Engine keys: an engine runs only on the GPU model and TensorRT version it was built with.

Engines live under ``BUNDLE/engines/<key>/`` (a bundle that can't be written to: under the per-user cache,
``engines/<digest of the trt graph's files>/<key>/``, see user_cache) with ``model.engine`` and a small ``engine.json``
(GPU name, compute capability, TensorRT and CUDA versions, profile shapes, the digest of the trt graphs'
files it was built from and of the engine file itself). Loading compares the machine with ``engine.json``
and refuses a mismatch with a line naming what differs; an engine of older graph files (the bundle rebuilt
in place, new weights under the same graph) or whose file changed or was cut short counts as no engine.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lineside import user_cache
from lineside.bundle import Manifest
from lineside.checksum_cache import ChecksumCache
from lineside.errors import BundleError

ENGINES_DIR = "engines"
ENGINE_FILE = "model.engine"
ENGINE_JSON = "engine.json"
TIMING_CACHE = "timing.cache"
CONTENT_FIELD = "content_sha256"  # engine.json: digest of the trt graphs' files (graph_files_sha)
SEAL_FIELDS = ("engine_bytes", "engine_sha256")  # engine.json: the engine file's size and sha256
USER_FOLDER = "engines"  # under the per-user cache directory, for bundles that can't be written to


@dataclass(frozen=True)
class MachineKey:
    """What an engine is bound to."""

    gpu_name: str
    compute_capability: str  # "8.7"
    tensorrt: str  # "10.3.0"
    cuda: str  # CUDA runtime "12.6"

    @property
    def key(self) -> str:
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu_name.lower()).strip("-") or "gpu"
        sm = self.compute_capability.replace(".", "")
        return f"{gpu}-sm{sm}-trt{self.tensorrt}-cuda{self.cuda}"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MachineKey:
        return cls(str(d["gpu_name"]), str(d["compute_capability"]), str(d["tensorrt"]), str(d["cuda"]))


_LABELS = {"gpu_name": "GPU", "compute_capability": "SM", "tensorrt": "TensorRT", "cuda": "CUDA"}


def differences(built: MachineKey, here: MachineKey) -> list[str]:
    """Human-readable fields that differ, e.g. ``TensorRT 10.3.0 → 10.15.1``."""
    out = []
    for f, label in _LABELS.items():
        a, b = getattr(built, f), getattr(here, f)
        if a != b:
            out.append(f"{label} {a} (engine) vs {b} (here)")
    return out


def machine_key() -> MachineKey:
    """This machine's key (needs cuda-python, a GPU and TensorRT; one clear line when one is missing)."""
    from lineside.runtime.tensorrt.env import probe_gpu, tensorrt_version

    gpu = probe_gpu()
    return MachineKey(gpu.name, gpu.sm, tensorrt_version(), gpu.cuda_runtime)


def engine_dir(bundle_path: Path, key: MachineKey) -> Path:
    return Path(bundle_path) / ENGINES_DIR / key.key


def user_engines(content: str | None, make: bool = False) -> Path | None:
    """Where a read-only bundle's engines are kept in the per-user cache: one folder per content of its trt graph
    files, so a copy of the bundle elsewhere shares them and a rebuilt one never does (None: no such cache)."""
    if not content:
        return None
    base = user_cache.folder(USER_FOLDER, make=make)
    if base is None:
        return None
    path = base / content[:32]
    if make:
        path.mkdir(exist_ok=True, mode=0o700)
    return path if path.is_dir() else None


def rebuild_hint(bundle_path: Path) -> str:
    return f"rebuild it here with `lineside engine {bundle_path}`"


def graph_files_sha(manifest: Manifest) -> str | None:
    """One digest of every file in the trt graph's folder (the graph, its LoRA graph and their weights) as the
    manifest lists them: the graph file alone names its weights by offset, not content, so a bundle rebuilt with
    new weights of the same shapes has the same graph sha256 and needs a new engine all the same."""
    entry = manifest.flavors.get("trt")
    if entry is None:
        return None
    folder = entry.graph.rpartition("/")[0] + "/"
    return manifest.files_digest(lambda rel: rel.startswith(folder))


def engine_seal(data: bytes) -> dict[str, Any]:
    """The engine.json fields that tie it to its engine file's exact bytes."""
    return {"engine_bytes": len(data), "engine_sha256": hashlib.sha256(data).hexdigest()}


def engine_damage(d: Path, meta: dict[str, Any], data: bytes | None = None) -> str | None:
    """Why ``d``'s engine file is not the one its engine.json was written for (cut short by a full disk or a
    kill, changed on disk, replaced by another build meanwhile), or None when it is (or engine.json predates
    the seal). TensorRT would deserialize a damaged plan blindly: at best an error, at worst a crash. A file
    hashed once is stamped (checksum_cache: inode, size, times) so later starts don't hash gigabytes again."""
    if not all(f in meta for f in SEAL_FIELDS):
        return None
    path = d / ENGINE_FILE
    try:
        st = path.stat()
        if st.st_size != int(meta["engine_bytes"]):
            return f"{path} has {st.st_size} bytes, {d / ENGINE_JSON} says {meta['engine_bytes']} (cut short or replaced)"
        sha = str(meta["engine_sha256"])
        stamps = ChecksumCache(d, sha)
        if stamps.known_good(ENGINE_FILE, st, sha):
            return None
        raw = path.read_bytes() if data is None else data
    except OSError as e:
        return f"cannot read {path} ({e.strerror or type(e).__name__})"
    if hashlib.sha256(raw).hexdigest() != sha:
        return f"{path} does not match the sha256 in {d / ENGINE_JSON} (changed on disk or replaced)"
    stamps.add(ENGINE_FILE, st, sha)
    stamps.save()
    return None


def fresh_for(meta: dict[str, Any], graph_sha256: str | None, content: str | None) -> bool:
    """Built from the graph files the bundle lists now (a record without a field is not held against it)."""
    if graph_sha256 and meta.get("graph_sha256") not in (None, graph_sha256):
        return False
    return not (content and meta.get(CONTENT_FIELD) not in (None, content))


def list_engines(bundle_path: Path, content: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """The engines beside the bundle, then (given its graph_files_sha ``content``) those in the per-user cache."""
    out = []
    for root in (Path(bundle_path) / ENGINES_DIR, user_engines(content)):
        if root is None or not root.is_dir():
            continue
        for d in sorted(root.iterdir()):
            meta = d / ENGINE_JSON
            if meta.is_file():
                try:
                    m = json.loads(meta.read_text())
                    lora_of(m)  # a malformed lora field: as unreadable as bad JSON
                except (OSError, ValueError, AttributeError, KeyError, TypeError):
                    continue  # junk (not JSON, not an object): never an engine, never a crash of the lookup
                out.append((d, m))
    return out


def lora_of(meta: dict[str, Any]) -> tuple[int, int] | None:
    """(adapter slots, slot rank) of an engine built from the LoRA graph; None for the base graph's."""
    lora = meta.get("lora")
    return (int(lora["max_loras"]), int(lora["max_rank"])) if isinstance(lora, dict) else None


def lora_engine_dir(bundle_path: Path, key: MachineKey, max_loras: int, max_rank: int) -> Path:
    """Beside the base engine: the LoRA graph's engine for a number of adapter slots of one rank."""
    return Path(bundle_path) / ENGINES_DIR / f"{key.key}-lora{max_loras}x{max_rank}"


def find_engine(bundle_path: Path, here: MachineKey, graph_sha256: str | None = None,
                lora: tuple[int, int] | None = None, content: str | None = None) -> tuple[Path, dict[str, Any]]:
    """The engine directory built for ``here`` (from the LoRA graph with ``lora`` = (slots, rank) when given),
    or a BundleError saying what differs and how to rebuild; ``content``: the bundle's graph_files_sha."""
    bundle_path = Path(bundle_path)
    engines = [(d, m) for d, m in list_engines(bundle_path, content) if lora_of(m) == lora]
    if lora is not None and not any(key_of(m) == here for _, m in engines):
        raise BundleError(f"no TensorRT engine for {lora[0]} LoRA slots of rank {lora[1]} in {bundle_path}; build "
                          f"one with `lineside engine {bundle_path} --max-loras {lora[0]} --max-lora-rank {lora[1]}`")
    mine = [(d, m) for d, m in engines if key_of(m) == here]
    for d, meta in mine:  # beside the bundle first; a stale one there does not hide a good one in the user cache
        if (d / ENGINE_FILE).is_file() and fresh_for(meta, graph_sha256, content):
            return d, meta
    for d, _meta in mine:
        if not (d / ENGINE_FILE).is_file():
            raise BundleError(f"{d}/{ENGINE_FILE} is missing; {rebuild_hint(bundle_path)}")
        raise BundleError(f"engine {d.name} was built from an older trt graph or weights of this bundle; "
                          f"{rebuild_hint(bundle_path)}")
    if not engines:
        raise BundleError(f"no TensorRT engine in {bundle_path} (this machine's key is {here.key}); "
                          f"build one with `lineside engine {bundle_path}`")
    d, meta = next(((d, m) for d, m in engines if key_of(m) is not None), engines[0])  # name a real mismatch
    built = key_of(meta)
    if built is None:
        raise BundleError(f"{d / ENGINE_JSON} is incomplete; {rebuild_hint(bundle_path)}")
    diff = "; ".join(differences(built, here))
    raise BundleError(f"engine {d.name} in {bundle_path} does not match this machine ({diff}); "
                      f"engines are not portable across GPUs or TensorRT versions — {rebuild_hint(bundle_path)}")


def key_of(meta: dict[str, Any]) -> MachineKey | None:
    """The machine an engine.json says its engine was built on (None when incomplete)."""
    try:
        return MachineKey.from_dict(meta["machine"])
    except (KeyError, TypeError):
        return None


def has_engine_for(bundle_path: Path, here: MachineKey, manifest: Manifest | None = None) -> bool:
    """Whether the bundle holds a base-graph engine for ``here`` that can be loaded as it is: built from the graph
    files ``manifest`` lists now (when given), its file whole. A LoRA engine does not count: serve needs the base."""
    graph_sha = manifest.graph_sha("trt") if manifest is not None else None
    content = graph_files_sha(manifest) if manifest is not None else None
    return any(key_of(m) == here and lora_of(m) is None and (d / ENGINE_FILE).is_file()
               and fresh_for(m, graph_sha, content) and engine_damage(d, m) is None
               for d, m in list_engines(Path(bundle_path), content))
