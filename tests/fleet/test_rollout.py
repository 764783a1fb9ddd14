"""`fleet push` over three local targets: canary first, waves while healthy, rollback and stop on failure.

Each node is a directory target plus a small HTTP server that answers /health/ready the way a lineside node
does: 200 once the bundle at TARGET/current opens (every sha256 and the config checked), 503 otherwise.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from lineside.bundle import Manifest, open_bundle, write_manifest
from lineside.errors import LinesideError
from lineside.fleet.health import wait_healthy
from lineside.fleet.rollout import Outcome, rolling_push, waves
from lineside.fleet.spec import FleetFile
from tests.cli.cli_run import run_cli
from tests.fleet.http_stub import answering
from tests.jetson.conftest import make_bundle


@contextmanager
def node_server(target: Path):
    """A stand-in for `lineside serve TARGET/current`: ready iff that bundle loads."""
    def reply(path, headers):
        if path != "/health/ready":
            return 404, "text/plain", b"no"
        try:
            b = open_bundle(target / "current")
            code, body = 200, {"status": "ready", "model": b.config.name}
        except (LinesideError, OSError) as e:
            code, body = 503, {"status": "failed", "reason": str(e)[:200]}
        return code, "application/json", json.dumps(body).encode()

    with answering(reply) as url:
        yield url


class FakeClock:
    """Injected time for the health wait: sleep() advances it, nothing really waits."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept = 0.0

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        self.slept += s


def broken_bundle(path: Path, seed: int) -> Path:
    """A bundle whose every sha256 matches its manifest (push accepts it) but whose config cannot load."""
    make_bundle(path, seed, weight_bytes=4096, name="broken")
    (path / "config.json").write_text(json.dumps({"architecture": "llama", "vocab_size": 64}))
    write_manifest(path, Manifest(architecture="llama", config="config.json", max_seq_len=128,
                                  extra={"name": "broken"}, quantization={"scheme": "w4a16"}))
    return path


@pytest.fixture
def fleet3(tmp_path):
    """Three nodes (a, b, c) with their node servers; returns (make_fleet(bundle), targets, log)."""
    targets = {n: tmp_path / f"dev-{n}" for n in "abc"}
    log = tmp_path / "restarts.log"
    with ExitStack() as stack:
        urls = {n: stack.enter_context(node_server(t)) for n, t in targets.items()}

        def make(bundles: dict[str, Path], parallel: int = 4, canary: str = "b") -> FleetFile:
            return FleetFile.model_validate({
                "nodes": [{"name": n, "kind": "jetson", "url": urls[n], "target": str(targets[n]),
                           "bundle": str(bundles[n]), "device": "agx-orin-64",
                           "restart": f"echo {n} $(readlink {targets[n]}/current) >> {log}"} for n in "abc"],
                "pools": {"realtime": {"members": list("abc")}},
                "rollout": {"canary": canary, "parallel": parallel, "health_timeout_s": 30},
            })

        yield make, targets, log


def _wait(clock: FakeClock):
    client = httpx.Client(timeout=5.0, trust_env=False)
    return lambda n: wait_healthy(n, client, 30.0, interval_s=1.0, clock=clock.clock, sleep=clock.sleep)


def _current(t: Path) -> str:
    return os.readlink(t / "current")


def test_waves_put_the_canary_first(fleet3, tmp_path):
    make, _, _ = fleet3
    v1 = make_bundle(tmp_path / "v1", 1, weight_bytes=4096, name="model-v1")
    assert [[n.name for n in w] for w in waves(make(dict.fromkeys("abc", v1), parallel=1))] == [["b"], ["a"], ["c"]]
    assert [[n.name for n in w] for w in waves(make(dict.fromkeys("abc", v1)))] == [["b"], ["a", "c"]]


