"""Push a bundle to a device: resumable copy, sha256 verified on the target, atomic activation.

Layout on the target::

    TARGET/versions/.incoming-<hash12>/     a transfer in progress (a rerun resumes it)
    TARGET/versions/<name>-<hash12>-<time>/ installed bundles (manifest.json + its files)
    TARGET/current  -> versions/<...>       the active bundle (switched by rename: atomic)
    TARGET/previous -> versions/<...>       the one before (what `rollback` returns to)
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lineside.bundle import MANIFEST, Manifest, read_manifest, verify_files
from lineside.errors import BundleError, LinesideError
from lineside.jetson.device_runtime import FORCE, DeviceRefused, refusal
from lineside.jetson.device_runtime import probe as probe_runtime
from lineside.jetson.push_lock import push_lock
from lineside.jetson.restart_hint import restart_command
from lineside.jetson.targets import DiskFull, LocalTarget, Progress, SshTarget, open_target


@dataclass
class PushResult:
    target: str
    version: str
    previous: str | None
    files: int
    bytes_total: int
    bytes_sent: int
    resumed_files: int
    already_installed: bool
    device: str | None = None  # the device's lineside and Python as probed (ssh targets), e.g. for `--json`
    device_warning: str | None = None  # why the device may not open it, when --force pushed anyway
    switched: bool = True  # current moved (False: it already pointed at this version)
    restart: str | None = None  # the command that restarts the device's server onto it, when known

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _version_name(bundle: Path, manifest: Manifest, digest: str) -> str:
    name = manifest.extra.get("name") or bundle.resolve().name  # "name": an operator's key, no build writes it
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-.") or "bundle"
    return f"{name}-{digest[:12]}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def _activate(t: LocalTarget | SshTarget, version_rel: str) -> tuple[str | None, bool]:
    """Make version_rel current, the old current previous; returns the (new) previous and whether it switched."""
    current, previous = t.links()
    if current == version_rel:
        return previous, False
    t.switch(version_rel, current)
    return current, True


def push(bundle: str | Path, target: str, ssh: str = "ssh", progress: Progress | None = None,
         force: bool = False) -> PushResult:
    """Install ``bundle`` under ``target`` and make it current; an interrupted push resumes on rerun.

    Over ssh the device's lineside (the one its lineside.service runs) must be able to open the bundle, else nothing
    is copied or switched; ``force`` pushes anyway and reports the problem in ``device_warning``."""
    src = Path(bundle)
    manifest = read_manifest(src)
    verify_files(src, manifest, check_hash=False)  # sizes here; every sha256 is checked on the target
    digest = hashlib.sha256((src / MANIFEST).read_bytes()).hexdigest()
    expected = {rel: meta.sha256 for rel, meta in manifest.files.items()}
    expected[MANIFEST] = digest
    files = [*manifest.files, MANIFEST]  # the manifest last: a version dir with one is complete
    total = sum(m.size for m in manifest.files.values()) + (src / MANIFEST).stat().st_size

    t = open_target(target, ssh)
    try:
        if isinstance(t, LocalTarget):
            root, home = t.root.expanduser().resolve(), src.expanduser().resolve()
            if root == home or home in root.parents:  # versions/ and current would be written into the bundle
                raise LinesideError(f"TARGET {target} is inside the bundle {bundle} being pushed; push to the "
                                    "device's directory (e.g. /opt/lineside), not into the bundle")
        device = warning = rt = None
        if isinstance(t, SshTarget):  # a local or mounted directory: which runtime will serve it is unknown here
            rt = probe_runtime(t, (src / MANIFEST).read_text())
            device, warning = rt.describe(), refusal(rt, manifest, t.label)
            if warning and not force:
                raise DeviceRefused(warning, f"{warning}; nothing was copied (pass {FORCE} to push anyway)")
        with push_lock(t):  # a second push to the same target at once shared the staging dir and the links
            r = _push(t, src, manifest, digest, expected, files, total, progress)
        login = t.login if isinstance(t, SshTarget) else None
        return replace(r, device=device, device_warning=warning, restart=restart_command(rt, login))
    finally:
        t.close()


def _push(t: LocalTarget | SshTarget, src: Path, manifest: Manifest, digest: str,
          expected: dict[str, str], files: list[str], total: int, progress: Progress | None) -> PushResult:
    t.prepare()
    for name, sha in t.installed_versions().items():
        if sha == digest:
            bad = t.verify(name, expected)
            if bad:
                raise BundleError(f"installed copy versions/{name} fails the sha256 check for {bad[0]}; "
                                  f"remove {t.label}/versions/{name} and push again")
            previous, switched = _activate(t, f"versions/{name}")
            return PushResult(t.label, name, previous, len(files), total, 0, 0, True, switched=switched)

    staging = f".incoming-{digest[:12]}"
    free, have = t.space(staging)
    if free < total - have:  # rsync would fill the device's disk, under the bundle that runs now, and stop
        raise LinesideError(f"{t.label} has {_gib(free)} free but the bundle needs {_gib(total - have)} more; "
                            f"free space there (old bundles under versions/ other than current and previous "
                            f"can go) and push again")
    stats = _upload(t, src, staging, files, progress)
    bad = t.verify(staging, expected)
    if bad:  # a changed or corrupt copy: fetch those files again from scratch, once
        t.discard(staging, bad)
        more = _upload(t, src, staging, files, progress)
        stats["bytes_sent"] += more["bytes_sent"]
        bad = t.verify(staging, expected)
        if bad:
            t.discard(staging, bad)
            raise BundleError(
                f"bundle file {bad[0]} fails its sha256 check on {t.label} even after copying it again: "
                f"the bundle at {src} no longer matches its manifest; rebuild it (nothing was activated)"
            )
    version = _version_name(src, manifest, digest)
    t.finalize(staging, version)
    previous, _ = _activate(t, f"versions/{version}")
    return PushResult(t.label, version, previous, len(files), total, stats["bytes_sent"],
                      stats["resumed_files"], False)


def _upload(t: LocalTarget | SshTarget, src: Path, staging: str, files: list[str],
            progress: Progress | None) -> dict[str, int]:
    """Copy into the staging dir; a disk that fills meanwhile gets its space back (it is the running bundle's disk:
    its engines and logs need it) and no half-written bundle stays behind."""
    try:
        return t.upload(src, staging, files, progress)
    except DiskFull:
        t.remove_staging(staging)
        raise LinesideError(f"{t.label} ran out of disk space during the copy (something else filled it after the "
                            f"free-space check); the partial copy was removed and nothing was activated; free space "
                            f"there and push again") from None


@dataclass
class RollbackResult:
    target: str
    current: str  # what current points at now (the old previous)
    previous: str  # what previous points at now (the old current)
    device: str | None = None  # the device's lineside and Python as probed (ssh targets)
    device_warning: str | None = None  # why the device may not open it, when --force rolled back anyway
    restart: str | None = None  # the command that restarts the device's server onto it, when known


def rollback(target: str, ssh: str = "ssh", force: bool = False) -> RollbackResult:
    """Swap current and previous. Over ssh the device's lineside must be able to open the version switched back to
    (an upgrade since may have dropped its bundle format), as for a push; ``force`` switches anyway."""
    t = open_target(target, ssh)
    try:
        with push_lock(t, create=False):
            current, previous = t.links()
            if previous is None:
                raise LinesideError(f"{t.label} has no previous version to roll back to (push a second bundle first)")
            if not t.exists(previous):
                raise LinesideError(f"{t.label}/{previous} is missing or incomplete; cannot roll back to it")
            device = warning = restart = None
            if isinstance(t, SshTarget):
                text = t.read_text(f"{previous}/{MANIFEST}")
                rt = probe_runtime(t, text)
                device, warning = rt.describe(), refusal(rt, _manifest_for_check(text), t.label)
                restart = restart_command(rt, t.login)
                if warning and not force:
                    raise DeviceRefused(warning, f"cannot roll back to {previous}: {warning}; nothing was switched "
                                                 f"(pass {FORCE} to roll back anyway)")
            t.switch(previous, current)
            return RollbackResult(t.label, previous, current or "", device, warning, restart)
    finally:
        t.close()


def _manifest_for_check(text: str) -> Manifest:
    """The installed manifest as far as the device check needs it (its format and builder), also when this
    lineside cannot read all of it: the device's lineside is the one that must."""
    try:
        d = json.loads(text)
    except ValueError:
        d = None
    d = d if isinstance(d, dict) else {}
    try:
        return Manifest.from_json_dict(d)
    except ValueError:
        fv, by = d.get("format_version"), d.get("lineside_version")
        return Manifest(architecture="", config="", max_seq_len=1, format_version=fv if type(fv) is int else 0,
                        lineside_version=by if isinstance(by, str) else None)
