"""Bench reports record the machine's load (CPU count, load averages before and after) and warn when it
was loaded, so a report made under load is not read as a slow server."""

from __future__ import annotations

import json

from rich.console import Console

from lineside.bench.metrics import summarize
from lineside.bench.report import compare, loaded_warning, machine_load, machine_record, markdown, write_json


def _load(one, cpus=2):
    return machine_load(getloadavg=lambda: (one, one / 2, one / 4), cpu_count=lambda: cpus)


def test_machine_load_and_warning_threshold():
    assert _load(0.4) == {"loadavg_1m": 0.4, "loadavg_5m": 0.2, "loadavg_15m": 0.1, "cpu_count": 2}
    assert loaded_warning(_load(0.5)) is None  # a quarter of 2 CPUs
    msg = loaded_warning(_load(4.3))
    assert msg and "4.3" in msg and "2 CPUs" in msg and "\n" not in msg
    assert loaded_warning(_load(4.3, cpus=64)) is None


def test_unavailable_loadavg_is_recorded_as_unknown():
    def broken():
        raise OSError("no loadavg here")

    m = machine_load(getloadavg=broken, cpu_count=lambda: 8)
    assert m["loadavg_1m"] is None and loaded_warning(m) is None


def test_report_records_and_shows_the_load(tmp_path):
    rec = machine_record(_load(4.3), _load(5.1))
    assert rec == {"cpu_count": 2, "loadavg_before": [4.3, 2.15, 1.07], "loadavg_after": [5.1, 2.55, 1.27],
                   "loaded": True}
    s = summarize([], 1.0)
    md = markdown(s, {"model": "m", "started_at": 0, "machine": rec}, [], [])
    assert "Machine: 2 CPUs; load average (1/5/15 min) 4.30/2.15/1.07 before, 5.10/2.55/1.27 after." in md
    assert "**Warning: the machine was loaded" in md
    calm = markdown(s, {"model": "m", "started_at": 0, "machine": machine_record(_load(0.1), _load(0.2))}, [], [])
    assert "Warning" not in calm
    a = write_json(tmp_path / "a.json", [], s, {"machine": rec})
    b = write_json(tmp_path / "b.json", [], s, {"machine": machine_record(_load(0.1), _load(0.2))})
    assert json.loads(a.read_text())["meta"]["machine"]["loaded"] is True
    console = Console(record=True, width=200)
    compare(a, b, console)
    assert "machine load at start, A 4.30/2.15/1.07 on 2 CPUs, B 0.10/0.05/0.03" in console.export_text()


def test_loaded_warning_is_one_line_on_a_narrow_console():
    """A log file or CI (not a terminal) gets rich's 80 columns: the warning is still one line, kept whole."""
    from lineside.bench.report import warn_if_loaded

    console = Console(record=True, width=40)
    warn_if_loaded(_load(4.3), console)
    text = console.export_text()
    assert text == loaded_warning(_load(4.3)) + "\n"
