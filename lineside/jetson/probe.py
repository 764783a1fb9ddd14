"""Device probe: what Jetson is this, which L4T / JetPack, memory, GPU load, power mode, TensorRT.

Everything is read from files under a sysroot (``/`` on the device), so tests run against
fake sysroots; only ``nvpmodel -q`` and ``import tensorrt`` need the real machine.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lineside.jetson.devices import device_for_board

# Where the GPU load (per-mille) lives, newest layouts first; globbed under the sysroot.
GPU_LOAD_PATHS = (
    "sys/devices/platform/gpu.0/load",
    "sys/devices/platform/17000000.gpu/load",
    "sys/devices/platform/bus@0/17000000.gpu/load",
    "sys/devices/platform/*/17000000.gpu/load",
    "sys/devices/platform/17000000.ga10b/load",
    "sys/devices/gpu.0/load",
    "sys/devices/17000000.ga10b/load",
)

# L4T release -> JetPack (NVIDIA's JetPack archive); unknown patches fall back by prefix below.
L4T_TO_JETPACK = {
    "38.2.0": "7.0", "38.2.1": "7.0",
    "36.4.4": "6.2.1", "36.4.3": "6.2", "36.4.0": "6.1",
    "36.3.0": "6.0", "36.2.0": "6.0 DP",
    "35.6.1": "5.1.5", "35.6.0": "5.1.4", "35.5.0": "5.1.3", "35.4.1": "5.1.2", "35.3.1": "5.1.1",
    "35.2.1": "5.1", "35.1.0": "5.0.2",
}


@dataclass
class ProbeResult:
    """What the probe found; fields are None when the machine does not have them."""

    is_jetson: bool
    board: str | None = None
    device: str | None = None  # planner device key
    l4t_version: str | None = None
    jetpack_version: str | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    memory_free_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_free_bytes: int | None = None
    gpu_load_percent: float | None = None
    gpu_load_source: str | None = None
    power_mode: str | None = None
    power_mode_id: int | None = None
    tensorrt_version: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_bytes().decode("utf-8", "replace")
    except OSError:
        return None


def parse_nv_tegra_release(text: str) -> str | None:
    """'# R36 (release), REVISION: 4.3, ...' -> '36.4.3' (REVISION 4.0 -> '36.4.0')."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    if not m:
        return None
    rev = m.group(2).split(".")
    rev += ["0"] * (2 - len(rev))
    return ".".join([m.group(1), *rev[:2]])


def jetpack_for_l4t(l4t: str) -> str | None:
    """Map an L4T version to its JetPack release (36.4.x -> 6.1/6.2, 36.3 -> 6.0, 35.x -> 5.1.x)."""
    if l4t in L4T_TO_JETPACK:
        return L4T_TO_JETPACK[l4t]
    parts = [int(p) for p in l4t.split(".") if p.isdigit()]
    if len(parts) < 2:
        return None
    major, minor = parts[0], parts[1]
    patch = parts[2] if len(parts) > 2 else 0
    if major == 38:
        return "7.x"
    if major == 36:
        if minor >= 4:
            return "6.2.x" if patch >= 3 else "6.1"
        return {3: "6.0", 2: "6.0 DP"}.get(minor, "6.x")
    if major == 35:
        return "5.1.x" if minor >= 2 else "5.0.x"
    if major == 34:
        return "5.0 DP"
    if major == 32:
        return "4.x"
    return None


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> {'MemTotal': bytes, ...}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*(kB)?", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def read_gpu_load(root: Path) -> tuple[float | None, str | None]:
    """GPU load in percent from the per-mille sysfs file, and which file it came from."""
    for pattern in GPU_LOAD_PATHS:
        for path in sorted(glob.glob(str(root / pattern))):
            try:
                raw = Path(path).read_text().strip()
                return int(raw) / 10.0, "/" + os.path.relpath(path, root)
            except (OSError, ValueError):
                continue
    return None, None