def test_rollout_updates_all_then_a_broken_canary_stops_it(fleet3, tmp_path):
    make, targets, log = fleet3
    v1 = make_bundle(tmp_path / "v1", 1, weight_bytes=4096, name="model-v1")
    clock = FakeClock()
    r1 = rolling_push(make(dict.fromkeys("abc", v1)), health=_wait(clock))
    assert r1.ok and [(n.node, n.outcome) for n in r1.nodes] == [
        ("b", Outcome.UPDATED), ("a", Outcome.UPDATED), ("c", Outcome.UPDATED)]
    v1_links = {n: _current(t) for n, t in targets.items()}
    assert all(open_bundle(t / "current").config.name == "model-v1" for t in targets.values())
    assert sorted(line.split()[0] for line in log.read_text().splitlines()) == ["a", "b", "c"]

    again = rolling_push(make(dict.fromkeys("abc", v1)), health=_wait(clock))  # nothing to do: no restarts
    assert again.ok and {n.outcome for n in again.nodes} == {Outcome.UNCHANGED}
    assert len(log.read_text().splitlines()) == 3

    bad = broken_bundle(tmp_path / "v2", 2)
    clock = FakeClock()
    r2 = rolling_push(make(dict.fromkeys("abc", bad)), health=_wait(clock))
    assert not r2.ok and r2.stopped.startswith("canary b rolled_back")
    assert [(n.node, n.outcome) for n in r2.nodes] == [
        ("b", Outcome.ROLLED_BACK), ("a", Outcome.NOT_STARTED), ("c", Outcome.NOT_STARTED)]
    assert "failed" in r2.nodes[0].error and "back on versions/model-v1-" in r2.nodes[0].error
    # the node said "failed" twice in a row: the wait ended then, not after the whole 30 s health timeout
    assert clock.slept == 1.0
    # every node serves v1 again; the ones after the canary never saw v2
    assert {n: _current(t) for n, t in targets.items()} == v1_links
    for n in "ac":
        assert not any("broken" in p.name for p in (targets[n] / "versions").iterdir())
    assert log.read_text().splitlines()[-1].split() == ["b", v1_links["b"]]  # the restart hook ran after rollback


def test_corrupt_canary_bundle_activates_nothing(fleet3, tmp_path):
    make, targets, _ = fleet3
    v1 = make_bundle(tmp_path / "v1", 1, weight_bytes=4096, name="model-v1")
    assert rolling_push(make(dict.fromkeys("abc", v1)), health=_wait(FakeClock())).ok
    before = {n: _current(t) for n, t in targets.items()}
    v2 = make_bundle(tmp_path / "v2", 3, weight_bytes=4096, name="model-v2")
    with open(v2 / "model.onnx.data", "r+b") as f:  # flip one byte after hashing: same size, wrong sha256
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0xFF]))
    r = rolling_push(make(dict.fromkeys("abc", v2)), health=_wait(FakeClock()))
    assert not r.ok and r.nodes[0].outcome == Outcome.PUSH_FAILED and "sha256" in r.nodes[0].error
    assert [n.outcome for n in r.nodes[1:]] == [Outcome.NOT_STARTED, Outcome.NOT_STARTED]
    assert {n: _current(t) for n, t in targets.items()} == before


def test_unhealthy_node_in_a_later_wave_stops_the_next_wave(fleet3, tmp_path):
    make, targets, _ = fleet3
    v1 = make_bundle(tmp_path / "v1", 1, weight_bytes=4096, name="model-v1")
    assert rolling_push(make(dict.fromkeys("abc", v1)), health=_wait(FakeClock())).ok
    v2 = make_bundle(tmp_path / "v2", 4, weight_bytes=4096, name="model-v2")
    bad = broken_bundle(tmp_path / "bad", 5)
    r = rolling_push(make({"b": v2, "a": bad, "c": v2}, parallel=1), health=_wait(FakeClock()))
    assert [(n.node, n.outcome) for n in r.nodes] == [
        ("b", Outcome.UPDATED), ("a", Outcome.ROLLED_BACK), ("c", Outcome.NOT_STARTED)]
    assert open_bundle(targets["b"] / "current").config.name == "model-v2"
    assert open_bundle(targets["a"] / "current").config.name == "model-v1"
    assert open_bundle(targets["c"] / "current").config.name == "model-v1"


