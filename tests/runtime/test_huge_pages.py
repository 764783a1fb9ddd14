"""runtime/huge_pages.py: which mappings get transparent huge pages (parsed from smaps), and on this kernel that a
large resident anonymous mapping is advised while the KV arena's (MADV_NOHUGEPAGE) is not."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from lineside.runtime import huge_pages
from lineside.runtime.huge_pages import (
    Mapping,
    advise_huge_pages,
    anonymous_mappings,
    candidates,
    resident_runs,
)
from lineside.runtime.onnxruntime_backend import arena_zeros

SMAPS = """\
7f0000000000-7f0001000000 rw-p 00000000 00:00 0
Size:              16384 kB
Rss:               16384 kB
VmFlags: rd wr mr mw me ac sd
7f0001000000-7f0002000000 rw-p 00000000 08:01 1234                       /data/model.onnx.data
Rss:               16384 kB
VmFlags: rd wr mr mw me ac sd
55d000000000-55d001000000 rw-p 00000000 00:00 0                          [heap]
Rss:               16384 kB
VmFlags: rd wr mr mw me ac sd
7f0003000000-7f0004000000 r--p 00000000 00:00 0
Rss:               16384 kB
VmFlags: rd mr mw me ac sd
7f0005000000-7f0006000000 rw-p 00000000 00:00 0
Rss:                1024 kB
VmFlags: rd wr mr mw me ac sd nh
"""


def test_only_private_anonymous_read_write_mappings_and_the_heap_are_read():
    got = anonymous_mappings(SMAPS)
    assert [(hex(m.start), m.size >> 20, m.resident >> 20, m.heap) for m in got] == [
        ("0x7f0000000000", 16, 16, False), ("0x55d000000000", 16, 16, True), ("0x7f0005000000", 16, 1, False)]
    assert "nh" in got[2].flags and "nh" not in got[0].flags


def test_candidates_have_enough_resident_and_are_not_advised_either_way():
    mb = 1 << 20
    maps = [Mapping(0, 16 * mb, 16 * mb, frozenset()),  # weights: yes
            Mapping(0, 64 * mb, 4 * mb, frozenset()),  # little of it resident
            Mapping(0, 16 * mb, 16 * mb, frozenset({"nh"})),  # the KV arena
            Mapping(0, 16 * mb, 16 * mb, frozenset({"hg"}))]  # done already
    assert candidates(maps, 8 * mb) == maps[:1]


def test_only_whole_resident_extents_are_advised_and_the_heaps_last_extent_is_kept():
    huge, per = huge_pages.HUGE, huge_pages.HUGE // huge_pages.PAGE
    start, end = 3 * huge - huge_pages.PAGE, 9 * huge + 5 * huge_pages.PAGE  # unaligned: extents 3..8 count
    pages = np.ones(6 * per, np.uint8)
    pages[2 * per + 7] = 0  # one page of extent 5 not resident: collapsing would fault it in
    got = resident_runs(start, end, pages)
    assert got == [(3 * huge, 5 * huge), (6 * huge, 9 * huge)]
    assert resident_runs(start, end, pages, keep_last=True) == [got[0], (6 * huge, 8 * huge)]
    assert resident_runs(0, huge, np.ones(per, np.uint8)) == [(0, huge)]
    assert resident_runs(huge + 1, 2 * huge, np.ones(per, np.uint8)) == []


def _flags_of(addr: int) -> set[str]:
    for m in anonymous_mappings(Path("/proc/self/smaps").read_text()):
        if m.start <= addr < m.end:
            return set(m.flags)
    raise AssertionError(f"no anonymous mapping holds {addr:#x}")


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in ("absent", "never"),
                    reason=f"needs Linux with transparent huge pages (mode here: {_thp_mode()})")
def test_a_resident_anonymous_mapping_is_advised_and_the_kv_arena_is_not(monkeypatch):
    monkeypatch.delenv(huge_pages.HUGE_PAGES_ENV, raising=False)
    size = 24 << 20
    weights = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    weights.write(b"\1" * size)  # resident, as onnxruntime's packed weights are
    w = np.frombuffer(weights, np.uint8)
    kv = arena_zeros((size // 4,), np.float32)
    kv[:] = 1.0  # resident too, but advised MADV_NOHUGEPAGE
    try:
        assert advise_huge_pages(min_bytes=16 << 20) >= size
        middle = w.ctypes.data + size // 2  # the whole 2 MB extents inside it
        assert "hg" in _flags_of(middle) and "hg" not in _flags_of(kv.ctypes.data + size // 2)
        assert w[::4096].sum() == size // 4096  # the contents are what they were
    finally:
        del w
        weights.close()


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    assert advise_huge_pages(min_bytes=1) == 0
