"""Probe, tegrastats parser and gpu_health against fake sysroots and recorded tegrastats lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from lineside.jetson import gpu_health as gh
from lineside.jetson.probe import jetpack_for_l4t, parse_nv_tegra_release, probe
from lineside.jetson.tegrastats import TegrastatsSampler, parse_line
from tests.cli.cli_run import run_cli

FIX = Path(__file__).parent / "fixtures"
AGX, NANO, PC = FIX / "sysroots/agx-orin-64", FIX / "sysroots/orin-nano-8", FIX / "sysroots/x86-pc"


def test_probe_agx_orin_64_jetpack6():
    r = probe(AGX)
    assert r.is_jetson and r.board == "NVIDIA Jetson AGX Orin Developer Kit"
    assert r.device == "agx-orin-64"
    assert (r.l4t_version, r.jetpack_version) == ("36.4.3", "6.2")
    assert r.memory_total_bytes == 64335836 * 1024 and r.memory_available_bytes == 58871012 * 1024
    assert r.gpu_load_percent == 37.2 and r.gpu_load_source == "/sys/devices/platform/gpu.0/load"
    assert (r.power_mode, r.power_mode_id) == ("MAXN", 0)
    assert r.tensorrt_version == "10.3.0.30"


def test_probe_orin_nano_jetpack5_other_gpu_node():
    r = probe(NANO)
    assert r.is_jetson and r.device == "orin-nano-8"
    assert (r.l4t_version, r.jetpack_version) == ("35.4.1", "5.1.2")
    assert r.gpu_load_percent == 0.0 and "17000000.gpu" in r.gpu_load_source
    assert r.power_mode is None  # no status file and not the live machine: nvpmodel -q is not run
    assert r.tensorrt_version == "8.5.2.2"


def test_probe_non_jetson():
    r = probe(PC)
    assert not r.is_jetson and r.board == "OptiPlex 7090"
    assert r.l4t_version is None and r.gpu_load_percent is None
    assert any("not a Jetson" in n for n in r.notes)


@pytest.mark.parametrize(("line", "l4t"), [
    ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic", "36.4.3"),
    ("# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic", "36.4.0"),
    ("# R36 (release), REVISION: 3.0, GCID: 36191598", "36.3.0"),
    ("# R35 (release), REVISION: 6.0, GCID: 35846286", "35.6.0"),
])
def test_nv_tegra_release(line, l4t):
    assert parse_nv_tegra_release(line) == l4t


def test_l4t_to_jetpack():
    assert jetpack_for_l4t("36.4.0") == "6.1"
    assert jetpack_for_l4t("36.4.3") == "6.2"
    assert jetpack_for_l4t("36.3.0") == "6.0"
    assert jetpack_for_l4t("35.3.1") == "5.1.1"
    assert jetpack_for_l4t("35.9.9") == "5.1.x"
    assert jetpack_for_l4t("36.4.9") == "6.2.x"


def _lines(name: str) -> list[str]:
    return (FIX / "tegrastats" / name).read_text().strip().splitlines()


def test_tegrastats_jetpack6_agx_orin():
    idle, busy = (parse_line(x) for x in _lines("jp6-agx-orin-r36.4.log"))
    assert idle.timestamp == "11-29-2026 10:15:22"
    assert (busy.ram_used_mb, busy.ram_total_mb, busy.swap_total_mb) == (9870, 62841, 31421)
    assert busy.gpu_load_percent == 97.0 and busy.gpu_freqs_mhz == [1300, 1300] and busy.gpu_freq_mhz == 1300
    assert (busy.emc_load_percent, busy.emc_freq_mhz) == (41.0, 3199)
    assert len(busy.cpus) == 12 and busy.cpus[0].load_percent == 14.0 and busy.cpus[0].freq_mhz == 2201
    assert busy.rails_mw == {"VDD_GPU_SOC": (21837, 12914), "VDD_CPU_CV": (2380, 1389), "VIN_SYS_5V0": (7070, 5496)}
    assert busy.temperatures_c["gpu"] == 51.593 and busy.temperatures_c["tj"] == 51.593
    assert busy.engines["NVENC"] is None and busy.engines["APE"] == 174
    m = busy.metrics()
    assert m["jetson_gpu_load_percent"] == 97.0 and m["jetson_power_vdd_gpu_soc_mw"] == 21837
    assert m["jetson_ram_used_bytes"] == 9870 * 1024 * 1024


def test_tegrastats_jetpack5_agx_orin():
    s = parse_line(_lines("jp5-agx-orin-r35.4.log")[0])
    assert (s.ram_used_mb, s.ram_total_mb, s.lfb_blocks, s.lfb_block_mb) == (2448, 30536, 6209, 4)
    assert [c.online for c in s.cpus].count(False) == 4
    assert s.gpu_freqs_mhz == [305, 305] and s.gpu_load_percent == 0.0
    assert "GPU" not in s.temperatures_c and "CV0" not in s.temperatures_c  # -256C: sensor off
    assert s.temperatures_c["CPU"] == 46.75
    assert s.rails_mw["VDDQ_VDD2_1V8AO"] == (302, 302)
    assert s.engines["VIC_FREQ"] == 729


def test_tegrastats_orin_nano_and_jetpack4():
    nano = parse_line(_lines("jp6-orin-nano-r36.3.log")[0])
    assert nano.gpu_load_percent == 37.0 and nano.gpu_freq_mhz == 624
    assert nano.rails_mw["VDD_IN"] == (4738, 4738) and len(nano.cpus) == 6
    old = parse_line(_lines("jp4-xavier-nx-r32.7.log")[0])
    assert old.gpu_load_percent == 0.0 and old.gpu_freq_mhz is None and old.emc_freq_mhz is None
    assert old.rails_mw == {"VDD_IN": (3468, 3468), "VDD_CPU_GPU_CV": (416, 416), "VDD_SOC": (1180, 1180)}
    assert old.temperatures_c["thermal"] == 42.3


def test_tegrastats_truncated_line_makes_no_rail():
    # the last line of a dying tegrastats stops mid-field: 'SWAP 0/38' is not a 38 mW rail named SWAP, and
    # '5123mW/51' (the average cut short) is not an average of 51 mW
    s = parse_line("RAM 1234/7620MB (lfb 2x4MB) SWAP 0/38")
    assert s.rails_mw == {} and not any(k.startswith("jetson_power_") for k in s.metrics())
    s = parse_line("RAM 1234/7620MB (lfb 2x4MB) SWAP 0/3810MB (cached 0MB) CPU [12%@1510,off] EMC_FREQ 0%@2133 "
                   "GR3D_FREQ 0%@[305] VDD_SOC 1500mW/1500mW VDD_IN 5123mW/51")
    assert s.rails_mw == {"VDD_SOC": (1500, 1500)}


def test_tegrastats_rejects_other_text():
    with pytest.raises(ValueError):
        parse_line("hello world")


def _fake_tool(bindir: Path, name: str, body: str) -> None:
    p = bindir / name
    p.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    p.chmod(0o755)


def test_tegrastats_sampler_with_fake_binary(tmp_path, monkeypatch):
    line = _lines("jp6-orin-nano-r36.3.log")[0]
    _fake_tool(tmp_path, "tegrastats", f"""
        echo "$@" > {tmp_path}/args
        while true; do echo '{line}'; sleep 0.05; done
    """)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    s = TegrastatsSampler(interval_ms=50)
    s.start()
    try:
        first = s.wait_first(5)
    finally:
        s.stop()
    assert first is not None and first.gpu_load_percent == 37.0
    assert (tmp_path / "args").read_text().split() == ["--interval", "50"]


def test_gpu_health_after_tegrastats_died(tmp_path, monkeypatch):
    # a sampler whose tegrastats exited kept serving its last sample: /metrics and the SLO controller read a
    # GPU load and power frozen at the moment it died
    busy = _lines("jp6-agx-orin-r36.4.log")[1]
    _fake_tool(tmp_path, "tegrastats", f"echo '{busy}'\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    s = TegrastatsSampler(interval_ms=50)
    s.start()
    assert s.wait_first(5) is not None
    s._thread.join(5)
    monkeypatch.setattr(gh, "_sampler", s)
    h = gh.gpu_health(AGX)
    assert "metrics" not in h and "rails_mw" not in h
    assert h["gpu_load_percent"] == 37.2  # sysfs, not the frozen 97%
    assert h["tegrastats"].startswith("tegrastats exited")
    from lineside.server.metrics import ServerMetrics

    m = ServerMetrics()
    m.update_device({"jetson_gpu_load_percent": 97.0})
    m.update_device(h.get("metrics") or {})  # what /metrics passes on the next scrape
    assert b"lineside_jetson_gpu_load_percent" not in m.render()


def test_gpu_health_on_jetson_sysroot():
    h = gh.gpu_health(AGX)
    assert h["gpu"] is True and h["kind"] == "jetson"
    assert h["gpu_load_percent"] == 37.2 and h["gpu_freq_hz"] == 1300500000
    assert h["temperatures_c"] == {"cpu-thermal": 45.25, "gpu-thermal": 43.906}
    assert h["l4t_version"] == "36.4.3"


def test_gpu_health_without_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails like an absent package
    h = gh.gpu_health(PC)
    assert h["gpu"] is False and "not a Jetson" in h["reason"]


def test_gpu_health_nvml(monkeypatch):
    fake = types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=85520809984, used=1 << 30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=42),
        nvmlDeviceGetTemperature=lambda h, kind: 35,
        nvmlDeviceGetPowerUsage=lambda h: 71000,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    h = gh.gpu_health(PC)
    assert h["gpu"] is True and h["kind"] == "nvml"
    assert h["devices"][0] == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85520809984,
                               "memory_used_bytes": 1 << 30, "gpu_load_percent": 42.0, "temperature_c": 35,
                               "power_mw": 71000}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("jetson", *args)


def test_cli_probe_json_and_text():
    p = _cli("probe", "--sysroot", str(AGX), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for key in ("is_jetson", "board", "l4t_version", "jetpack_version", "memory_total_bytes",
                "gpu_load_percent", "power_mode", "tensorrt_version"):
        assert key in d
    assert d["l4t_version"] == "36.4.3" and d["power_mode"] == "MAXN"
    p = _cli("probe", "--sysroot", str(PC))
    assert p.returncode == 0 and p.stdout.startswith("not a Jetson (OptiPlex 7090)")