def test_cli_push_reports_and_exits_nonzero_when_stopped(fleet3, tmp_path):

    import yaml

    make, targets, _ = fleet3
    v2 = make_bundle(tmp_path / "v2", 7, weight_bytes=4096, name="model-v2")
    (v2 / "model.onnx.data").write_bytes(b"x" * 4096)  # same size, different bytes: fails on the target
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(make(dict.fromkeys("abc", v2)).model_dump(mode="json", exclude_defaults=True)))
    p = run_cli("fleet", "push", path)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: rollout stopped: canary b push_failed")
    assert "b: push_failed" in p.stdout and "a: not_started" in p.stdout and "c: not_started" in p.stdout
    assert not any((t / "current").exists() for t in targets.values())


def test_a_bundle_the_planner_cannot_read_is_one_line(fleet3, tmp_path):
    from lineside.fleet.plan import plan_fleet
    from lineside.fleet.spec import FleetError

    make, _, _ = fleet3
    with pytest.raises(FleetError, match="node 'a': .*config"):
        plan_fleet(make(dict.fromkeys("abc", broken_bundle(tmp_path / "bad", 8))))


def test_ssh_canary_rolled_back_over_ssh(tmp_path, sshd):
    """The canary is a user@host:/dir target on a loopback sshd: push, restart hook and rollback all over ssh."""
    host, ssh = sshd
    targets = {"a": tmp_path / "dev-a", "b": tmp_path / "dev-b", "c": tmp_path / "dev-c"}
    log = tmp_path / "restarts.log"
    v1 = make_bundle(tmp_path / "v1", 11, weight_bytes=4096, name="model-v1")
    bad = broken_bundle(tmp_path / "bad", 12)
    with ExitStack() as stack:
        urls = {n: stack.enter_context(node_server(t)) for n, t in targets.items()}

        def make(bundle: Path) -> FleetFile:
            return FleetFile.model_validate({
                "nodes": [{"name": n, "kind": "jetson", "url": urls[n], "device": "agx-orin-64",
                           "target": f"{host}:{targets[n]}" if n == "a" else str(targets[n]), "bundle": str(bundle),
                           "restart": f"echo {n} $(readlink {targets[n]}/current) >> {log}"} for n in "abc"],
                "pools": {"realtime": {"members": list("abc")}},
                "rollout": {"canary": "a"}})

        assert rolling_push(make(v1), ssh=ssh, health=_wait(FakeClock())).ok
        before = {n: _current(t) for n, t in targets.items()}
        r = rolling_push(make(bad), ssh=ssh, health=_wait(FakeClock()))
        assert [(n.node, n.outcome) for n in r.nodes] == [
            ("a", Outcome.ROLLED_BACK), ("b", Outcome.NOT_STARTED), ("c", Outcome.NOT_STARTED)]
        assert {n: _current(t) for n, t in targets.items()} == before
        assert log.read_text().splitlines()[-1].split() == ["a", before["a"]]  # the hook ran on the node


@pytest.mark.parametrize(("target", "host", "port"), [
    ("ssh://lineside@orin-7:2222/opt/lineside", "lineside@orin-7", "2222"),
    ("lineside@[fe80::1%eth0]:/opt/lineside", "lineside@fe80::1%eth0", None),
    ("lineside@10.0.0.11:/opt/lineside", "lineside@10.0.0.11", None),
])
def test_the_restart_hook_goes_to_the_host_push_went_to(tmp_path, target, host, port):
    """Every TARGET form `jetson push` takes: the hook ran on host 'ssh' (ssh://...), on host 'lineside@[fe80'
    (an IPv6 target) or, for neither, in a local shell, while the push itself went to the device."""
    from lineside.fleet.rollout import run_restart
    from lineside.fleet.spec import Node

    calls = tmp_path / "calls"
    fake = tmp_path / "fake-ssh"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *"-O exit"*) exit 0;; esac\nfor a in "$@"; do printf "%s\\n" "$a"; done > {calls}\n')
    fake.chmod(0o755)
    run_restart(Node(name="a", kind="jetson", url="http://127.0.0.1:1", target=target, restart="systemctl restart x"),
                str(fake))
    argv = calls.read_text().splitlines()
    assert argv[-2:] == [host, "systemctl restart x"]
    assert (argv[argv.index("-p") + 1] if "-p" in argv else None) == port


