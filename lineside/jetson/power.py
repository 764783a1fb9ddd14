"""Power modes: nvpmodel (MAXN, 30W, 15W, ...) and jetson_clocks, with a clear message off-Jetson."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from lineside.errors import LinesideError
from lineside.jetson.probe import parse_nvpmodel_conf, probe


def _require_jetson(sysroot: Path) -> None:
    if not (sysroot / "etc/nv_tegra_release").is_file():
        raise LinesideError(
            "not a Jetson (no /etc/nv_tegra_release): power modes (nvpmodel, jetson_clocks) exist only on "
            "Jetson devices; run this on the device (over ssh)"
        )


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise LinesideError(f"{name} not found on PATH; it ships with L4T (/usr/sbin/{name}), run on the device")
    return exe


def _key(name: str) -> str:
    """A mode name as compared: case, spaces/dashes and the MODE_ prefix ignored, since boards spell the same
    mode differently (AGX Orin's MODE_30W, Orin NX/Nano's 15W, MAXN_SUPER) and the help says '30W'."""
    return re.sub(r"[\s-]+", "_", name.strip().upper()).removeprefix("MODE_")


def resolve_mode(mode: str, sysroot: Path) -> int:
    """A mode id ('0') or name ('MAXN', '30W', 'mode_15w') -> nvpmodel id via /etc/nvpmodel.conf."""
    names = parse_nvpmodel_conf((sysroot / "etc/nvpmodel.conf").read_text()
                                if (sysroot / "etc/nvpmodel.conf").is_file() else "")
    known = ", ".join(f"{i}={n}" for i, n in sorted(names.items())) or "none listed in /etc/nvpmodel.conf"
    if mode.strip().isdigit():
        if names and int(mode) not in names:  # nvpmodel -m with an unknown id fails with a less direct message
            raise LinesideError(f"power mode id {int(mode)} is not one of this device's: {known}")
        return int(mode)
    exact = [mid for mid, name in names.items() if name.lower() == mode.strip().lower()]
    loose = [mid for mid, name in names.items() if _key(name) == _key(mode)]
    if exact or len(loose) == 1:
        return (exact or loose)[0]
    raise LinesideError(f"unknown power mode {mode!r}; this device has: {known}")


def _run(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LinesideError(f"{' '.join(cmd)} did not finish in 120 s") from None
    out = (p.stdout + p.stderr).strip()
    if p.returncode != 0:
        if "root" in out.lower() or "permission" in out.lower():
            raise LinesideError(f"{cmd[0]} needs root: run `sudo lineside jetson power ...`")
        raise LinesideError(f"{' '.join(cmd)} failed: {out.splitlines()[-1] if out else f'exit {p.returncode}'}")
    return out


def set_power(mode: str | None, clocks: bool | None, sysroot: str = "/", dry_run: bool = False) -> list[str]:
    """Apply a power mode and/or pin clocks; returns the commands run (or that would run)."""
    root = Path(sysroot)
    _require_jetson(root)
    cmds: list[list[str]] = []
    if mode is not None:
        cmds.append([_tool("nvpmodel"), "-m", str(resolve_mode(mode, root))])
    if clocks is True:
        cmds.append([_tool("jetson_clocks")])
    elif clocks is False:
        cmds.append([_tool("jetson_clocks"), "--restore"])
    if not cmds:
        raise LinesideError("nothing to do: pass --mode MODE and/or --clocks / --no-clocks (or --query)")
    done = []
    for c in cmds:
        if not dry_run:
            _run(c)
        done.append(" ".join(c))
    return done


def query_power(sysroot: str = "/") -> str:
    """Current mode (and the modes this device offers)."""
    root = Path(sysroot)
    _require_jetson(root)
    r = probe(root)
    names = parse_nvpmodel_conf((root / "etc/nvpmodel.conf").read_text()
                                if (root / "etc/nvpmodel.conf").is_file() else "")
    modes = ", ".join(f"{i}={n}" for i, n in sorted(names.items())) or "unknown"
    current = f"{r.power_mode} (id {r.power_mode_id})" if r.power_mode_id is not None else (r.power_mode or "unknown")
    return f"power mode: {current}; available: {modes}"
