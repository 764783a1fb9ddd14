"""The bundle: the portable artifact every part shares (build writes it, runtime/jetson read it).

A bundle is a directory with ``manifest.json`` listing every file with its size and sha256.
Opening a bundle verifies the manifest; a file that fails its checksum is refused by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lineside import __version__
from lineside.checksum_cache import NAME as CHECKSUM_STAMPS
from lineside.checksum_cache import ChecksumCache
from lineside.config import ModelConfig
from lineside.errors import BundleError
from lineside.file_lock import lock_exclusive
from lineside.graph_io import StateTensor

FORMAT_VERSION = 1
# FlavorEntry.extra key of the layerskip draft graphs (`build --draft-layers N`):
# {"N": {"graph": bundle-relative path, "inputs": [...], "state": [...], "weight_fraction": float}}
DRAFT_GRAPHS = "draft_graphs"
# FlavorEntry.extra key of DeepSeek-V4's multi-token-prediction graph (built when the checkpoint carries mtp.*):
# {"graph": bundle-relative path, "inputs": [...], "state": [...], "hidden": the main graph's output it reads,
#  "hidden_shape": [hc_mult, hidden], "weight_fraction": float}
MTP_GRAPH = "mtp_graph"
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class FileEntry:
    """One file the manifest lists (path relative to the bundle): what `open_bundle` checks it against."""

    size: int
    sha256: str

    def to_json_dict(self) -> dict[str, int | str]:
        return {"size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> FileEntry:
        return cls(size=int(d["size"]), sha256=str(d["sha256"]))


@dataclass
class FlavorEntry:
    """One graph flavor (``cpu``, ``trt``): its ONNX file, the control inputs it declares, its decode state.

    A family's ``emit_graph`` returns one with ``graph`` empty; the pipeline sets the bundle-relative path.
    """

    inputs: list[str]
    state: list[StateTensor]
    activation_dtype: str = "float32"
    graph: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # keys this lineside does not know, kept as read

    @property
    def lora_graph(self) -> str | None:
        """The bundle-relative path of this flavor's LoRA variant (beside ``graph``), None when it was not built."""
        return self._beside(self.extra.get("lora_graph"))

    @property
    def prefill_graph(self) -> str | None:
        """The bundle-relative path of this flavor's int8 prompt-chunk variant (cpu flavor), None when not built."""
        return self._beside(self.extra.get("prefill_graph"))

    def _beside(self, name: Any) -> str | None:
        return None if not name else f"{self.graph.rpartition('/')[0]}/{name}".lstrip("/")

    def to_json_dict(self) -> dict[str, Any]:
        return {**self.extra, "graph": self.graph, "inputs": list(self.inputs),
                "state": [s.to_dict() for s in self.state], "activation_dtype": self.activation_dtype}

    @classmethod
    def from_record(cls, d: Any, what: str) -> FlavorEntry:
        """A graph record kept beside a flavor's (a layerskip draft, the MTP graph), read when it is used: one
        line naming ``what`` when it is incomplete or holds a state kind this lineside does not know."""
        try:
            return cls.from_json_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BundleError(f"the bundle's {what} record is incomplete or from a newer lineside ({e}); rebuild "
                              "the bundle") from None

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> FlavorEntry:
        known = {"graph", "inputs", "state", "activation_dtype"}
        return cls(graph=str(d["graph"]), inputs=[str(n) for n in d.get("inputs") or []],
                   state=[StateTensor.from_dict(s) for s in d.get("state") or []],
                   activation_dtype=str(d.get("activation_dtype", "float32")),
                   extra={k: v for k, v in d.items() if k not in known})


@dataclass
class LoraGraphs:
    """The bundle's LoRA graphs: which linears they adapt and the rank an adapter slot holds by default."""

    max_rank: int
    targets: tuple[str, ...]

    def to_json_dict(self) -> dict[str, Any]:
        return {"max_rank": self.max_rank, "targets": list(self.targets)}

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> LoraGraphs:
        return cls(max_rank=int(d["max_rank"]), targets=tuple(str(t) for t in d["targets"]))


