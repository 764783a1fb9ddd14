"""The node probe behind `fleet status`: readiness, load gauges of lineside/vLLM/SGLang, degradation level,
model name, and the bundle version from the node's push target."""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx

from lineside.fleet.health import NodeHealth, _load, bundle_version, probe
from lineside.fleet.spec import Node
from lineside.jetson.push import push
from tests.fleet.http_stub import answering
from tests.jetson.conftest import make_bundle


@contextmanager
def server(routes: dict[str, tuple[int, str, str]], key: str = ""):
    """``key``: every path but /health* wants 'Authorization: Bearer <key>' (401 otherwise), as `serve --api-key`."""
    def reply(path, headers):
        code, ctype, body = routes.get(path, (404, "text/plain", "no"))
        if key and not path.startswith("/health") and headers.get("authorization") != f"Bearer {key}":
            code, ctype, body = 401, J, json.dumps({"error": {"message": "wrong API key"}})
        return code, ctype, body.encode()

    with answering(reply) as url:
        yield url


J = "application/json"


def test_load_gauges_of_each_engine_and_the_degradation_level():
    assert _load("lineside_num_requests_running 3\nlineside_num_requests_waiting 7\n"
                 "lineside_degradation_level 2\n") == (3.0, 7.0, "2")
    assert _load('vllm:num_requests_running{model_name="m"} 5\nvllm:num_requests_waiting{model_name="m"} 1\n') == (
        5.0, 1.0, None)
    assert _load("sglang:num_running_reqs 4\nsglang:num_queue_reqs 0\n") == (4.0, 0.0, None)
    assert _load("something_else 1\n") == (None, None, None)


def test_probe_a_ready_lineside_node_and_a_loading_one():
    routes = {
        "/health/ready": (200, J, json.dumps({"status": "ready", "model": "m"})),
        "/health": (200, J, json.dumps({"status": "ok", "degradation": "reduced-context"})),
        "/metrics": (200, "text/plain", "lineside_num_requests_running 2\nlineside_num_requests_waiting 5\n"),
        "/v1/models": (200, J, json.dumps({"data": [{"id": "r1-qwen-7b"}]})),
    }
    with server(routes) as url, httpx.Client(timeout=5, trust_env=False) as c:
        h = probe(Node(name="n", kind="jetson", url=url), c)
        assert (h.ready, h.status, h.model, h.running, h.waiting, h.degradation) == (
            True, "ready", "r1-qwen-7b", 2.0, 5.0, "reduced-context")
        routes["/health/ready"] = (503, J, json.dumps({"status": "loading"}))
        h = probe(Node(name="n", kind="jetson", url=url), c)
        assert not h.ready and h.status == "loading" and h.error == "loading"
    h = probe(Node(name="gone", kind="x86", url="http://127.0.0.1:1"), httpx.Client(timeout=2, trust_env=False))
    assert not h.reachable and h.status == "unreachable"


def test_a_node_behind_an_api_key(tmp_path):
    """A node run with `serve --api-key`: its load and model were a silent "-"; now the probe says 401 and
    `fleet status --api-key` (or LINESIDE_API_KEY) reads them."""
    from lineside.fleet.spec import load_fleet
    from lineside.fleet.status import fleet_status
    from tests.cli.cli_run import run_cli

    routes = {
        "/health/ready": (200, J, json.dumps({"status": "ready"})),
        "/metrics": (200, "text/plain", "lineside_num_requests_running 2\nlineside_num_requests_waiting 5\n"),
        "/v1/models": (200, J, json.dumps({"data": [{"id": "r1-qwen-7b"}]})),
    }
    with server(routes, key="k3y") as url:
        fleet_file = tmp_path / "fleet.yaml"
        fleet_file.write_text(f"version: 1\nnodes:\n  - {{name: n, kind: x86, url: '{url}'}}\n"
                              "pools:\n  realtime: {members: [n]}\n")
        f = load_fleet(fleet_file)
        (h,) = fleet_status(f)
        assert h.ready and h.unauthorized and h.model is None and "401" in (h.error or "")
        (h,) = fleet_status(f, api_key="k3y")
        assert (h.model, h.running, h.waiting, h.unauthorized) == ("r1-qwen-7b", 2.0, 5.0, False)
        p = run_cli("fleet", "status", fleet_file)
        assert p.returncode == 0 and "401" in p.stderr and "--api-key" in p.stderr, p.stderr
        p = run_cli("fleet", "status", fleet_file, "--json", env={**os.environ, "LINESIDE_API_KEY": "k3y"})
        assert p.returncode == 0 and json.loads(p.stdout)["nodes"][0]["model"] == "r1-qwen-7b", p.stderr


def test_bundle_version_is_what_current_points_at(tmp_path):
    target = tmp_path / "dev"
    node = Node(name="n", kind="jetson", url="http://127.0.0.1:1", target=str(target))
    assert bundle_version(node, "ssh") is None
    r = push(make_bundle(tmp_path / "b", 1, weight_bytes=1024, name="model-v7"), str(target))
    assert bundle_version(node, "ssh") == r.version and r.version.startswith("model-v7-")


