"""The devices the memory planner knows: how much memory a model may use on each.

Jetson memory is unified (CPU and GPU share the LPDDR5), so what the model may use is the
module's memory minus what the OS, firmware carve-outs and desktop keep. Datacenter GPUs
have their own memory; the host's RAM does not count there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lineside.errors import LinesideError

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Device:
    """A target the planner sizes a model against (all sizes in bytes)."""

    key: str
    name: str
    memory_bytes: int  # what the device has (module RAM on Jetson, VRAM on a discrete GPU)
    reserved_bytes: int  # kept by OS / carve-outs / driver, never available to the model process
    runtime_overhead_bytes: int  # CUDA context, TensorRT + cuBLAS libraries, the Python server
    unified: bool  # CPU and GPU share memory (Jetson)
    sm: str  # compute capability, for the engine key
    jetson: bool

    @property
    def usable_bytes(self) -> int:
        """Bytes left for weights, KV cache, activations and runtime overhead."""
        return self.memory_bytes - self.reserved_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["usable_bytes"] = self.usable_bytes
        return d


# Jetson reserves: L4T without a desktop uses ~1 GiB, the firmware carve-outs ~0.5-1 GiB; we keep
# some headroom for the page cache and the container runtime. The runtime overhead (CUDA context
# ~0.3 GiB on Orin, TensorRT/cuBLAS/cuDNN code and workspaces, uvicorn + Python) is ~1 GiB.
# Discrete GPUs: memory is what nvidia-smi reports as total; the driver's own share is in it.
DEVICES: dict[str, Device] = {
    d.key: d
    for d in (
        Device("agx-orin-64", "Jetson AGX Orin 64GB", 64 * GIB, 4 * GIB, 1 * GIB, True, "8.7", True),
        Device("agx-orin-32", "Jetson AGX Orin 32GB", 32 * GIB, 3 * GIB, 1 * GIB, True, "8.7", True),
        Device("orin-nx-16", "Jetson Orin NX 16GB", 16 * GIB, 2 * GIB + 512 * MIB, 1 * GIB, True, "8.7", True),
        Device("orin-nx-8", "Jetson Orin NX 8GB", 8 * GIB, 1 * GIB + 512 * MIB, 768 * MIB, True, "8.7", True),
        Device("orin-nano-8", "Jetson Orin Nano 8GB", 8 * GIB, 1 * GIB + 512 * MIB, 768 * MIB, True, "8.7", True),
        Device("orin-nano-4", "Jetson Orin Nano 4GB", 4 * GIB, 1 * GIB, 768 * MIB, True, "8.7", True),
        Device("l4-24", "NVIDIA L4 24GB", 23034 * MIB, 0, 1 * GIB, False, "8.9", False),
        Device("a100-40", "NVIDIA A100 40GB", 40960 * MIB, 0, 1 * GIB, False, "8.0", False),
        Device("a100-80", "NVIDIA A100 80GB", 81920 * MIB, 0, 1 * GIB, False, "8.0", False),
        Device("h100-80", "NVIDIA H100 80GB", 81559 * MIB, 0, 1 * GIB, False, "9.0", False),
    )
}

# The devices in the README table, in order.
TABLE_DEVICES = ("orin-nano-8", "orin-nx-16", "agx-orin-32", "agx-orin-64", "l4-24", "h100-80")


def get_device(key: str) -> Device:
    """Look a device up by key (case-insensitive); the error lists the known ones."""
    k = key.strip().lower()
    if k in DEVICES:
        return DEVICES[k]
    known = ", ".join(DEVICES)
    raise LinesideError(f"unknown device {key!r}; choose one of: {known}")


def device_for_board(model: str, memory_total_bytes: int | None) -> str | None:
    """Map a /proc/device-tree/model string (and MemTotal) to a planner device key, or None."""
    m = model.lower()
    mem = memory_total_bytes or 0
    if "agx orin" in m:
        return "agx-orin-64" if mem > 40 * GIB else "agx-orin-32"
    if "orin nx" in m:
        return "orin-nx-16" if mem > 10 * GIB else "orin-nx-8"
    if "orin nano" in m:
        return "orin-nano-8" if mem > 5 * GIB else "orin-nano-4"
    return None