@dataclass
class AdapterEntry:
    """A LoRA adapter carried in the bundle (``lineside lora add``): its directory and what it adapts."""

    dir: str  # bundle-relative, holding adapter_config.json + adapter_model.safetensors
    rank: int
    lora_alpha: float
    use_rslora: bool
    targets: tuple[str, ...]
    bytes: int  # its A/B tensors in float32, what a loaded copy of it costs

    def to_json_dict(self) -> dict[str, Any]:
        return {"dir": self.dir, "rank": self.rank, "lora_alpha": self.lora_alpha, "use_rslora": self.use_rslora,
                "targets": list(self.targets), "bytes": self.bytes}

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> AdapterEntry:
        return cls(dir=str(d["dir"]), rank=int(d["rank"]), lora_alpha=float(d["lora_alpha"]),
                   use_rslora=bool(d["use_rslora"]), targets=tuple(str(t) for t in d["targets"]),
                   bytes=int(d.get("bytes", 0)))


@dataclass
class Manifest:
    """``manifest.json``, typed. Keys an older or hand-made manifest lacks are None (and stay out of the JSON);
    keys this version does not know (an older producer's, a newer one's) are kept in ``extra``."""

    architecture: str
    config: str  # the ModelConfig JSON, relative to the bundle
    max_seq_len: int
    flavors: dict[str, FlavorEntry] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)  # filled in by write_manifest
    format_version: int = FORMAT_VERSION
    model_name: str | None = None  # the checkpoint's own name (a served alias)
    source: dict[str, str] | None = None  # {"path", "format": "hf" | "gguf"}
    quantization: dict[str, Any] | None = None  # scheme, method, what was kept in high precision, calibration
    tokenizer: dict[str, Any] | None = None  # {"dir", ...}: what the build's tokenizer writer recorded
    lineside_version: str | None = None
    build_seconds: float | None = None
    lora: LoraGraphs | None = None  # built with --max-lora-rank: the flavors carry LoRA graphs
    adapters: dict[str, AdapterEntry] = field(default_factory=dict)  # by name (a served model name)
    extra: dict[str, Any] = field(default_factory=dict)

    _REQUIRED = ("architecture", "config", "max_seq_len")
    _OPTIONAL = ("model_name", "source", "quantization", "tokenizer", "lineside_version", "build_seconds")

    def graph_sha(self, flavor: str) -> str | None:
        """The sha256 of ``flavor``'s graph file as listed here (None when the flavor or the file is not):
        the engine key ties a TensorRT engine to the exact graph it was built from."""
        entry = self.flavors.get(flavor)
        listed = self.files.get(entry.graph) if entry is not None else None
        return listed.sha256 if listed is not None else None

    def files_digest(self, keep: Callable[[str], bool]) -> str | None:
        """One sha256 over the listed digests of the files ``keep`` picks (None if it picks none): what a cache
        built from those files (onnxruntime's optimized graph, a TensorRT engine) is keyed by."""
        shas = [f"{rel}:{f.sha256}" for rel, f in sorted(self.files.items()) if keep(rel)]
        return hashlib.sha256("\n".join(shas).encode()).hexdigest() if shas else None

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update(architecture=self.architecture, config=self.config, max_seq_len=self.max_seq_len,
                   flavors={k: v.to_json_dict() for k, v in self.flavors.items()},
                   files={k: v.to_json_dict() for k, v in self.files.items()}, format_version=self.format_version)
        out.update({k: getattr(self, k) for k in self._OPTIONAL if getattr(self, k) is not None})
        if self.lora is not None:
            out["lora"] = self.lora.to_json_dict()
        if self.adapters:
            out["adapters"] = {k: v.to_json_dict() for k, v in self.adapters.items()}
        return out

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> Manifest:
        """Parse; raises ValueError naming a missing field or a state kind this version does not know."""
        missing = [k for k in cls._REQUIRED if k not in d]
        if missing:
            raise ValueError(f"no {missing[0]!r} field")
        known = {*cls._REQUIRED, *cls._OPTIONAL, "flavors", "files", "format_version", "lora", "adapters"}
        max_seq_len = d["max_seq_len"]
        if type(max_seq_len) is not int or max_seq_len < 1:  # the manifest is not checksummed: hand edits reach here
            raise ValueError(f"max_seq_len {max_seq_len!r} is not a positive integer")
        try:
            return cls(architecture=str(d["architecture"]), config=str(d["config"]), max_seq_len=max_seq_len,
                       flavors={str(k): FlavorEntry.from_json_dict(v) for k, v in (d.get("flavors") or {}).items()},
                       files={str(k): FileEntry.from_json_dict(v) for k, v in (d.get("files") or {}).items()},
                       format_version=int(d.get("format_version", FORMAT_VERSION)),
                       **{k: d[k] for k in cls._OPTIONAL if d.get(k) is not None},
                       lora=LoraGraphs.from_json_dict(d["lora"]) if d.get("lora") else None,
                       adapters={str(k): AdapterEntry.from_json_dict(v) for k, v in (d.get("adapters") or {}).items()},
                       extra={k: v for k, v in d.items() if k not in known})
        except (KeyError, TypeError, AttributeError, OverflowError) as e:  # OverflowError: a size of Infinity
            raise ValueError(f"malformed entry ({type(e).__name__}: {e})") from None


