"""Transparent huge pages for the weights onnxruntime packs when it creates a session.

Decode reads every weight once a token (108 MB for the demo bundle). On 4 KB pages that is ~27,000 pages a token:
TLB misses, and the CPU's stream prefetchers stop at every page boundary. Linux in THP mode "madvise" (Debian's,
Ubuntu's and JetPack's default) gives 2 MB pages only to memory advised MADV_HUGEPAGE; numpy advises its large
arrays, onnxruntime's allocator advises nothing. So once a session exists, its large anonymous mappings (the
prepacked MatMulNBits weights, ~170 MB for the demo bundle) are advised and collapsed into huge pages
(MADV_COLLAPSE, Linux >= 6.1; on an older kernel khugepaged collapses advised memory in the background).
Where those buffers land depends on malloc: mappings of their own, or the brk heap once glibc's mmap threshold
has grown. Only whole 2 MB extents already resident (``mincore``) are advised, so no hole is faulted in and this
adds no memory; mappings advised MADV_NOHUGEPAGE (the KV arena, ``arena_zeros``) are left alone, and so is the
heap's last extent (the heap grows beyond it). ``LINESIDE_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("lineside.runtime")

HUGE_PAGES_ENV = "LINESIDE_HUGE_PAGES"
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MIN_BYTES = 8 << 20  # resident bytes of a mapping worth a look: onnxruntime's weights; Python's arenas are smaller


def _pmd_size() -> int:
    """The kernel's huge page size (2 MB on x86-64 and on 4 KB-page arm64; 512 MB with 64 KB pages)."""
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


HUGE = _pmd_size()
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    resident: int  # bytes
    flags: frozenset[str]
    heap: bool = False  # the brk heap: it grows at its end

    @property
    def size(self) -> int:
        return self.end - self.start


def anonymous_mappings(smaps: str) -> list[Mapping]:
    """The private anonymous read-write mappings in a /proc/PID/smaps text, the heap among them (not a stack)."""
    out: list[Mapping] = []
    cur: dict | None = None
    for line in smaps.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            a, _, b = head[0].partition("-")
            name = head[5].strip() if len(head) > 5 else ""
            keep = head[1] == "rw-p" and name in ("", "[heap]")
            cur = {"start": int(a, 16), "end": int(b, 16), "rss": 0, "heap": name == "[heap]"} if keep else None
        elif cur is not None and line.startswith("Rss:"):
            cur["rss"] = int(line.split()[1]) * 1024
        elif cur is not None and line.startswith("VmFlags:"):
            out.append(Mapping(cur["start"], cur["end"], cur["rss"], frozenset(line.split()[1:]), cur["heap"]))
            cur = None
    return out


def candidates(mappings: list[Mapping], min_bytes: int = MIN_BYTES) -> list[Mapping]:
    """The mappings worth a look: at least ``min_bytes`` resident, not advised either way already."""
    return [m for m in mappings if m.resident >= min_bytes and "nh" not in m.flags and "hg" not in m.flags]


def resident_runs(start: int, end: int, resident: np.ndarray, *, keep_last: bool = False) -> list[tuple[int, int]]:
    """Runs ``(begin, end)`` of whole 2 MB extents in ``[start, end)`` whose pages are all resident; ``resident``
    holds one flag per page of the aligned span (mincore's vector); ``keep_last`` leaves out the last extent."""
    lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    if hi <= lo:
        return []
    full = (np.asarray(resident, np.uint8)[:(hi - lo) // PAGE] & 1).reshape(-1, HUGE // PAGE).all(axis=1)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], full.astype(np.int8), [0]])))
    runs = [(lo + int(a) * HUGE, lo + int(b) * HUGE) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    if keep_last and runs and runs[-1][1] == hi:  # the last extent stays as it is: the heap grows beyond it
        a, b = runs.pop()
        if b - HUGE > a:
            runs.append((a, b - HUGE))
    return runs


def advise_huge_pages(min_bytes: int = MIN_BYTES) -> int:
    """Advise this process's large resident anonymous memory into huge pages and collapse it in a background
    thread; the bytes advised (0 off Linux, when turned off, or when nothing qualifies)."""
    if not sys.platform.startswith("linux") or os.environ.get(HUGE_PAGES_ENV, "1") == "0":
        return 0
    try:
        with open("/proc/self/smaps") as f:
            found = candidates(anonymous_mappings(f.read()), min_bytes)
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    advised: list[tuple[int, int]] = []
    for m in found:
        lo, hi = -(-m.start // HUGE) * HUGE, m.end // HUGE * HUGE
        if hi <= lo:
            continue
        vec = np.zeros((hi - lo) // PAGE, np.uint8)
        if libc.mincore(lo, hi - lo, vec.ctypes.data) != 0:
            continue
        for a, b in resident_runs(m.start, m.end, vec, keep_last=m.heap):
            if libc.madvise(a, b - a, MADV_HUGEPAGE) == 0:  # else THP is compiled out
                advised.append((a, b))

    def collapse() -> None:  # best effort: EINVAL before Linux 6.1, EAGAIN when memory is short
        for a, b in advised:
            libc.madvise(a, b - a, MADV_COLLAPSE)

    # Collapsing copies the memory (~0.2 s for the demo bundle's weights): off the path to ready, beside the web
    # stack's imports and the warm-up. The memory reads the same during and after it.
    if advised:
        threading.Thread(target=collapse, name="lineside-hugepages", daemon=True).start()
    total = sum(b - a for a, b in advised)
    log.debug("huge pages advised for %d ranges, %.0f MB", len(advised), total / 2**20)
    return total