def test_restart_hook_over_an_ssh_url_target(tmp_path, sshd):
    """The canary's target is ssh://user@host:port/dir (no -p in --ssh): the hook runs over ssh on that port."""
    import re

    host, ssh = sshd
    port = re.search(r"-p (\d+)", ssh).group(1)
    log = tmp_path / "restarts.log"
    v1 = make_bundle(tmp_path / "v1", 11, weight_bytes=4096, name="model-v1")
    with node_server(tmp_path / "dev") as url:
        fleet = FleetFile.model_validate({
            "nodes": [{"name": "a", "kind": "jetson", "url": url, "device": "agx-orin-64",
                       "target": f"ssh://{host}:{port}{tmp_path / 'dev'}", "bundle": str(v1),
                       "restart": f'echo "over ssh: ${{SSH_CONNECTION:+yes}}" >> {log}'}],
            "pools": {"realtime": {"members": ["a"]}}})
        r = rolling_push(fleet, ssh=ssh.replace(f"-p {port} ", ""), health=_wait(FakeClock()))
    assert r.ok, r.stopped
    assert log.read_text().splitlines() == ["over ssh: yes"]


@contextmanager
def scripted_health(answers: list[tuple[int, str]]):
    """A node whose /health/ready gives ``answers`` in turn (the last one from then on)."""
    seen = []

    def reply(path, headers):
        code, status = answers[min(len(seen), len(answers) - 1)]
        seen.append(status)
        return code, "application/json", json.dumps({"status": status}).encode()

    with answering(reply) as url:
        yield url, seen


@pytest.mark.parametrize(("answers", "ready", "probes"), [
    # the old process answering once more after the restart hook returned is not a verdict
    ([(503, "failed"), (503, "loading"), (503, "loading"), (200, "ready")], True, 4),
    # two "failed" in a row end the wait long before the timeout: a failed node does not recover by waiting
    ([(503, "loading"), (503, "failed"), (503, "failed")], False, 3),
    # "loading" for ever: the whole timeout (10 probes 1 s apart, then the last one at the deadline)
    ([(503, "loading")], False, 11),
])
def test_health_wait_ends_on_ready_a_repeated_failure_or_the_timeout(answers, ready, probes):
    from lineside.fleet.spec import Node

    clock = FakeClock()
    with scripted_health(answers) as (url, seen), httpx.Client(timeout=5.0, trust_env=False) as client:
        node = Node.model_validate({"name": "n", "kind": "jetson", "url": url})
        h = wait_healthy(node, client, 10.0, interval_s=1.0, clock=clock.clock, sleep=clock.sleep)
    assert h.ready is ready and len(seen) == probes


def test_a_node_refused_by_its_device_runtime_says_why_and_force_pushes_it(tmp_path, sshd_device):
    """The node's device has no lineside: `fleet push` reports the device check's reason for it in one line, with
    the override this command takes; --force pushes it, and its health check (then the rollback) still decide."""
    import yaml

    from tests.jetson.conftest import fake_device_python

    host, ssh, bin_dir = sshd_device
    fake_device_python(bin_dir, lineside=None)
    dev = tmp_path / "dev-a"
    v1 = make_bundle(tmp_path / "v1", 21, weight_bytes=4096, name="model-v1")
    bad = broken_bundle(tmp_path / "bad", 22)
    path = tmp_path / "fleet.yaml"
    with node_server(dev) as url:
        def write(bundle: Path) -> Path:
            path.write_text(yaml.safe_dump({
                "nodes": [{"name": "a", "kind": "jetson", "url": url, "device": "agx-orin-64",
                           "target": f"{host}:{dev}", "bundle": str(bundle)}],
                "pools": {"realtime": {"members": ["a"]}}, "rollout": {"health_timeout_s": 5}}))
            return path

        p = run_cli("fleet", "push", write(v1), "--ssh", ssh)
        assert p.returncode == 1, p.stderr
        report = [ln for ln in p.stdout.splitlines() if ln.startswith("a: ")]
        assert len(report) == 1 and report[0].startswith("a: push_failed (")
        assert "has no lineside" in report[0] and "pip install -U 'lineside>=" in report[0]
        assert "nothing was copied (pass --force, with --node a for this node alone" in report[0]
        assert not dev.exists()

        p = run_cli("fleet", "push", write(v1), "--ssh", ssh, "--force", "--json")
        assert p.returncode == 0, p.stderr
        node = json.loads(p.stdout)["nodes"][0]
        assert node["outcome"] == "updated" and "has no lineside" in node["warning"]
        v1_link = _current(dev)

        # (the CLI's planner refuses a bundle whose config cannot load before any push: rolling_push directly)
        fleet = FleetFile.model_validate(yaml.safe_load(write(bad).read_text()))
        r = rolling_push(fleet, ssh=ssh, health=_wait(FakeClock()), force=True)
        # unhealthy: rolled back past the same refusal, as it was forced
        assert r.nodes[0].outcome == Outcome.ROLLED_BACK, r.nodes[0]
        assert "has no lineside" in r.nodes[0].warning and _current(dev) == v1_link


