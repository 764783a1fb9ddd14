"""One Shepherd Model Gateway (SMG, PyPI `smg`) router per pool: its command line from the fleet file.

Every option used here is one of `smg launch --help` (smg 1.13): the pool's policy; health checks on the
pool's health path; circuit breaker and retry settings; sticky sessions keyed by the session header
(`--sticky-sessions --routing-key-headers x-session-id`, idle time ≥ 60 s); Prometheus on loopback.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import asdict, dataclass

from lineside.fleet.spec import FleetError, FleetFile, node

SMG_VERSION = "1.13"
NEVER_GIVE_UP_S = 10 * 366 * 86400  # SMG's worker startup timeout: in effect, none


@dataclass(frozen=True)
class PoolRouter:
    pool: str
    host: str
    port: int
    metrics_port: int
    workers: tuple[str, ...]
    argv: tuple[str, ...]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["url"] = self.url
        return d


def missing_fleet_extra() -> list[str]:
    """What of the fleet extra that running the gateway needs is absent here (smg, aiohttp), in that order."""
    missing = [] if importlib.util.find_spec("smg") is not None or shutil.which("smg") else ["smg"]
    return missing + ([] if importlib.util.find_spec("aiohttp") is not None else ["aiohttp"])


def smg_command() -> list[str]:
    """How to run smg here: its module under this Python, else the `smg` on PATH; one line if neither."""
    if importlib.util.find_spec("smg") is not None:
        return [sys.executable, "-m", "smg"]
    exe = shutil.which("smg")
    if exe:
        return [exe]
    raise FleetError(f"smg (Shepherd Model Gateway) is not installed; `pip install 'smg>={SMG_VERSION}'` "
                     "(x86_64 and aarch64 manylinux_2_28 wheels)")


def adapter_ports(fleet: FleetFile) -> dict[str, int]:
    """node → port of its health adapter (after the routers' ports), for nodes that need one."""
    first = fleet.gateway.smg_base_port + 2 * len(fleet.pools)
    return {n.name: first + i for i, n in enumerate(x for x in fleet.nodes if x.needs_adapter)}


def worker_url(fleet: FleetFile, name: str, host: str = "127.0.0.1") -> str:
    """The URL SMG uses for a node: the node itself, or its health adapter."""
    ports = adapter_ports(fleet)
    return f"http://{host}:{ports[name]}" if name in ports else node(fleet, name).url.rstrip("/")


def pool_health_path(fleet: FleetFile, pool: str) -> str:
    """The one path SMG probes in a pool; adapted nodes answer /health and /health/ready alike."""
    members = [node(fleet, m) for m in fleet.pools[pool].members]
    paths = {n.health_path for n in members if not n.needs_adapter}
    if not paths:
        return "/health"
    if len(paths) > 1:
        raise FleetError(f"pool {pool!r} mixes health paths ({', '.join(sorted(paths))}); SMG probes one path per "
                         "pool: give its nodes the same health_path (/v1/models works for any OpenAI server)")
    path = paths.pop()
    if path not in ("/health", "/health/ready") and any(n.needs_adapter for n in members):
        raise FleetError(f"pool {pool!r}: its adapted nodes answer /health and /health/ready only; give the other "
                         f"nodes one of those as health_path (not {path})")
    return path


def pool_routers(fleet: FleetFile, *, base_cmd: list[str] | None = None, host: str = "127.0.0.1",
                 log_level: str = "warn") -> list[PoolRouter]:
    """The SMG router of every pool, on ports smg_base_port + 2i (router) and + 2i + 1 (metrics)."""
    g = fleet.gateway
    cmd = base_cmd if base_cmd is not None else smg_command()
    out = []
    for i, (pname, pool) in enumerate(fleet.pools.items()):
        port, mport = g.smg_base_port + 2 * i, g.smg_base_port + 2 * i + 1
        workers = tuple(worker_url(fleet, m, host) for m in pool.members)
        policy = pool.policy or g.policy
        argv = [
            *cmd, "launch", "--host", host, "--port", str(port), "--worker-urls", *workers,
            "--policy", str(policy),
            "--sticky-sessions", "--routing-key-headers", g.session.header, "x-smg-routing-key",
            "--sticky-key-idle-secs", str(g.session.idle_s), "--assignment-mode", "min_group",  # a new session goes to the worker with fewest sessions
            "--health-check-endpoint", pool_health_path(fleet, pname),
            "--health-check-interval-secs", str(g.health.interval_s),
            "--health-check-timeout-secs", str(g.health.timeout_s),
            "--health-failure-threshold", str(g.health.failure_threshold),
            "--health-success-threshold", str(g.health.success_threshold),
            "--cb-failure-threshold", str(g.breaker.failure_threshold),
            "--cb-success-threshold", str(g.breaker.success_threshold),
            "--cb-timeout-duration-secs", str(g.breaker.timeout_s),
            "--cb-window-duration-secs", str(g.breaker.window_s),
            "--retry-max-retries", str(g.retry.max_retries),
            "--retry-initial-backoff-ms", str(g.retry.initial_backoff_ms),
            "--retry-max-backoff-ms", str(g.retry.max_backoff_ms),
            "--request-timeout-secs", str(g.request_timeout_s),
            "--shutdown-grace-period-secs", "5",  # SIGTERM: stop within the stop timeout of a service manager
            "--prometheus-host", host, "--prometheus-port", str(mport),
            # a worker SMG cannot reach within the startup timeout is dropped for good (no discovery here to
            # add it again): a node down when the gateway starts must join whenever it comes back
            "--worker-startup-timeout-secs", str(NEVER_GIVE_UP_S),
            "--worker-startup-check-interval", str(g.health.interval_s),
            *(["--priority-scheduler-enabled", "--priority-scheduler-default-max-class", "interactive"]
              if g.priority else []),
            "--disable-tokenizer-autoload",  # plain HTTP routing needs no tokenizer (and no hub download)
            "--log-level", log_level,
        ]
        out.append(PoolRouter(pname, host, port, mport, workers, tuple(argv)))
    return out
