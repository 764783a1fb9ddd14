"""What the runtime reads of the CPU: whether onnxruntime sums int8 products exactly (by running them), and how many
physical cores it may use (from sysfs)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lineside.runtime.cpu_features import host_int8_gemm_exact

ROOT = Path(__file__).resolve().parents[2]


def test_the_int8_probe_sees_onnxruntime_saturate_on_an_x86_cpu_without_vnni():
    """qemu-user runs this Python and onnxruntime as on a Haswell (AVX2, no VNNI): MLAS picks its vpmaddubsw kernel,
    the probe's product comes out wrong, and the answer is no. (/proc/cpuinfo is the host's under qemu: the flags
    would have said yes.)"""
    if platform.machine() != "x86_64" or shutil.which("qemu-x86_64") is None:
        pytest.skip("needs an x86_64 host and qemu-user (scripts/test.sh installs it)")
    code = "from lineside.runtime.cpu_features import host_int8_gemm_exact; print(host_int8_gemm_exact())"
    run = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"]


def test_the_int8_probe_says_yes_where_the_cpu_has_vnni():
    """The other side, where this machine can show it: an x86 CPU that reports VNNI (and no AVX-512 without it:
    MLAS's AVX-512 kernel without VNNI saturates), or any arm64 one."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
    vnni = ("avx512_vnni" in flags) if avx512 else ("avx_vnni" in flags)
    if not (platform.machine() == "aarch64" or (platform.machine() == "x86_64" and vnni)):
        pytest.skip(f"this {platform.machine()} CPU reports no VNNI: the emulated test covers the other side")
    assert host_int8_gemm_exact() is True


def test_the_probe_is_the_product_the_prefill_graph_runs():
    """PROBE_MODEL is this onnx.helper model (regenerate the constant from it if the probe changes), and the
    runtime loads it without importing onnx (0.8 s of a server's start)."""
    import base64
    import zlib

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from lineside.runtime import cpu_features

    k, n = cpu_features.PROBE_K, 8
    node = helper.make_node("MatMulIntegerToFloat", ["a", "b", "a_scale", "b_scale", "a_zero"], ["y"],
                            domain="com.microsoft")
    graph = helper.make_graph(
        [node], "int8_probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["rows", k]),
         helper.make_tensor_value_info("a_scale", TensorProto.FLOAT, ["rows", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
        [numpy_helper.from_array(np.full((k, n), 127, np.int8), "b"),
         numpy_helper.from_array(np.ones(n, np.float32), "b_scale"),
         numpy_helper.from_array(np.array(128, np.uint8), "a_zero")])
    want = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=8)
    got = onnx.load_from_string(cpu_features.probe_model())
    onnx.checker.check_model(got)
    fresh = base64.b64encode(zlib.compress(want.SerializeToString(), 9)).decode()
    assert got == want, f"PROBE_MODEL is stale; the model's constant now reads {fresh!r}"
    code = ("import sys; from lineside.runtime.cpu_features import host_int8_gemm_exact; host_int8_gemm_exact(); "
            "print('onnx' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.stdout.split() == ["False"], run.stderr[-2000:]


def fake_topology(root, cores):
    """``cores``: logical cpu -> (package, core id), as Linux lays out /sys/devices/system/cpu."""
    for cpu, (package, core) in cores.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_threads_count_physical_cores_of_the_affinity(tmp_path, monkeypatch):
    from lineside.runtime import cpu_features

    # a 4-core, 8-thread line PC: cpu k and k+4 are one core's two hyperthreads
    smt = fake_topology(tmp_path / "smt", {k: (0, k % 4) for k in range(8)})
    assert cpu_features.physical_cores(range(8), smt) == 4
    assert cpu_features.physical_cores({0, 4}, smt) == 1
    assert cpu_features.physical_cores({0, 1, 5}, smt) == 2
    two_sockets = fake_topology(tmp_path / "numa", {0: (0, 0), 1: (1, 0)})  # core ids repeat across packages
    assert cpu_features.physical_cores({0, 1}, two_sockets) == 2
    assert cpu_features.physical_cores({0, 9}, smt) == 0  # a cpu without topology: unknown

    monkeypatch.setattr(cpu_features, "SYSFS_CPU", smt)
    monkeypatch.setattr(cpu_features.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_features.default_threads() == 4
    monkeypatch.setattr(cpu_features.os, "sched_getaffinity", lambda pid: {1, 5})
    assert cpu_features.default_threads() == 1
    monkeypatch.setattr(cpu_features, "SYSFS_CPU", tmp_path / "absent")  # a container without /sys: logical count
    monkeypatch.setattr(cpu_features.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert cpu_features.default_threads() == 3