def manifest_flavor(path: Path, manifest: Manifest, name: str) -> FlavorEntry:
    """The bundle's ``name`` graph; one line naming what it has when it was not built."""
    if name not in manifest.flavors:
        have = ", ".join(sorted(manifest.flavors)) or "none"
        wanted = ",".join(sorted({*manifest.flavors, name}))  # keep what it has: cpu sorts before trt
        raise BundleError(f"bundle {path} has no {name!r} graph (it has: {have}); rebuild with --flavors {wanted}")
    return manifest.flavors[name]


@dataclass
class Bundle:
    """An opened (and verified) bundle directory."""

    path: Path
    manifest: Manifest
    config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        self.config = ModelConfig.from_json_dict(json.loads((self.path / self.manifest.config).read_text()))

    @property
    def architecture(self) -> str:
        return self.manifest.architecture

    @property
    def max_seq_len(self) -> int:
        return self.manifest.max_seq_len

    @property
    def flavors(self) -> dict[str, FlavorEntry]:
        return self.manifest.flavors

    def flavor(self, name: str) -> FlavorEntry:
        return manifest_flavor(self.path, self.manifest, name)

    def file(self, rel: str) -> Path:
        return self.path / rel

    def graph_weight_bytes(self, rel: str) -> int:
        """Bytes of the initializers the graph ``rel`` reads (a decode step reads them all): not the size of its data
        file, which a flavor's graphs share (the cpu flavor's int8 prefill weights sit in it too). Read from the
        file's wire format: `serve --speculative draft:...` asks at start, and importing onnx costs ~0.65 s."""
        from lineside.onnx_wire import initializer_bytes

        return initializer_bytes(self.file(rel))

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"


def write_manifest(bundle_dir: Path, manifest: Manifest) -> Manifest:
    """Hash every file under ``bundle_dir`` (but the manifest, the checksum stamps and engines/) into the manifest
    and save it."""
    files: dict[str, FileEntry] = {}
    for p in sorted(bundle_dir.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(bundle_dir).as_posix()
        if rel in (MANIFEST, CHECKSUM_STAMPS) or rel.startswith("engines/"):
            continue
        files[rel] = FileEntry(size=p.stat().st_size, sha256=sha256_file(p))
    manifest = replace(manifest, format_version=FORMAT_VERSION, files=files)
    tmp = bundle_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json_dict(), indent=2, sort_keys=True))
    os.replace(tmp, bundle_dir / MANIFEST)
    return manifest


