"""`fleet push`: a rolling rollout built on `jetson push` (verified, resumable, atomic per node).

The canary goes first and alone; the other nodes follow in waves of ``rollout.parallel``, and a wave starts
only when every node of the one before came back healthy. A node that fails its push keeps its old version
(push activates nothing it could not verify); a node that comes back unhealthy is rolled back (current and
previous swapped, the restart hook run again) and the rollout stops there. A node whose device runtime cannot
open the bundle is refused like `jetson push` refuses it; ``force`` pushes it anyway and lets its health decide.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from lineside.errors import LinesideError
from lineside.fleet.health import NodeHealth, wait_healthy
from lineside.fleet.spec import FleetError, FleetFile, Node
from lineside.jetson.device_runtime import DeviceRefused
from lineside.jetson.push import push, rollback
from lineside.jetson.targets import SshTarget, open_target
from lineside.strenum import StrEnum


class Outcome(StrEnum):
    UPDATED = "updated"  # switched to the new version and healthy
    UNCHANGED = "unchanged"  # already on this version, healthy
    PUSH_FAILED = "push_failed"  # nothing activated; still on the old version
    ROLLED_BACK = "rolled_back"  # activated, unhealthy, back on the old version
    ROLLBACK_FAILED = "rollback_failed"  # activated, unhealthy, and could not go back (no previous version)
    NOT_STARTED = "not_started"  # the rollout stopped before this node


@dataclass
class NodeRollout:
    node: str
    outcome: Outcome
    version: str | None = None
    previous: str | None = None
    bytes_sent: int = 0
    health: str | None = None
    error: str | None = None
    warning: str | None = None  # --force's device refusal, or a switch nothing restarted onto (no restart: hook)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RolloutReport:
    order: list[list[str]]
    nodes: list[NodeRollout] = field(default_factory=list)
    stopped: str | None = None  # why the rollout stopped, None when it finished

    @property
    def ok(self) -> bool:
        return self.stopped is None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "stopped": self.stopped, "order": self.order,
                "nodes": [n.to_dict() for n in self.nodes]}


def waves(fleet: FleetFile, only: list[str] | None = None) -> list[list[Node]]:
    """[[canary], [next parallel nodes], ...] over the nodes that serve a bundle."""
    nodes = [n for n in fleet.nodes if n.bundle and (only is None or n.name in only)]
    if only:
        unknown = sorted(set(only) - {n.name for n in fleet.nodes})
        if unknown:
            raise FleetError(f"--node {unknown[0]!r} is not a node of the fleet")
    if not nodes:
        raise FleetError("no node of the fleet serves a bundle (give nodes a bundle and a target to push to)")
    canary_name = fleet.rollout.canary if fleet.rollout.canary in {n.name for n in nodes} else nodes[0].name
    canary = next(n for n in nodes if n.name == canary_name)
    rest = [n for n in nodes if n.name != canary_name]
    k = fleet.rollout.parallel
    return [[canary]] + [rest[i:i + k] for i in range(0, len(rest), k)]


def run_restart(node: Node, ssh: str) -> None:
    """The node's restart hook: over ssh for user@host targets, in a local shell otherwise."""
    if not node.restart:
        return
    # the target parsed as `jetson push` parses it: ssh://user@host:port/dir and user@[v6]:/dir are ssh targets too
    t = open_target(node.target or "", ssh)
    argv = [*t.ssh, t.host, node.restart] if isinstance(t, SshTarget) else ["sh", "-c", node.restart]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinesideError(f"restart on {node.name} failed ({e})") from None
    finally:
        t.close()
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or [p.stdout.strip() or f"exit {p.returncode}"])[-1]
        raise LinesideError(f"restart on {node.name} failed ({last})")


HealthWait = Callable[[Node], NodeHealth]


