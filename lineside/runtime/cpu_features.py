"""What this CPU offers onnxruntime: how many cores to run on, and whether its int8 product sums exactly.

Threads: one per physical core the process may run on, as onnxruntime's own default and llama.cpp's do. A
hyperthread shares its core's load ports and caches, and a decode step is bound by memory: the logical count put
two threads on every core of an SMT line PC (8 on a 4-core i7), each spinning between kernels.

Int8 product: whether the int8 prompt graph may run. The prefill graph (build/graph/prefill.py) multiplies uint8
activations (+128) by full-range int8 weights with ``MatMulIntegerToFloat``. onnxruntime's MLAS sums those products
exactly with a dot-product instruction (VNNI's ``vpdpbusd``, AMX, ARM's SDOT/UDOT), but on x86 without VNNI (AVX2
parts such as AMD Zen 1-3 and Intel before Ice Lake, and AVX-512 parts without VNNI) it uses ``vpmaddubsw``, which
adds each pair of products into int16 with saturation: with weights near a channel's largest and positive
activations a pair passes 32767 and is cut off. Emulated on the demo bundle's prompt graph (a 256-token prompt)
every one of its 120 linears had saturated pairs, up to 5% relative error in a linear's output
(``benchmarks/int8_saturation.py``); on a Haswell emulated by qemu, 64 products of 127 * 127 summed to 8160 instead
of 1,032,256. There prompts run on the 4-bit graph instead (MatMulNBits' 4- and 8-bit kernels keep their pair sums
in range: exact on that Haswell too). Rather than mirror MLAS's choice of kernel from the CPU's flags (an emulator
or a hypervisor can show flags the code path does not follow: qemu passes the host's /proc/cpuinfo through), the
answer comes from running the product once.
"""

from __future__ import annotations

import base64
import os
import zlib
from collections.abc import Iterable
from functools import cache
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")


def physical_cores(cpus: Iterable[int], sysfs: Path | None = None) -> int:
    """How many distinct cores (package, core id) the logical ``cpus`` sit on; 0 where the topology is not readable."""
    root = sysfs or SYSFS_CPU
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = root / f"cpu{cpu}" / "topology"
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


PROBE_K = 64  # 32 pairs of products 127 * 127 (32258 each; int16 holds 32767): the sum passes int16 many times
# One MatMulIntegerToFloat as the prefill graph calls it: a uint8 [rows, 64] with a per-row scale a_scale [rows, 1]
# and zero point 128, times int8 b [64, 8] (every value 127) with a per-column scale of ones; y float [rows, 8].
# Serialized (zlib, base64) because the onnx package takes ~0.8 s to import and the runtime does not otherwise
# need it: tests/runtime/test_cpu_features.py builds it with onnx.helper and checks this is that model.
PROBE_MODEL = (
    "eNrj4LD6xsrlwcWYyMWYxMWeGF+cnJiTysWeBGWwJcZXpRblCzFWKon4Jpb4luZ45pWkpqcWheS75eQnlljxJufn6uVmJhflF+en"
    "lQhxZeaVWMQXFOUnpWr1sHA4cHAIMDsxJnk1sNSPghENtPSBaYHRCZayvBQYGBrs8WEtXgEmJ2j682JsiBIHJlIhIS4BDiYhHi42"
    "IZai/PJiLiYOhyhZeLoFSzOiSDMmAfVVYpHgcGLhYhAQdBLkQk3CAowAoLU+Pw==")


def probe_model() -> bytes:
    """The serialized int8 probe (``PROBE_MODEL``)."""
    return zlib.decompress(base64.b64decode(PROBE_MODEL))


@cache
def host_int8_gemm_exact() -> bool:
    """Whether onnxruntime's ``MatMulIntegerToFloat`` sums this machine's int8 products exactly, called as the
    prefill graph calls it: one run of 1 row (MLAS's GEMV kernel) and one of 4 (its GEMM) on codes a saturating
    kernel gets wrong. An onnxruntime that cannot run it: not exact."""
    try:
        import numpy as np
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(probe_model(), options, providers=["CPUExecutionProvider"])
        for rows in (1, 4):
            y = session.run(None, {"a": np.full((rows, PROBE_K), 255, np.uint8),
                                   "a_scale": np.ones((rows, 1), np.float32)})[0]
            if not np.all(y == 127 * 127 * PROBE_K):
                return False
        return True
    except Exception:  # noqa: BLE001 - any failure to run it: prompts on the 4-bit graph, which needs none of it
        return False