def _one_node(url: str, dev: Path, bundle: Path, restart: str | None = None) -> FleetFile:
    """A fleet of one Jetson node "a" at ``url`` serving ``bundle`` from ``dev`` (with a ``restart:`` hook if given)."""
    node = {"name": "a", "kind": "jetson", "url": url, "device": "agx-orin-64", "target": str(dev), "bundle": str(bundle)}
    if restart is not None:
        node["restart"] = restart
    return FleetFile.model_validate({"nodes": [node], "pools": {"realtime": {"members": ["a"]}}})


def test_a_restart_that_fails_after_the_rollback_says_current_is_back_and_what_to_run(tmp_path):
    """The hook restarts onto v1, then fails from then on: v2 is rolled back (the links are back on v1), and the
    report says so and names the restart still to run, rather than that the rollback failed."""
    dev, marker = tmp_path / "dev", tmp_path / "restarted-once"
    hook = f"test -e {marker} && {{ echo 'unit lineside.service is masked' >&2; exit 1; }}; touch {marker}"
    v1 = make_bundle(tmp_path / "v1", 31, weight_bytes=4096, name="model-v1")
    v2 = make_bundle(tmp_path / "v2", 32, weight_bytes=4096, name="model-v2")
    with node_server(dev) as url:
        def fleet(bundle: Path) -> FleetFile:
            return _one_node(url, dev, bundle, restart=hook)

        assert rolling_push(fleet(v1), health=_wait(FakeClock())).ok
        v1_link = _current(dev)
        r = rolling_push(fleet(v2), health=_wait(FakeClock()))
    node = r.nodes[0]
    assert node.outcome == Outcome.ROLLBACK_FAILED and _current(dev) == v1_link
    assert f"current is back on {v1_link} but restart on a failed (unit lineside.service is masked)" in node.error
    assert f"restart the node's server by hand (`{hook}` there)" in node.error and "\n" not in node.error


def test_a_switch_without_a_restart_hook_says_the_old_bundle_is_still_served(tmp_path):
    """No restart: hook: the ready answer after the switch came from the process still serving v1, so the node's
    report says it serves v1 until restarted, and how; the first install (nothing served before) says nothing."""
    dev = tmp_path / "dev"
    v1 = make_bundle(tmp_path / "v1", 41, weight_bytes=4096, name="model-v1")
    v2 = make_bundle(tmp_path / "v2", 42, weight_bytes=4096, name="model-v2")
    with node_server(dev) as url:
        def fleet(bundle: Path) -> FleetFile:
            return _one_node(url, dev, bundle)

        first = rolling_push(fleet(v1), health=_wait(FakeClock()))
        v1_link = _current(dev)
        r = rolling_push(fleet(v2), health=_wait(FakeClock()))
    assert first.nodes[0].warning is None
    assert r.nodes[0].outcome == Outcome.UPDATED
    assert r.nodes[0].warning == (f"no restart: hook, so its server still serves {v1_link} until restarted (restart "
                                  f"the server that serves {dev}/current; or give the node a restart: in the fleet "
                                  "file); its health check saw that old process")
