"""Transparent huge pages for the weights onnxruntime packs when it creates a session.

Decode reads every weight once a token (108 MB for the demo bundle). On 4 KB pages that is ~27,000 pages a token:
TLB misses, and the CPU's stream prefetchers stop at every page boundary. Linux in THP mode "madvise" (Debian's,
Ubuntu's and JetPack's default) gives 2 MB pages only to memory advised MADV_HUGEPAGE; numpy advises its large
arrays, onnxruntime's allocator advises nothing. So once a session exists, its large anonymous mappings (the
prepacked MatMulNBits weights, ~170 MB for the demo bundle) are advised and collapsed into huge pages
(MADV_COLLAPSE, Linux >= 6.1; on an older kernel khugepaged collapses advised memory in the background).
Mappings advised MADV_NOHUGEPAGE (the KV arena, ``arena_zeros``) and mostly untouched ones are left alone, so
this adds no memory. ``LINESIDE_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from dataclasses import dataclass

log = logging.getLogger("lineside.runtime")

HUGE_PAGES_ENV = "LINESIDE_HUGE_PAGES"
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MIN_BYTES = 8 << 20  # onnxruntime's weight buffers; Python's own arenas are far smaller
MIN_RESIDENT = 0.9  # collapsing a sparse mapping would fault in its holes


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    resident: int  # bytes
    flags: frozenset[str]

    @property
    def size(self) -> int:
        return self.end - self.start


def anonymous_mappings(smaps: str) -> list[Mapping]:
    """The private anonymous read-write mappings in a /proc/PID/smaps text (not the heap or a stack)."""
    out: list[Mapping] = []
    cur: dict | None = None
    for line in smaps.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            a, _, b = head[0].partition("-")
            named = len(head) > 5 and head[5].strip()
            cur = {"start": int(a, 16), "end": int(b, 16), "rss": 0} if head[1] == "rw-p" and not named else None
        elif cur is not None and line.startswith("Rss:"):
            cur["rss"] = int(line.split()[1]) * 1024
        elif cur is not None and line.startswith("VmFlags:"):
            out.append(Mapping(cur["start"], cur["end"], cur["rss"], frozenset(line.split()[1:])))
            cur = None
    return out


def candidates(mappings: list[Mapping], min_bytes: int = MIN_BYTES) -> list[Mapping]:
    """The mappings worth huge pages: large, nearly all resident, not advised against them, not huge already."""
    return [m for m in mappings if m.size >= min_bytes and m.resident >= MIN_RESIDENT * m.size
            and "nh" not in m.flags and "hg" not in m.flags]


def advise_huge_pages(min_bytes: int = MIN_BYTES) -> int:
    """Advise (and collapse, where the kernel can) this process's large anonymous mappings into huge pages;
    the bytes advised (0 off Linux, when turned off, or when nothing qualifies)."""
    if not sys.platform.startswith("linux") or os.environ.get(HUGE_PAGES_ENV, "1") == "0":
        return 0
    try:
        with open("/proc/self/smaps") as f:
            found = candidates(anonymous_mappings(f.read()), min_bytes)
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    advised = [m for m in found if madvise(m.start, m.size, MADV_HUGEPAGE) == 0]  # else THP is compiled out

    def collapse() -> None:  # best effort: EINVAL before Linux 6.1, EAGAIN when memory is short
        for m in advised:
            madvise(m.start, m.size, MADV_COLLAPSE)

    # Collapsing copies the memory (~0.2 s for the demo bundle's 77 MB): off the path to ready, beside the web
    # stack's imports and the warm-up. The memory reads the same during and after it.
    threading.Thread(target=collapse, name="lineside-hugepages", daemon=True).start()
    total = sum(m.size for m in advised)
    log.debug("huge pages advised for %d mappings, %.0f MB", len(advised), total / 2**20)
    return total
