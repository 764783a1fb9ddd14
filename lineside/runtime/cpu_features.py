"""What this CPU offers onnxruntime: how many cores to run on, and whether its int8 product sums exactly.

Threads: one per physical core the process may run on, as onnxruntime's own default and llama.cpp's do. A
hyperthread shares its core's load ports and caches, and a decode step is bound by memory: the logical count put
two threads on every core of an SMT line PC (8 on a 4-core i7), each spinning between kernels.

Int8 product: whether the int8 prompt graph may run.

The prefill graph (build/graph/prefill.py) multiplies uint8 activations (+128) by full-range int8 weights with
``MatMulIntegerToFloat``. onnxruntime's MLAS sums those products exactly only with a dot-product instruction:
VNNI's ``vpdpbusd`` (AVX-512 VNNI, AVX-VNNI), AMX, or ARM's kernels. On x86 without VNNI
(AVX2 parts such as AMD Zen 1-3 and Intel before Ice Lake, and AVX-512 parts without VNNI) it uses ``vpmaddubsw``,
which adds each pair of products into int16 with saturation: with weights near a channel's largest and positive
activations a pair passes 32767 and is cut off. Emulated on the demo bundle's prompt graph (a 256-token prompt)
every one of its 120 linears had saturated pairs, up to 5% relative error in a linear's output
(``benchmarks/int8_saturation.py``). There the prompt runs on the 4-bit graph instead.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from functools import cache
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")


def physical_cores(cpus: Iterable[int], sysfs: Path | None = None) -> int:
    """How many distinct cores (package, core id) the logical ``cpus`` sit on; 0 where the topology is not readable."""
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = (sysfs or SYSFS_CPU) / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            return 0
    return len(cores)


def default_threads() -> int:
    """One onnxruntime thread per physical core this process may use (its affinity); the logical count where the
    topology is unknown (onnxruntime would otherwise run as if single-threaded without an explicit value)."""
    if not hasattr(os, "sched_getaffinity"):
        return max(1, os.cpu_count() or 1)
    cpus = os.sched_getaffinity(0)
    return max(1, physical_cores(cpus) or len(cpus))


X86 = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})
ARM64 = frozenset({"aarch64", "arm64"})
AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})  # MLAS's "AVX-512 core" kernels need all


def int8_gemm_exact(machine: str, flags: frozenset[str]) -> bool:
    """Whether MLAS's u8 x s8 GEMM sums exactly on a CPU of this architecture (``platform.machine()``) and these
    ``/proc/cpuinfo`` flags, following the kernel choice in MLAS's platform.cpp: AMX wins; else on an AVX-512 core
    part its VNNI kernel or its saturating one; else AVX-VNNI or AVX2's saturating one. Unknown: not exact."""
    arch = machine.lower()
    if arch in ARM64:
        # UDOT/SDOT sum in 32 bits; plain NEON adds two s8 products in 16 bits, which holds 2*127*127 (the graph's
        # activation codes 1..255 shifted to -127..127, its weights -127..127: no -128*-128)
        return True
    if arch not in X86:
        return False
    if {"amx_tile", "amx_int8"} <= flags:
        return True
    if AVX512_CORE <= flags:
        return "avx512_vnni" in flags
    return "avx_vnni" in flags


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in a ``/proc/cpuinfo`` text (x86: ``flags``; ARM: ``Features``)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@cache
def host_int8_gemm_exact() -> bool:
    """``int8_gemm_exact`` for this machine (x86 without a readable /proc/cpuinfo: not exact)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    return int8_gemm_exact(platform.machine(), cpu_flags(text))
