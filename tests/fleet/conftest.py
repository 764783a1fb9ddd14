"""Fleet fixtures: real `lineside serve` workers, a llama.cpp server, and `lineside fleet gateway` (real smg)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import smollm2_gguf
from tests.jetson.conftest import sshd, sshd_device  # noqa: F401 - the loopback sshd the push tests use

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "fleet-model"  # every worker serves under this name, so SMG sees one model per pool


def free_ports(n: int) -> int:
    """The first of n consecutive free ports on loopback."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                t.bind(("127.0.0.1", base + i))
                socks.append(t)
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:.0f} s")


class Proc:
    """A server subprocess in its own process group; restartable with the same command."""

    def __init__(self, argv: list[str], ready_url: str, log: Path) -> None:
        self.argv, self.ready_url, self.log = argv, ready_url, log
        self.p: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> Proc:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env=env, cwd=REPO)
        wait_http(self.ready_url, self.p, timeout)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p is not None and self.p.poll() is None:
            os.killpg(self.p.pid, sig)
            self.p.wait(timeout=30)

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=10)


def lineside_worker(bundle: Path, port: int, log: Path, latency_log: Path | None = None) -> Proc:
    """`lineside serve`; with ``latency_log`` it writes one JSON line per request (the priority and mode its
    scheduler got)."""
    extra = ["--latency-log", str(latency_log)] if latency_log is not None else []
    return Proc([sys.executable, "-m", "lineside", "serve", str(bundle), "--port", str(port), "--num-slots", "4",
                 "--threads", "1", "--log-level", "warning", "--served-model-name", MODEL_NAME, *extra],
                f"http://127.0.0.1:{port}/health/ready", log)


def llama_worker(port: int, log: Path) -> Proc:
    gguf = smollm2_gguf()
    assert gguf is not None
    return Proc([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", MODEL_NAME,
                 "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", "1",
                 "--verbose", "False"], f"http://127.0.0.1:{port}/v1/models", log)


def need(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed ({why})")
