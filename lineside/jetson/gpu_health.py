"""GPU health for the server's /health/gpu: NVML on discrete GPUs, sysfs/tegrastats on Jetson.

Never raises: a machine without a GPU answers {"gpu": false, "reason": ...}.
"""

from __future__ import annotations

import glob
import importlib
import os
from pathlib import Path
from typing import Any

from lineside.jetson.probe import parse_meminfo, probe
from lineside.jetson.tegrastats import TegrastatsSampler

# A sampler the server may start once (start_tegrastats) so /health/gpu and /metrics get rails
# and temperatures without spawning tegrastats per request.
_sampler: TegrastatsSampler | None = None


def start_tegrastats(interval_ms: int = 1000) -> bool:
    """Start the background tegrastats sampler if tegrastats exists; True when running."""
    global _sampler
    if _sampler is not None:
        return True
    if not TegrastatsSampler.available():
        return False
    s = TegrastatsSampler(interval_ms)
    try:
        s.start()
    except OSError:
        return False
    _sampler = s
    return True


def stop_tegrastats() -> None:
    global _sampler
    if _sampler is not None:
        _sampler.stop()
        _sampler = None


def _nvml() -> dict[str, Any] | None:
    try:
        nv = importlib.import_module("pynvml")
    except ImportError:
        return None
    try:
        nv.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError has many subclasses (no driver, no GPU)
        return {"gpu": False, "reason": f"NVML could not start: {e}"}
    try:
        devices = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            name = nv.nvmlDeviceGetName(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            d: dict[str, Any] = {
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "memory_total_bytes": int(mem.total),
                "memory_used_bytes": int(mem.used),
                "gpu_load_percent": float(util.gpu),
            }
            for key, fn, args in (("temperature_c", nv.nvmlDeviceGetTemperature, (h, nv.NVML_TEMPERATURE_GPU)),
                                  ("power_mw", nv.nvmlDeviceGetPowerUsage, (h,))):
                try:
                    d[key] = int(fn(*args))
                except Exception:  # noqa: BLE001 - not every board reports every sensor
                    pass
            devices.append(d)
    except Exception as e:  # noqa: BLE001
        return {"gpu": False, "reason": f"NVML query failed: {e}"}
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    if not devices:
        return {"gpu": False, "reason": "NVML found no GPU"}
    return {"gpu": True, "kind": "nvml", "devices": devices}


def _jetson_sysfs(root: Path) -> dict[str, Any]:
    r = probe(root)
    out: dict[str, Any] = {
        "gpu": True,
        "kind": "jetson",
        "board": r.board,
        "l4t_version": r.l4t_version,
        "gpu_load_percent": r.gpu_load_percent,
        "memory_total_bytes": r.memory_total_bytes,
        "memory_available_bytes": r.memory_available_bytes,
        "power_mode": r.power_mode,
    }
    for path in sorted(glob.glob(str(root / "sys/devices/platform/**/devfreq/*gpu*/cur_freq"), recursive=True)):
        try:
            out["gpu_freq_hz"] = int(Path(path).read_text().strip())
            break
        except (OSError, ValueError):
            continue
    temps = {}
    for zone in sorted(glob.glob(str(root / "sys/class/thermal/thermal_zone*"))):
        try:
            name = Path(zone, "type").read_text().strip()
            milli = int(Path(zone, "temp").read_text().strip())
        except (OSError, ValueError):
            continue
        if milli > -255000:
            temps[name] = milli / 1000.0
    if temps:
        out["temperatures_c"] = temps
    t, why = _sampler.current() if _sampler is not None else (None, None)
    if why:
        out["tegrastats"] = why
    if t is not None:
        out["gpu_load_percent"] = t.gpu_load_percent if t.gpu_load_percent is not None else out["gpu_load_percent"]
        out["gpu_freq_mhz"] = t.gpu_freq_mhz
        out["rails_mw"] = {k: v[0] for k, v in t.rails_mw.items()}
        out["temperatures_c"] = t.temperatures_c or temps
        out["metrics"] = t.metrics()
    return out


def gpu_health(sysroot: str | os.PathLike[str] = "/") -> dict[str, Any]:
    """GPU state for /health/gpu; {"gpu": False, "reason": ...} when there is none."""
    root = Path(sysroot)
    try:
        if (root / "etc/nv_tegra_release").is_file() or (root / "sys/devices/platform/gpu.0").exists():
            return _jetson_sysfs(root)
        nvml = _nvml()
        if nvml is not None:
            return nvml
        mem = parse_meminfo((root / "proc/meminfo").read_text()) if (root / "proc/meminfo").is_file() else {}
        reason = "no NVIDIA GPU: not a Jetson and pynvml is not installed (pip install nvidia-ml-py)"
        if not glob.glob(str(root / "dev/nvidia[0-9]*")):
            reason = "no NVIDIA GPU: not a Jetson and no /dev/nvidia* device"
        return {"gpu": False, "reason": reason, "memory_total_bytes": mem.get("MemTotal")}
    except Exception as e:  # noqa: BLE001 - a health endpoint must answer, not crash
        return {"gpu": False, "reason": f"GPU health check failed: {e}"}
