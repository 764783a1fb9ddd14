"""The shipped alert rules and dashboard: checked by promtool, every metric and label they name exported by a
running server, and a real Prometheus scraping `lineside serve --fallback` on loopback sees the alert fire."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from lineside.bench.inprocess import free_port
from lineside.server.slo.policy import SloPolicy
from tests.server.conftest import metric, running_server

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
DASHBOARD = ROOT / "deploy/grafana/lineside.json"
_SELECTOR = re.compile(r"\b(lineside_[a-z0-9_]+)(?:\{([^}]*)\})?")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install prometheus; scripts/test.sh does it as root)")
    return path


def _expressions() -> list[str]:
    rules = [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return rules + [target["expr"] for panel in panels for target in panel["targets"]]


def test_promtool_checks_and_unit_tests_the_rules():
    promtool = _tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "7 rules found" in check.stdout
    test = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=ALERTS.parent, capture_output=True,
                          text=True, timeout=120)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_every_metric_and_label_the_rules_and_dashboard_name_is_exported(tiny_bundle):
    with running_server(tiny_bundle, num_slots=2, threads=1, slo_policy=SloPolicy()) as srv:
        httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        text = httpx.get(f"{srv.url}/metrics").text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    names = {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0) for line in samples}
    used = [(m.group(1), m.group(2) or "") for expr in _expressions() for m in _SELECTOR.finditer(expr)]
    assert len({name for name, _ in used}) >= 14
    missing = sorted({name for name, _ in used} - names)
    assert not missing, f"named in deploy/ but not exported: {missing}"
    for name, selector in used:
        for label, value in re.findall(r'(\w+)="([^"$]*)"', selector):
            assert any(line.startswith(name) and f'{label}="{value}"' in line for line in samples), (name, label, value)


def test_prometheus_scrapes_a_degrading_server_and_the_alert_fires(tiny_bundle, tmp_path):
    prometheus = _tool("prometheus")
    fallback = tmp_path / "tiny-fallback"
    shutil.copytree(tiny_bundle, fallback)
    policy = tmp_path / "policy.yaml"
    policy.write_text("level_1: {ttft_p90_s: 0.0001}\nlevel_2: {ttft_p90_s: 0.0002}\nmin_samples: 1\nwindow_s: 1.5\n"
                      "tick_s: 0.1\nrecover_after_s: 1\nflap_window_s: 0\n")
    rules = tmp_path / "alerts.yml"  # the shipped rules, with `for:` cut so the test takes seconds, not minutes
    rules.write_text(re.sub(r"for: \d+m", "for: 0s", ALERTS.read_text()))
    port, prom_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "lineside", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "lineside", "serve", str(tiny_bundle), "--port", str(port),
                               "--fallback", str(fallback), "--slo-policy", str(policy), "--num-slots", "2",
                               "--threads", "1", "--tokenizer-processes", "0", "--log-level", "warning"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, prom_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"
    try:
        _wait(lambda: _get(f"{url}/health/ready").status_code == 200, 120, "the server to be ready")
        first = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert first.json()["model"] == "tiny-llama"
        _wait(lambda: _get(f"{url}/health").json()["slo"]["level"] == 2, 30, "level 2")
        degraded = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert degraded.headers["x-lineside-degraded"] == "2" and degraded.json()["model"] == "tiny-fallback"
        def still_loaded_and_firing() -> bool:  # keep the load on until Prometheus has scraped and evaluated it
            httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
            return "LinesideDegraded" in _firing(prom_url)

        _wait(still_loaded_and_firing, 90, "Prometheus to fire LinesideDegraded")
        # no more load: the window empties and the ladder steps down, one level per recover_after
        _wait(lambda: _get(f"{url}/health").json()["slo"]["level"] == 0, 30, "recovery to level 0")
        text = _get(f"{url}/metrics").text
        # it stepped down through level 1 to 0; under the load above it may have done so more than once: at level 2
        # only the primary's latency is read and the fallback takes every request, so with flap_window_s 0 (no
        # backoff) the ladder tries level 1 again after each recover_after_s, as a breaker's half-open state does
        recovered = {lv: metric(text, "lineside_slo_transitions_total", f'level="{lv}",reason="recovered"')
                     for lv in ("0", "1")}
        assert recovered["0"] == 1 and recovered["1"] >= 1, recovered
        _wait(lambda: "LinesideDegraded" not in _firing(prom_url), 60, "the alert to resolve")
    finally:
        for process in (prom, server):
            process.send_signal(signal.SIGTERM)
        for process in (prom, server):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
    assert server.returncode == 0, server.stderr.read()[-2000:]


def _get(url: str) -> httpx.Response:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return httpx.Response(599)


def _firing(prom_url: str) -> set[str]:
    response = _get(f"{prom_url}/api/v1/alerts")
    if response.status_code != 200:
        return set()
    return {a["labels"]["alertname"] for a in response.json()["data"]["alerts"] if a["state"] == "firing"}


def _wait(predicate, timeout: float, what: str) -> None:
    """Poll a live process's state (real servers: no injected clock to advance)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
