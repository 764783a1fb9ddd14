"""tegrastats: parse its lines (JetPack 4/5/6 formats) and sample it in the background.

The server's /metrics and /health/gpu use this on Jetson, where there is no NVML.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB(?: \(lfb (\d+)x(\d+)MB\))?")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)MB(?: \(cached (\d+)MB\))?")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_EMC = re.compile(r"\bEMC_FREQ (\d+)%(?:@(\d+))?")
_GR3D = re.compile(r"\bGR3D_FREQ (\d+)%(?:@\[?([\d,]+)\]?)?")
_TEMP = re.compile(r"\b([A-Za-z][\w]*)@(-?\d+(?:\.\d+)?)C\b")
# JetPack 5+ prints 'VDD_IN 5123mW/5123mW', JetPack 4 'VDD_IN 5123/5123': an average without the unit its
# current has is a line cut short.
_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)(mW)?/(\d+)(?(3)mW)\b")
_NOT_RAILS = {"RAM", "SWAP", "IRAM"}  # memory 'used/total': in a truncated line they lose the MB the regexes want
_TIME = re.compile(r"^(\d\d-\d\d-\d{4} \d\d:\d\d:\d\d)\s")
_ENGINE = re.compile(r"\b(VIC|NVENC|NVDEC|NVJPG\d?|OFA|NVDLA\d|PVA\d_FREQ|APE|VIC_FREQ|MSENC|NVENC1|NVDEC1)"
                     r" (off|\d+)(?:%@\[?(\d+)\]?)?")


@dataclass
class CpuCore:
    load_percent: float | None  # None when the core is off
    freq_mhz: int | None
    online: bool


@dataclass
class TegraStats:
    """One tegrastats sample. Sizes in MB as tegrastats prints them; power in mW; temperatures in °C."""

    ram_used_mb: int | None = None
    ram_total_mb: int | None = None
    lfb_blocks: int | None = None  # largest free block count (of lfb_block_mb each)
    lfb_block_mb: int | None = None
    swap_used_mb: int | None = None
    swap_total_mb: int | None = None
    swap_cached_mb: int | None = None
    cpus: list[CpuCore] = field(default_factory=list)
    emc_load_percent: float | None = None
    emc_freq_mhz: int | None = None
    gpu_load_percent: float | None = None
    gpu_freq_mhz: int | None = None  # first GPC (Orin reports one per GPC)
    gpu_freqs_mhz: list[int] = field(default_factory=list)
    engines: dict[str, int | None] = field(default_factory=dict)  # MHz, None when off
    rails_mw: dict[str, tuple[int, int]] = field(default_factory=dict)  # (current, average)
    temperatures_c: dict[str, float] = field(default_factory=dict)  # sensors reading -256 (off) dropped
    timestamp: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        """Flat gauges for Prometheus (names without the lineside_ prefix)."""
        out: dict[str, float] = {}
        if self.ram_used_mb is not None and self.ram_total_mb is not None:
            out["jetson_ram_used_bytes"] = self.ram_used_mb * 1024 * 1024
            out["jetson_ram_total_bytes"] = self.ram_total_mb * 1024 * 1024
        if self.swap_used_mb is not None:
            out["jetson_swap_used_bytes"] = self.swap_used_mb * 1024 * 1024
        if self.gpu_load_percent is not None:
            out["jetson_gpu_load_percent"] = self.gpu_load_percent
        if self.gpu_freq_mhz is not None:
            out["jetson_gpu_freq_mhz"] = float(self.gpu_freq_mhz)
        if self.emc_load_percent is not None:
            out["jetson_emc_load_percent"] = self.emc_load_percent
        loads = [c.load_percent for c in self.cpus if c.load_percent is not None]
        if loads:
            out["jetson_cpu_load_percent"] = sum(loads) / len(loads)
        for name, (cur, _avg) in self.rails_mw.items():
            out[f"jetson_power_{name.lower()}_mw"] = float(cur)
        for name, t in self.temperatures_c.items():
            out[f"jetson_temp_{name.lower()}_c"] = t
        return out


def parse_line(line: str) -> TegraStats:
    """Parse one tegrastats line; fields a line lacks stay None / empty."""
    s = TegraStats()
    if m := _TIME.match(line):
        s.timestamp = m.group(1)
    if m := _RAM.search(line):
        s.ram_used_mb, s.ram_total_mb = int(m.group(1)), int(m.group(2))
        if m.group(3):
            s.lfb_blocks, s.lfb_block_mb = int(m.group(3)), int(m.group(4))
    if m := _SWAP.search(line):
        s.swap_used_mb, s.swap_total_mb = int(m.group(1)), int(m.group(2))
        s.swap_cached_mb = int(m.group(3)) if m.group(3) else None
    if m := _CPU.search(line):
        for part in m.group(1).split(","):
            part = part.strip()
            if part == "off" or not part:
                s.cpus.append(CpuCore(None, None, False))
                continue
            cm = re.match(r"(\d+)%(?:@(\d+))?", part)
            if cm:
                s.cpus.append(CpuCore(float(cm.group(1)), int(cm.group(2)) if cm.group(2) else None, True))
    if m := _EMC.search(line):
        s.emc_load_percent = float(m.group(1))
        s.emc_freq_mhz = int(m.group(2)) if m.group(2) else None
    if m := _GR3D.search(line):
        s.gpu_load_percent = float(m.group(1))
        if m.group(2):
            s.gpu_freqs_mhz = [int(f) for f in m.group(2).split(",") if f]
            s.gpu_freq_mhz = s.gpu_freqs_mhz[0] if s.gpu_freqs_mhz else None
    for name, value, freq in _ENGINE.findall(line):
        s.engines[name] = None if value == "off" else int(freq or value)
    for name, value in _TEMP.findall(line):
        t = float(value)
        if t > -255:  # -256C: the sensor is powered off
            s.temperatures_c[name] = t
    rest = _CPU.sub("", _RAM.sub("", _SWAP.sub("", line)))
    for name, cur, _unit, avg in _RAIL.findall(rest):
        if name in s.engines or name in _NOT_RAILS:
            continue
        s.rails_mw[name] = (int(cur), int(avg))
    if s.ram_total_mb is None and s.gpu_load_percent is None:
        raise ValueError(f"not a tegrastats line: {line[:80]!r}")
    return s


class TegrastatsSampler:
    """Runs `tegrastats --interval MS` in a thread and keeps the latest parsed sample."""

    def __init__(self, interval_ms: int = 1000, command: str = "tegrastats") -> None:
        self.interval_ms = interval_ms
        self.command = command
        self.latest: TegraStats | None = None
        self.latest_at: float | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def available(command: str = "tegrastats") -> bool:
        return shutil.which(command) is not None

    def start(self) -> None:
        exe = shutil.which(self.command)
        if exe is None:
            raise FileNotFoundError(f"{self.command} not found on PATH (tegrastats ships with L4T)")
        self._proc = subprocess.Popen([exe, "--interval", str(self.interval_ms)], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._thread = threading.Thread(target=self._run, name="tegrastats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.latest = parse_line(line.strip())
                self.latest_at = time.monotonic()
            except ValueError:
                continue

    def current(self) -> tuple[TegraStats | None, str | None]:
        """(the latest sample, None) while tegrastats runs and reports; (None, why) once it exited or went silent,
        so a frozen sample is never served as the device's state."""
        if self._proc is not None and self._proc.poll() is not None:
            return None, f"tegrastats exited (status {self._proc.returncode}); restart the server to sample again"
        if self.latest is None or self.latest_at is None:
            return None, "tegrastats has not reported a sample yet"
        age = time.monotonic() - self.latest_at
        if age > max(5.0, 5 * self.interval_ms / 1000):
            return None, f"tegrastats reported nothing for {age:.0f} s"
        return self.latest, None

    def wait_first(self, timeout: float = 5.0) -> TegraStats | None:
        deadline = time.monotonic() + timeout
        while self.latest is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.latest

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread:
            self._thread.join(timeout=5)
