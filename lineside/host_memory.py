"""The host's available memory, as the kernel counts it (MemAvailable: free memory plus page cache it would give
back): what a model the size of a bundle can still be loaded into, on a CPU or on a GPU that shares the host's memory."""

from __future__ import annotations

from pathlib import Path


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none: not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
