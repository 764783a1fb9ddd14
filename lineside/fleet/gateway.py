"""`fleet gateway`: write the gateway's configuration (one SMG router per pool + the front) and run it.

The written directory holds ``gateway.json`` (every router's command line, ports and workers, and the front's
settings) and ``start-routers.sh``; `fleet gateway --dry-run` stops there.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lineside.fleet.front_config import FrontConfig, ShadowSpec
from lineside.fleet.smg import PoolRouter, adapter_ports, pool_routers
from lineside.fleet.spec import Engine, FleetError, FleetFile, node

ROUTER_WATCH_S = 1.0  # how often the gateway looks whether its routers still run
BODY_PRIORITY_ENGINES = frozenset({Engine.VLLM, Engine.SGLANG})


@dataclass
class GatewayPlan:
    routers: list[PoolRouter]
    front: FrontConfig
    host: str
    port: int
    adapters: dict[str, tuple[int, str, str]] = field(default_factory=dict)  # node → (port, upstream, health path)

    def to_dict(self) -> dict[str, Any]:
        f = self.front
        return {"front": {"host": self.host, "port": self.port, "pools": f.pools, "default_pool": f.default_pool,
                          "session_header": f.session_header, "session_cookie": f.session_cookie,
                          "session_idle_s": f.session_idle_s, "issue_cookie": f.issue_cookie,
                          "body_priority_pools": sorted(f.body_priority_pools),
                          "shadow": None if f.shadow is None else vars(f.shadow)},
                "routers": [r.to_dict() for r in self.routers],
                "health_adapters": {n: {"port": p, "upstream": u, "health_path": h}
                                    for n, (p, u, h) in self.adapters.items()}}


def gateway_plan(fleet: FleetFile, *, base_cmd: list[str] | None = None, log_level: str = "warn") -> GatewayPlan:
    g = fleet.gateway
    routers = pool_routers(fleet, base_cmd=base_cmd, log_level=log_level)
    shadow = (ShadowSpec(g.shadow.source, g.shadow.candidate, g.shadow.share) if g.shadow else None)
    # vLLM and SGLang read a request's priority from the body only (lower first: deploy datacenter's configs)
    body_priority = frozenset(p for p, pool in fleet.pools.items()
                              if any(node(fleet, m).engine in BODY_PRIORITY_ENGINES for m in pool.members))
    front = FrontConfig(pools={r.pool: r.url for r in routers}, default_pool=g.default_pool or next(iter(fleet.pools)),
                        session_header=g.session.header.lower(), session_cookie=g.session.cookie,
                        session_idle_s=g.session.idle_s, shadow=shadow, request_timeout_s=g.request_timeout_s,
                        priority=g.priority, body_priority_pools=body_priority if g.priority else frozenset())
    adapters = {name: (port, node(fleet, name).url, node(fleet, name).health_path)
                for name, port in adapter_ports(fleet).items()}
    return GatewayPlan(routers, front, g.host, g.port, adapters)


def write_gateway(plan: GatewayPlan, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "gateway.json"
    cfg.write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    sh = out / "start-routers.sh"
    lines = ["#!/bin/sh", "# one SMG router per pool (written by `lineside fleet gateway`)", "set -e"]
    lines += [" ".join(_q(a) for a in r.argv) + " &" for r in plan.routers]
    lines += ["wait"]
    sh.write_text("\n".join(lines) + "\n")
    sh.chmod(0o755)
    return [cfg, sh]


def _q(a: str) -> str:
    import shlex

    return shlex.quote(a)


class Routers:
    """The SMG processes of a gateway: started together, stopped together. They stay in the gateway's process
    group, so a signal to the group (Ctrl-C, a service manager's stop) reaches them too."""

    def __init__(self, plan: GatewayPlan, log_dir: Path) -> None:
        self.plan = plan
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, timeout_s: float = 60.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for r in self.plan.routers:
            log = open(self.log_dir / f"smg-{r.pool}.log", "ab")  # noqa: SIM115 - owned by the child
            self.procs[r.pool] = subprocess.Popen(list(r.argv), stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL)
            log.close()
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as c:
            for r in self.plan.routers:
                while True:
                    p = self.procs[r.pool]
                    if p.poll() is not None:
                        self.stop()
                        raise FleetError(f"the SMG router of pool {r.pool!r} exited ({p.returncode}): "
                                         f"{self.last_line(r.pool)}")
                    try:
                        if c.get(r.url + "/health").status_code < 500:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        self.stop()
                        raise FleetError(f"the SMG router of pool {r.pool!r} did not answer on {r.url} within "
                                         f"{timeout_s:.0f} s; see {self.log_dir / f'smg-{r.pool}.log'}")
                    time.sleep(0.2)

    def exited(self) -> tuple[str, int] | None:
        """(pool, exit status) of a router that is no longer running, if any."""
        for pool, p in self.procs.items():
            if p.poll() is not None:
                return pool, p.returncode
        return None

    def last_line(self, pool: str) -> str:
        log = self.log_dir / f"smg-{pool}.log"
        tail = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace")).strip() if log.exists() else ""
        return (tail.splitlines() or ["no output"])[-1][-200:]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()


@contextmanager
def routers_running(plan: GatewayPlan, log_dir: Path):
    r = Routers(plan, log_dir)
    r.start()
    try:
        yield r
    finally:
        r.stop()


def run_gateway(plan: GatewayPlan, log_dir: Path, log_level: str = "warning") -> None:
    """Start the routers, serve the front in the foreground until SIGINT/SIGTERM, then stop the routers."""
    import asyncio
    import signal

    import uvicorn

    from lineside.fleet.adapter import HealthAdapter
    from lineside.fleet.front import Front

    def server(app: object, host: str, port: int) -> uvicorn.Server:
        return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                             http="httptools", loop="auto"))

    adapters = [server(HealthAdapter(up, path).app, "127.0.0.1", port) for port, up, path in plan.adapters.values()]
    adapter_sockets = _bind_adapter_sockets([port for port, _, _ in plan.adapters.values()])

    async def serve_all() -> None:
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(a.serve(sockets=[s])) for a, s in zip(adapters, adapter_sockets, strict=True)]
        while adapters and not all(a.started for a in adapters):
            await asyncio.sleep(0.05)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):  # after the adapters': the front decides when all stop
            loop.add_signal_handler(sig, stop.set)
        front = Front(plan.front)
        try:  # bound before the routers start: a taken port is one line, nothing left running
            listener = await front.serve(plan.host, plan.port)
        except OSError as e:
            for a in adapters:
                a.should_exit = True
            await front.aclose()
            raise FleetError(f"the gateway cannot listen on {plan.host}:{plan.port} ({e.strerror or e}); "
                             "stop what uses it or set gateway.port in the fleet file") from None
        await asyncio.to_thread(routers.start)
        try:
            while not stop.is_set():  # a router that exits stops the gateway: its pool would only answer 502
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), ROUTER_WATCH_S)
                died = routers.exited()
                if died is not None:  # a Ctrl-C reaches the routers too: give its handler a moment to run
                    with suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.5)
                if died is not None and not stop.is_set():
                    raise FleetError(f"the SMG router of pool {died[0]!r} exited ({died[1]}) while serving (its log "
                                     f"ends: {routers.last_line(died[0])}); the gateway stopped (run it under a "
                                     "service manager that restarts it)")
        finally:
            listener.close()
            await front.aclose()
            for a in adapters:
                a.should_exit = True
            if tasks:  # their lifespan closes their connection pools
                await asyncio.wait(tasks, timeout=10)

    routers = Routers(plan, log_dir)
    try:
        _run(serve_all())
    finally:
        routers.stop()


def _bind_adapter_sockets(ports: list[int]) -> list[socket.socket]:
    """The health adapters' sockets, bound before anything starts: a taken port is one line (uvicorn binding it
    itself would exit from inside its task with a traceback, after the front was up)."""
    bound: list[socket.socket] = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            s.close()
            for b in bound:
                b.close()
            raise FleetError(f"the gateway's health adapter cannot listen on 127.0.0.1:{port} ({e.strerror or e}); "
                             "stop what uses it or move gateway.smg_base_port in the fleet file (the routers take "
                             "two ports per pool from there, the health adapters the ports after them)") from None
        bound.append(s)
    return bound


def _run(main: Any) -> None:
    """asyncio.run on uvloop when it is installed (the fleet extra): the front's own cost per request."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)