def add_to_manifest(bundle_dir: Path, manifest: Manifest, files: list[str]) -> Manifest:
    """Hash ``files`` (bundle-relative) into an existing bundle's manifest and save it; every other entry stays as
    built (a bundle in use holds files no manifest lists, such as onnxruntime's graph caches)."""
    listed = dict(manifest.files)
    for rel in files:
        p = Path(bundle_dir) / rel
        listed[rel] = FileEntry(size=p.stat().st_size, sha256=sha256_file(p))
    manifest = replace(manifest, files=dict(sorted(listed.items())))
    tmp = Path(bundle_dir) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json_dict(), indent=2, sort_keys=True))
    os.replace(tmp, Path(bundle_dir) / MANIFEST)
    return manifest


@contextlib.contextmanager
def manifest_lock(bundle_dir: Path) -> Iterator[None]:
    """Held while a command reads a bundle's manifest, changes the bundle and writes the manifest back (`lora
    add`): a second one waits, so it reads what the first wrote instead of writing back a manifest without it.
    An flock on the bundle directory, which the kernel drops when the holder dies."""
    fd = os.open(bundle_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        lock_exclusive(fd, wait=True)  # no locks here: unguarded, as before
        yield
    finally:
        os.close(fd)


def holds_bundle(path: Path) -> bool:
    """Whether the directory ``path`` is a lineside bundle (its manifest.json names an architecture and a file list,
    or a damaged one sits beside its graphs/): what `build --force` may replace. Anything else is a user's own
    directory, which a build must not delete to put a bundle there."""
    mf = Path(path) / MANIFEST
    if not mf.is_file():
        return False
    if (Path(path) / "graphs").is_dir():
        return True
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return False
    return isinstance(manifest, dict) and "architecture" in manifest and isinstance(manifest.get("files"), dict)


def _not_a_bundle(path: Path) -> str:
    """Why ``path`` is not a bundle, and what to pass instead: the commands that take a bundle are often handed the
    checkpoint it is built from (a .gguf, a Hugging Face directory) or a file inside it."""
    inside = next((p for p in path.parents if (p / MANIFEST).is_file()), None)
    if inside is not None:
        what = "a directory" if path.is_dir() else "a file"
        return f"{path}: pass the bundle directory ({inside}), not {what} inside it"
    if _is_gguf(path) or (path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors*"))):
        return f"{path} is a checkpoint, not a bundle; build a bundle from it first: `lineside build {path} -o BUNDLE`"
    aside = path.with_name(f".{path.name}.replaced")  # cli_checks.replace_dir's name for what it replaces
    if not path.exists() and (aside / MANIFEST).is_file():
        return (f"{path} does not exist: a `build --force` into it was killed while replacing it and left the "
                f"previous bundle at {aside}; put it back (`mv {aside} {path}`) or build again")
    if not path.exists():
        return f"{path}: not a bundle directory (it does not exist); build one with `lineside build CHECKPOINT -o {path}`"
    if path.is_dir() and path.name.endswith(".partial"):  # where build assembles a bundle (cli_checks.staged_dir)
        done = path.with_name(path.name[:-len(".partial")])
        return (f"{path} is an unfinished build (stopped before its manifest was written), not a bundle; build "
                f"again with -o {done} (which removes it), or serve {done} if that is complete")
    if path.is_dir():
        return f"{path}: no manifest.json; this is not a lineside bundle (rebuild it)"
    return f"{path}: not a bundle directory; pass the directory `lineside build CHECKPOINT -o BUNDLE` wrote"


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return path.suffix.lower() == ".gguf" or f.read(4) == b"GGUF"


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def leaves_bundle(rel: str) -> bool:
    """Whether a manifest path fails to name a file inside the bundle: empty, absolute, with a ``..`` (or ``.``, or
    empty) part, or a control character (a newline would split the file lists push hands to rsync and sha256sum).

    The manifest is not checksummed and a bundle arrives from another machine; its paths are joined to the
    bundle's directory to read, to copy (`jetson push`) and to write beside (onnxruntime's graph cache), so one
    that leaves the directory would read or write wherever it points."""
    return (not rel or rel.startswith("/") or _CONTROL.search(rel) is not None
            or any(part in ("", ".", "..") for part in rel.split("/")))


def _manifest_paths(m: Manifest) -> list[tuple[str, str]]:
    """(what, path) of every bundle-relative path the manifest names."""
    paths = [("file", rel) for rel in m.files] + [("config", m.config)]
    for name, fl in m.flavors.items():
        paths.append((f"{name} graph", fl.graph))
        if fl.extra.get("lora_graph"):
            paths.append((f"{name} LoRA graph", str(fl.lora_graph)))
        if fl.extra.get("prefill_graph"):
            paths.append((f"{name} prefill graph", str(fl.prefill_graph)))
        drafts = fl.extra.get(DRAFT_GRAPHS)
        records = [(f"{name} draft graph {n}", r) for n, r in drafts.items()] if isinstance(drafts, dict) else []
        records.append((f"{name} MTP graph", fl.extra.get(MTP_GRAPH)))
        paths += [(what, str(r["graph"])) for what, r in records if isinstance(r, dict) and "graph" in r]
    paths += [(f"adapter {name!r}", a.dir) for name, a in m.adapters.items()]
    return paths


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and check ``manifest.json`` (format version, file list, required fields); one line if it is wrong."""
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir() or not mf.is_file():
        raise BundleError(_not_a_bundle(path))
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{mf}: malformed manifest ({e}); rebuild the bundle") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise BundleError(f"{mf}: manifest has no file list; rebuild the bundle")
    fv = manifest.get("format_version")
    producer = manifest.get("lineside_version")
    by = f" (written by lineside {producer})" if isinstance(producer, str) and producer else ""
    if type(fv) is int and fv > FORMAT_VERSION:
        raise BundleError(f"{mf}: bundle format {fv}{by} is newer than lineside {__version__} reads "
                          f"({FORMAT_VERSION}); upgrade lineside (`pip install -U lineside`) or rebuild the bundle "
                          "with this one")
    if fv != FORMAT_VERSION:
        raise BundleError(f"{mf}: bundle format {fv!r}, this lineside reads {FORMAT_VERSION}; rebuild the bundle")
    try:
        parsed = Manifest.from_json_dict(manifest)
    except ValueError as e:
        upgrade = (f"written by lineside {producer}, this is {__version__}: upgrade lineside or rebuild the bundle"
                   if _newer(producer) else "rebuild the bundle")
        raise BundleError(f"{mf}: manifest is incomplete or from a newer lineside ({e}); {upgrade}") from None
    for what, rel in _manifest_paths(parsed):
        if leaves_bundle(rel):
            raise BundleError(f"{mf}: {what} {rel!r} is not a path inside the bundle; a bundle lists only its own "
                              "files — rebuild it or copy it again from where it was built")
    return parsed


def _newer(version: Any) -> bool:
    """Whether a manifest's ``lineside_version`` is later than this lineside (release numbers compared; anything
    unparsable is not newer): a record this version cannot read then calls for an upgrade, not only a rebuild."""
    def release(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3])

    return isinstance(version, str) and release(version) > release(__version__)


def verify_files(path: Path, manifest: Manifest, check_hash: bool = True) -> None:
    """Check every listed file exists with its size (and sha256); raise naming the first that fails.
    A file unchanged since it last matched is not hashed again (checksum_cache)."""
    for what, rel in _manifest_paths(manifest):
        if what != "file" and not what.startswith("adapter ") and rel not in manifest.files:
            raise BundleError(f"{path / MANIFEST}: the {what} {rel} is not among the manifest's files, so nothing "
                              "checks it; rebuild the bundle or copy it again from where it was built")
    cache = ChecksumCache(path, _manifest_sha256(path)) if check_hash else None
    root = path.resolve()
    for rel, meta in manifest.files.items():
        p = path / rel
        if not p.is_file():
            raise BundleError(f"bundle file {rel} is missing from {path}; {_good_copy(path, manifest)}")
        if not p.resolve().is_relative_to(root):  # a symlink (or a linked folder) in the bundle leading out of it
            raise BundleError(f"bundle file {rel} is a link to {p.resolve()}, outside the bundle {path}; copy the "
                              "bundle again without links (cp -rL, rsync -L)")
        st = p.stat()
        if st.st_size != meta.size:
            raise BundleError(
                f"bundle file {rel} has {st.st_size} bytes, the manifest says {meta.size}; "
                f"it was changed or truncated — {_good_copy(path, manifest)}"
            )
        if cache is None or cache.known_good(rel, st, meta.sha256):
            continue
        if sha256_file(p) != meta.sha256:
            raise BundleError(
                f"bundle file {rel} fails its sha256 check (changed after build); {_good_copy(path, manifest)}"
            )
        cache.add(rel, st, meta.sha256)
    if cache is not None:
        cache.save()


def _manifest_sha256(path: Path) -> str:
    """The manifest file's sha256 (empty if it is gone): the verification record a read-only bundle keeps in the
    per-user cache is named by it, so a new build put in the same place never reads the old build's record."""
    try:
        return hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        return ""


def _good_copy(path: Path, manifest: Manifest) -> str:
    """What to do about a listed file that is missing or changed: there is no re-verifying a changed file (the
    manifest's digest is the build's word), so a good copy from the build machine, or the build command again."""
    source = (manifest.source or {}).get("path") or "CHECKPOINT"
    return (f"copy the bundle again from where it was built, or rebuild it from its checkpoint: "
            f"`lineside build {shlex.quote(str(source))} -o {shlex.quote(str(path))} --force` (with its build options)")


def open_bundle(path: str | os.PathLike[str], verify: bool = True) -> Bundle:
    """Open a bundle, verifying sizes and checksums of every file it lists.

    A bundle named through a link (a Jetson's ``current``, which `jetson push` switches by renaming another link
    over it) is opened at the version the link leads to now: the manifest, the check and every file read later
    (graphs, tokenizer) come from that one version, not partly from the next one the link is switched to."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    manifest = read_manifest(path)
    verify_files(path, manifest, check_hash=verify)
    try:
        return Bundle(path=path, manifest=manifest)
    except (KeyError, json.JSONDecodeError, TypeError) as e:
        raise BundleError(f"{path}: manifest or config is incomplete ({e}); rebuild the bundle") from None


_PUSHED = re.compile(r"-[0-9a-f]{12}-\d{8}T\d{6}Z$")


def default_model_names(bundle_path: str | Path, manifest: dict[str, Any] | None) -> list[str]:
    """The names `serve` answers to by default: the bundle directory's name (its target's when it is a link, e.g.
    a Jetson ``current``), then the checkpoint's name from the manifest (``org/model`` and ``model``), so clients
    may send either."""
    path = Path(bundle_path)
    name = path.resolve().name if path.is_symlink() else path.name
    names = [_PUSHED.sub("", name) or name]  # `lineside jetson push` names versions <bundle>-<hash12>-<time>
    if manifest is None:
        try:
            manifest = read_manifest(path).to_json_dict()
        except Exception:  # noqa: BLE001 - a bad bundle is reported by the loader, not here
            manifest = {}
    model = str(manifest.get("model_name") or "")
    for candidate in (model, model.rsplit("/", 1)[-1]):
        if candidate and candidate not in names:
            names.append(candidate)
    return names