def rolling_push(fleet: FleetFile, *, ssh: str = "ssh", only: list[str] | None = None,
                 health: HealthWait | None = None, log: Callable[[str], None] = lambda s: None,
                 force: bool = False) -> RolloutReport:
    """Push each node's bundle, canary first, stopping at the first node that does not come back healthy;
    ``force`` pushes past a device runtime's refusal (its restart and health check still decide)."""
    plan = waves(fleet, only)
    report = RolloutReport(order=[[n.name for n in w] for w in plan])
    client = httpx.Client(timeout=fleet.gateway.health.timeout_s)
    wait = health or (lambda n: wait_healthy(n, client, fleet.rollout.health_timeout_s))
    try:
        for i, wave in enumerate(plan):
            label = "canary" if i == 0 else f"wave {i}"
            log(f"{label}: {', '.join(n.name for n in wave)}")
            with ThreadPoolExecutor(max_workers=len(wave)) as ex:
                results = list(ex.map(lambda n: _one(n, ssh, wait, force), wave))
            report.nodes.extend(results)
            for r in results:
                log(f"  {r.node}: {r.outcome}" + (f" ({r.error})" if r.error else ""))
                if r.warning:
                    log(f"  {r.node}: warning: {r.warning}")
            bad = [r for r in results if r.outcome not in (Outcome.UPDATED, Outcome.UNCHANGED)]
            if bad:
                report.stopped = f"{label} {bad[0].node} {bad[0].outcome}: {bad[0].error}"
                for w in plan[i + 1:]:
                    report.nodes.extend(NodeRollout(n.name, Outcome.NOT_STARTED) for n in w)
                break
    finally:
        client.close()
    return report


def _current(node: Node, ssh: str) -> str | None:
    t = open_target(node.target or "", ssh)
    try:
        return t.links()[0]
    finally:
        t.close()


def _one(node: Node, ssh: str, wait: HealthWait, force: bool = False) -> NodeRollout:
    assert node.bundle and node.target
    try:
        before = _current(node, ssh)
        r = push(node.bundle, node.target, ssh, force=force)
    except DeviceRefused as e:  # `jetson push`'s hint names its own --force; this command's takes --node
        return NodeRollout(node.name, Outcome.PUSH_FAILED, error=f"{e.reason}; nothing was copied (pass --force, "
                           f"with --node {node.name} for this node alone, to push it anyway; its health check "
                           "still decides)")
    except (LinesideError, OSError) as e:
        return NodeRollout(node.name, Outcome.PUSH_FAILED, error=str(e))
    done = _health_or_rollback(node, ssh, wait, force, r.version, before, r.bytes_sent)
    stale = None
    if r.switched and not node.restart and before and done.outcome is Outcome.UPDATED:
        # nothing restarted it: the ready answer came from the process still serving the old bundle
        how = f"`{r.restart}`" if r.restart else f"restart the server that serves {node.target}/current"
        stale = (f"no restart: hook, so its server still serves {before} until restarted ({how}; or give the node "
                 "a restart: in the fleet file); its health check saw that old process")
    forced = f"pushed anyway (--force): {r.device_warning}" if r.device_warning else None
    done.warning = "; ".join(w for w in (forced, stale) if w) or None
    return done


def _health_or_rollback(node: Node, ssh: str, wait: HealthWait, force: bool, version: str, before: str | None,
                        sent: int) -> NodeRollout:
    """Restart onto ``version`` if it was switched to, wait for health, and roll back when it does not come."""
    assert node.target
    switched = before != f"versions/{version}"
    try:
        if switched:
            run_restart(node, ssh)
        h = wait(node)
    except LinesideError as e:
        h = NodeHealth(node.name, node.url, False, False, "failed", error=str(e))
    if h.ready:
        return NodeRollout(node.name, Outcome.UPDATED if switched else Outcome.UNCHANGED, version, before, sent,
                           h.status)
    why = f"unhealthy after the switch ({h.status}{': ' + h.error if h.error else ''})"
    if not switched:
        return NodeRollout(node.name, Outcome.ROLLED_BACK, version, before, sent, h.status,
                           why + "; it was already on this version, nothing to roll back")
    try:
        rollback(node.target, ssh, force=force)
    except LinesideError as e:
        return NodeRollout(node.name, Outcome.ROLLBACK_FAILED, version, before, sent, h.status,
                           f"{why}; rollback failed: {e}")
    try:
        run_restart(node, ssh)
    except LinesideError as e:  # the links are back: only the process still has to be restarted onto them
        return NodeRollout(node.name, Outcome.ROLLBACK_FAILED, version, before, sent, h.status,
                           f"{why}; current is back on {before} but {e}: restart the node's server by hand "
                           f"(`{node.restart}` there)")
    return NodeRollout(node.name, Outcome.ROLLED_BACK, version, before, sent, h.status, f"{why}; back on {before}")
