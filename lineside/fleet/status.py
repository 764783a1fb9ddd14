"""`fleet status`: every node's health, bundle version, degradation level and load, probed in parallel."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from lineside.errors import LinesideError
from lineside.fleet.health import NodeHealth, bundle_version, probe
from lineside.fleet.spec import FleetFile, pool_of


class NodesNotReady(LinesideError):
    """Some node is not ready: exit 3, as `systemctl is-active` (LSB "not running") does, so a cron job or CI step
    can act on `fleet status` alone and still tell an unhealthy fleet from a fleet file it could not read (1)."""

    exit_code = 3


def fleet_status(fleet: FleetFile, *, ssh: str = "ssh", timeout_s: float | None = None,
                 api_key: str | None = None) -> list[NodeHealth]:
    """One NodeHealth per node, in the fleet file's order; ``api_key`` is sent to every node (`serve --api-key`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s or fleet.gateway.health.timeout_s, headers=headers) as client:
        def one(n: Any) -> NodeHealth:
            h = probe(n, client)
            h.version = bundle_version(n, ssh)
            return h

        with ThreadPoolExecutor(max_workers=min(16, len(fleet.nodes))) as ex:
            return list(ex.map(one, fleet.nodes))


def status_json(fleet: FleetFile, health: list[NodeHealth]) -> dict[str, Any]:
    pools = pool_of(fleet)
    nodes = []
    for h in health:
        d = h.to_dict()
        d["pools"] = pools[h.node]
        nodes.append(d)
    ready = {p: sum(1 for h in health if h.ready and h.node in pool.members) for p, pool in fleet.pools.items()}
    return {"nodes": nodes, "pools": {p: {"members": pool.members, "ready": ready[p]}
                                      for p, pool in fleet.pools.items()}}


def status_table(fleet: FleetFile, health: list[NodeHealth]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    pools = pool_of(fleet)
    t = Table(title="fleet status")
    for col in ("node", "pools", "health", "model", "bundle version", "degradation", "running", "waiting", "ms"):
        t.add_column(col)
    for h in health:
        # what the node says (its status, model id, level) is text, not rich markup: "[q4]" would be a style tag
        state = "[green]ready[/green]" if h.ready else f"[red]{escape(h.status)}[/red]"
        t.add_row(h.node, ",".join(pools[h.node]), state, escape(h.model or "-"), escape(h.version or "-"),
                  escape(h.degradation or "-"), _num(h.running), _num(h.waiting), _num(h.latency_ms))
    return t


def status_notes(health: list[NodeHealth]) -> list[str]:
    """One line per node that is not ready, with what it said (an engine's failure, a load error) or why it could
    not be asked: the table's health column has room for the state only."""
    return [f"{h.node}: {h.status}: {h.error}" for h in health if not h.ready and h.error and h.error != h.status]


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def check_ready(health: list[NodeHealth]) -> None:
    """Raise NodesNotReady (one line naming each node that is not ready and its state) unless every node is."""
    down = [h for h in health if not h.ready]
    if down:
        which = ", ".join(f"{h.node}: {h.status}" for h in down)
        raise NodesNotReady(f"{len(down)} of {len(health)} nodes not ready ({which}); the report above says why "
                            "(`error` in --json)")