def test_status_table_shows_what_nodes_report_as_text_not_rich_markup():
    """A node's own words go into the table: its status "[warming up]" vanished and a model id ending in "[q4]"
    lost it (rich read them as style tags); a status "[/]" stopped `fleet status` with a MarkupError."""
    from rich.console import Console

    from lineside.fleet.spec import parse_fleet
    from lineside.fleet.status import status_table

    fleet = parse_fleet("nodes: [{name: a, kind: x86, engine: openai, url: 'http://127.0.0.1:9'},"
                        " {name: b, kind: x86, engine: openai, url: 'http://127.0.0.1:10'}]\n"
                        "pools: {realtime: {members: [a, b]}}\n", Path("fleet.yaml"))
    health = [NodeHealth("a", "http://127.0.0.1:9", True, False, "[warming up]", model="org/r1[q4]",
                         degradation="[1]"),
              NodeHealth("b", "http://127.0.0.1:10", True, False, "[/]")]
    console = Console(width=200, record=True)
    console.print(status_table(fleet, health))
    text = console.export_text()
    assert "[warming up]" in text and "org/r1[q4]" in text and "[1]" in text and "[/]" in text


def test_bundle_version_of_a_host_that_never_answers_ssh_gives_up(monkeypatch):
    """`fleet status` on a node whose address takes the connection but never speaks SSH (a hung sshd, a
    firewall that black-holes the handshake) hung for ssh's own 600 s timeout (ssh sets no connect timeout
    of its own); now ssh gives up after ConnectTimeout and the node's version is unknown ("-")."""
    import socket

    from lineside.jetson import targets

    monkeypatch.setattr(targets, "SSH_CONNECT_TIMEOUT_S", 1, raising=False)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    node = Node(name="n", kind="jetson", url="http://127.0.0.1:1", target="nobody@127.0.0.1:/opt/lineside")
    result: list[str | None] = []
    t = threading.Thread(target=lambda: result.append(bundle_version(node, f"ssh -p {port}")), daemon=True)
    try:
        t.start()
        t.join(30)
        assert not t.is_alive(), "ssh is still waiting for the host's banner"
        assert result == [None]
    finally:
        for s in (listener, *accepted):
            s.close()


def test_fleet_status_says_why_a_node_is_not_ready(tmp_path):
    """A node whose engine failed answers 503 with its reason (`serve`'s own body); `fleet status` showed only
    "failed" in red, and the reason was in --json alone. Now a line under the table names it, as it does the
    cause of an unreachable node; a ready node gets no line."""
    from lineside.server.health import engine_failed
    from tests.cli.cli_run import run_cli

    why = "3 consecutive model steps failed, the last with: CUDA error: an illegal memory access was encountered"
    failed = (503, J, engine_failed(why).body.decode())
    routes = {"/health/ready": failed, "/health": failed, "/v1/models": (200, J, json.dumps({"data": [{"id": "m"}]}))}
    ok = {"/health/ready": (200, J, json.dumps({"status": "ready"}))}
    with server(routes) as bad_url, server(ok) as ok_url:
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(f"nodes:\n  - {{name: orin-1, kind: x86, url: '{bad_url}'}}\n"
                         f"  - {{name: orin-2, kind: x86, url: '{ok_url}'}}\n"
                         "  - {name: orin-3, kind: x86, url: 'http://127.0.0.1:1'}\n"
                         "pools: {realtime: {members: [orin-1, orin-2, orin-3]}}\n")
        p = run_cli("fleet", "status", fleet)
        as_json = run_cli("fleet", "status", fleet, "--json")
    # a status that reports failures fails (exit 3, as `systemctl is-active`): it exited 0, and a cron job or CI
    # step had to parse the table to notice; the report is printed all the same, the nodes named in one line
    assert p.returncode == 3, p.stderr
    lines = p.stdout.splitlines()
    assert f"orin-1: failed: {why}" in lines
    assert any(line.startswith("orin-3: unreachable: ") for line in lines)
    assert not any(line.startswith("orin-2:") for line in lines)
    assert p.stderr.strip().splitlines() == ["error: 2 of 3 nodes not ready (orin-1: failed, orin-3: unreachable); "
                                             "the report above says why (`error` in --json)"]
    assert as_json.returncode == 3, as_json.stderr
    assert [n["ready"] for n in json.loads(as_json.stdout)["nodes"]] == [False, True, False]


def test_fleet_status_exits_0_only_when_every_node_is_ready(tmp_path):
    """A loading node is not ready yet: exit 3 until it is, then 0 (what `until lineside fleet status F; do sleep
    5; done` waits on); a fleet file that cannot be read stays exit 1."""
    from tests.cli.cli_run import run_cli

    routes = {"/health/ready": (503, J, json.dumps({"status": "loading"}))}
    with server(routes) as url:
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(f"nodes:\n  - {{name: n1, kind: x86, url: '{url}'}}\npools: {{realtime: {{members: [n1]}}}}\n")
        loading = run_cli("fleet", "status", fleet)
        routes["/health/ready"] = (200, J, json.dumps({"status": "ready"}))
        ready = run_cli("fleet", "status", fleet)
    assert loading.returncode == 3 and "n1: loading" in loading.stderr, loading.stderr
    assert ready.returncode == 0 and ready.stderr == "", ready.stderr
    assert run_cli("fleet", "status", tmp_path / "nope.yaml").returncode == 1
