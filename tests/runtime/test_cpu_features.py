"""Which CPUs sum onnxruntime's int8 product exactly (MLAS's kernel choice), from /proc/cpuinfo's flags."""

from __future__ import annotations

import pytest

from lineside.runtime.cpu_features import cpu_flags, int8_gemm_exact

AVX2 = {"sse4_1", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(("machine", "flags", "exact"), [
    ("x86_64", AVX2, False),  # Zen 1-3, Intel before Ice Lake: vpmaddubsw saturates pairs in int16
    ("x86_64", AVX2 | {"avx_vnni"}, True),  # Alder Lake and later client parts
    ("x86_64", AVX512, False),  # Skylake-SP: AVX-512 without VNNI saturates too
    ("x86_64", AVX512 | {"avx512_vnni"}, True),  # Cascade Lake, Ice Lake, Zen 4
    ("x86_64", AVX512 | {"avx_vnni"}, False),  # MLAS's AVX-512 core kernel replaces the AVX-VNNI one
    ("x86_64", AVX512 | {"avx512_vnni", "amx_tile", "amx_int8"}, True),  # Sapphire Rapids: AMX
    ("x86_64", AVX2 | {"amx_tile", "amx_int8"}, True),
    ("x86_64", AVX2 | {"avx512f", "avx512_vnni"}, False),  # no AVX-512 core (BW/DQ/VL): the AVX2 kernel
    ("AMD64", AVX512 | {"avx512_vnni"}, True),  # Windows spells it so
    ("x86_64", set(), False),  # flags unknown: the safe answer
    ("aarch64", set(), True),  # NEON and UDOT sum in 32 bits
    ("arm64", {"asimd", "asimddp"}, True),
    ("ppc64le", set(), False),
    ("riscv64", set(), False),
])
def test_which_cpus_sum_int8_products_exactly(machine, flags, exact):
    assert int8_gemm_exact(machine, frozenset(flags)) is exact


def test_flags_come_from_the_first_processor():
    x86 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_vnni\nbugs\t\t: sysret_ss_attrs\n"
           "\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(x86) == frozenset({"fpu", "avx2", "avx512f", "avx512_vnni"})
    arm = "processor\t: 0\nBogoMIPS\t: 62.50\nFeatures\t: fp asimd evtstrm aes asimddp\n"
    assert "asimddp" in cpu_flags(arm)
    assert cpu_flags("") == frozenset()



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