def parse_nvpmodel_conf(text: str) -> dict[int, str]:
    """'< POWER_MODEL ID=0 NAME=MAXN >' lines of /etc/nvpmodel.conf -> {0: 'MAXN'}."""
    return {int(i): n for i, n in re.findall(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>", text)}


def read_power_mode(root: Path, live: bool) -> tuple[str | None, int | None]:
    """Current nvpmodel mode from its status file (+ conf for the name), else `nvpmodel -q`."""
    status = _read(root, "var/lib/nvpmodel/status")
    names = parse_nvpmodel_conf(_read(root, "etc/nvpmodel.conf") or "")
    if status:
        m = re.search(r"pmode:(\d+)", status)
        if m:
            mid = int(m.group(1))
            return names.get(mid, f"mode {mid}"), mid
    if live and shutil.which("nvpmodel"):
        try:
            out = subprocess.run(["nvpmodel", "-q"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
        name = re.search(r"NV Power Mode:\s*(\S+)", out)
        mid = re.search(r"^\s*(\d+)\s*$", out, re.M)
        return (name.group(1) if name else None), (int(mid.group(1)) if mid else None)
    return None, None


def read_tensorrt_version(root: Path, live: bool) -> str | None:
    """`tensorrt.__version__` on the live machine, else the dpkg record of libnvinfer / tensorrt."""
    if live:
        try:
            return str(importlib.import_module("tensorrt").__version__)
        except Exception:  # noqa: BLE001 - a broken TensorRT install is the same as none here
            pass
    status = _read(root, "var/lib/dpkg/status") or ""
    for pkg in ("tensorrt", "libnvinfer10", "libnvinfer8", "python3-libnvinfer"):
        m = re.search(rf"^Package: {re.escape(pkg)}\n(?:.+\n)*?Version: (\S+)", status, re.M)
        if m:
            return m.group(1).split("-")[0]
    return None


def probe(sysroot: str | os.PathLike[str] = "/") -> ProbeResult:
    """Probe the machine (or a sysroot copy of one)."""
    root = Path(sysroot)
    live = root.resolve() == Path("/")
    mem = parse_meminfo(_read(root, "proc/meminfo") or "")
    release = _read(root, "etc/nv_tegra_release")
    model = _read(root, "proc/device-tree/model")
    board = model.replace("\x00", "").strip() if model else None
    r = ProbeResult(
        is_jetson=bool(release) or bool(board and "jetson" in board.lower()),
        board=board,
        memory_total_bytes=mem.get("MemTotal"),
        memory_available_bytes=mem.get("MemAvailable"),
        memory_free_bytes=mem.get("MemFree"),
        swap_total_bytes=mem.get("SwapTotal"),
        swap_free_bytes=mem.get("SwapFree"),
    )
    r.tensorrt_version = read_tensorrt_version(root, live)
    if not r.is_jetson:
        dmi = _read(root, "sys/devices/virtual/dmi/id/product_name")
        r.board = board or (dmi.strip() if dmi else None)
        r.notes.append("not a Jetson: no /etc/nv_tegra_release; use --device with `lineside jetson plan`")
        return r
    if release:
        r.l4t_version = parse_nv_tegra_release(release)
        r.jetpack_version = jetpack_for_l4t(r.l4t_version) if r.l4t_version else None
    else:
        r.notes.append("no /etc/nv_tegra_release (a container without L4T files?); L4T version unknown")
    r.device = device_for_board(board or "", r.memory_total_bytes)
    r.gpu_load_percent, r.gpu_load_source = read_gpu_load(root)
    if r.gpu_load_percent is None:
        r.notes.append("GPU load not readable (no gpu.0/load in sysfs; inside a container mount /sys)")
    r.power_mode, r.power_mode_id = read_power_mode(root, live)
    return r


def format_probe(r: ProbeResult) -> str:
    """Human-readable probe output."""

    def gib(n: int | None) -> str:
        return "unknown" if n is None else f"{n / (1 << 30):.1f} GiB"

    if not r.is_jetson:
        lines = [f"not a Jetson ({r.board or 'unknown machine'}); memory {gib(r.memory_total_bytes)} total, "
                 f"{gib(r.memory_available_bytes)} available"]
    else:
        lines = [
            f"board:       {r.board or 'unknown'}" + (f"  (planner device: {r.device})" if r.device else ""),
            f"L4T:         {r.l4t_version or 'unknown'}  (JetPack {r.jetpack_version or 'unknown'})",
            f"memory:      {gib(r.memory_total_bytes)} total, {gib(r.memory_available_bytes)} available "
            "(unified: shared by CPU and GPU)",
            "GPU load:    " + ("unknown" if r.gpu_load_percent is None else f"{r.gpu_load_percent:.1f}%"),
            f"power mode:  {r.power_mode or 'unknown'}"
            + (f" (id {r.power_mode_id})" if r.power_mode_id is not None else ""),
        ]
    lines.append(f"TensorRT:    {r.tensorrt_version or 'not found'}")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)
