"""The bundle: the portable artifact every part shares (build writes it, runtime/jetson read it).

A bundle is a directory with ``manifest.json`` listing every file with its size and sha256.
Opening a bundle verifies the manifest; a file that fails its checksum is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lineside.config import ModelConfig
from lineside.errors import BundleError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Bundle:
    """An opened (and verified) bundle directory."""

    path: Path
    manifest: dict[str, Any]
    config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        self.config = ModelConfig.from_json_dict(json.loads((self.path / self.manifest["config"]).read_text()))

    @property
    def architecture(self) -> str:
        return self.manifest["architecture"]

    @property
    def max_seq_len(self) -> int:
        return int(self.manifest["max_seq_len"])

    @property
    def flavors(self) -> dict[str, Any]:
        return self.manifest["flavors"]

    def flavor(self, name: str) -> dict[str, Any]:
        if name not in self.flavors:
            have = ", ".join(sorted(self.flavors)) or "none"
            raise BundleError(
                f"bundle {self.path} has no {name!r} graph (it has: {have}); rebuild with --flavors {name}"
            )
        return self.flavors[name]

    def file(self, rel: str) -> Path:
        return self.path / rel

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"


def write_manifest(bundle_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash every file under ``bundle_dir`` (but the manifest and engines/) into the manifest and save it."""
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(bundle_dir.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(bundle_dir).as_posix()
        if rel == MANIFEST or rel.startswith("engines/"):
            continue
        files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = dict(manifest)
    manifest["format_version"] = FORMAT_VERSION
    manifest["files"] = files
    tmp = bundle_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, bundle_dir / MANIFEST)
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle directory; build one with `lineside build CHECKPOINT -o {path}`")
    if not mf.is_file():
        raise BundleError(f"{path}: no manifest.json; this is not a lineside bundle (rebuild it)")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{mf}: malformed manifest ({e}); rebuild the bundle") from None
    if not isinstance(manifest, dict) or "files" not in manifest:
        raise BundleError(f"{mf}: manifest has no file list; rebuild the bundle")
    fv = manifest.get("format_version")
    if fv != FORMAT_VERSION:
        raise BundleError(f"{mf}: bundle format {fv!r}, this lineside reads {FORMAT_VERSION}; rebuild the bundle")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], check_hash: bool = True) -> None:
    """Check every listed file exists with its size (and sha256); raise naming the first that fails."""
    for rel, meta in manifest["files"].items():
        p = path / rel
        if not p.is_file():
            raise BundleError(f"bundle file {rel} is missing from {path}; copy the bundle again")
        if p.stat().st_size != meta["size"]:
            raise BundleError(
                f"bundle file {rel} has {p.stat().st_size} bytes, the manifest says {meta['size']}; "
                "it was changed or truncated — copy the bundle again"
            )
        if check_hash and sha256_file(p) != meta["sha256"]:
            raise BundleError(
                f"bundle file {rel} fails its sha256 check (changed after build); copy or rebuild the bundle"
            )


def open_bundle(path: str | os.PathLike[str], verify: bool = True) -> Bundle:
    """Open a bundle, verifying sizes and checksums of every file it lists."""
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest, check_hash=verify)
    try:
        return Bundle(path=path, manifest=manifest)
    except (KeyError, json.JSONDecodeError, TypeError) as e:
        raise BundleError(f"{path}: manifest or config is incomplete ({e}); rebuild the bundle") from None
