"""The fleet file: what is accepted, and one clear line for each kind of mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lineside.fleet.plan import plan_fleet
from lineside.fleet.spec import FleetError, load_fleet, parse_fleet
from tests.cli.cli_run import assert_one_line_error, run_cli

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "fleet.example.yaml"

GOOD = {
    "version": 1,
    "nodes": [
        {"name": "orin-1", "kind": "jetson", "url": "http://10.0.0.11:8000", "model": "deepseek-r1-distill-qwen-7b",
         "device": "agx-orin-64"},
        {"name": "line-pc", "kind": "x86", "engine": "llama.cpp", "url": "http://10.0.0.20:8080",
         "health_path": "/v1/models"},
        {"name": "gpu", "kind": "datacenter", "engine": "vllm", "url": "http://10.0.1.5:8000",
         "model": "deepseek-v4-flash", "gpus": "8xH200"},
    ],
    "pools": {"realtime": {"members": ["orin-1"]}, "batch": {"members": ["gpu", "line-pc"]}},
}


def _parse(d: dict):
    return parse_fleet(yaml.safe_dump(d), Path("fleet.yaml"))


def _err(d: dict) -> str:
    with pytest.raises(FleetError) as e:
        plan_fleet(_parse(d))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _with(path: str, value):
    import copy

    d = copy.deepcopy(GOOD)
    cur = d
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur[int(k)] if k.isdigit() else cur[k]
    last = keys[-1]
    if value is KeyError:
        del cur[last]
    elif last.isdigit():
        cur[int(last)] = value
    else:
        cur[last] = value
    return d


def test_good_file_and_the_shipped_example_plan():
    plans = plan_fleet(_parse(GOOD))
    assert [(p.node, p.fits) for p in plans] == [("orin-1", True), ("line-pc", None), ("gpu", True)]
    assert plans[2].detail.startswith("FP8 e4m3") and "TP1 DP8 EP8 attention-DP" in plans[2].detail
    f = load_fleet(EXAMPLE)  # the example's bundles don't exist here: check structure, plan the model-only nodes
    assert [n.name for n in f.nodes] == ["orin-1", "orin-2", "line-pc", "gpu-server"]
    assert f.nodes[0].bundle == str((EXAMPLE.parent / "../bundles/r1-qwen-7b").resolve())
    assert f.gateway.shadow is not None and f.gateway.session.idle_s >= 60


def test_gateway_writes_the_body_priority_only_for_pools_with_vllm_or_sglang_members():
    from lineside.fleet.gateway import gateway_plan

    plan = gateway_plan(_parse(GOOD), base_cmd=["smg"])
    assert plan.front.body_priority_pools == frozenset({"batch"})  # gpu runs vLLM; realtime is lineside only
    assert plan.to_dict()["front"]["body_priority_pools"] == ["batch"]
    off = gateway_plan(_parse({**GOOD, "gateway": {"priority": False}}), base_cmd=["smg"])
    assert off.front.body_priority_pools == frozenset() and off.front.priority is False


@pytest.mark.parametrize(("change", "expected"), [
    (("nodes.0.bundel", "x"), "fleet.yaml: unknown key 'nodes[0].bundel'; the keys allowed there are: name, kind,"),
    (("gateway", {"prot": 9}), "fleet.yaml: unknown key 'gateway.prot'; the keys allowed there are: host, port,"),
    (("pools.batch.members", []), "fleet.yaml: pool 'batch' has no members; list node names under "
                                  "pools.batch.members or remove the pool"),
    (("nodes.1", dict(GOOD["nodes"][0], url="http://10.0.0.99:8000")),
     "fleet.yaml: node 'orin-1' is listed twice (nodes[0] and nodes[1]); give each node its own name"),
    (("pools.realtime.members", ["orin-1", "orin-1"]), "fleet.yaml: pool 'realtime' lists node 'orin-1' twice"),
    (("pools.realtime.members", ["orin-9"]), "fleet.yaml: pool 'realtime' lists 'orin-9', which is not a node"),
    (("nodes.0.model", "deepseek-v4-flash"), "node 'orin-1': deepseek-v4-flash needs 139.5 GiB"),
    (("nodes.0.kind", "jetsen"), "fleet.yaml: nodes[0].kind: Input should be 'jetson', 'x86' or 'datacenter'"),
    (("gateway", {"session": {"idle_s": 30}}), "fleet.yaml: gateway.session.idle_s: Input should be greater "
                                               "than or equal to 60"),
    (("nodes.0.url", KeyError), "fleet.yaml: nodes[0].url is required"),
    (("gateway", {"shadow": {"source": "realtime", "candidate": "nope", "share": 0.1}}),
     "fleet.yaml: gateway.shadow.candidate 'nope' is not a pool"),
    (("nodes.2.target", "/opt/x"), "a datacenter node runs its own engine and is never pushed to"),
    # appended to the url it made http://10.0.0.11:8000health: `fleet status` crashed (port '8000health'), a
    # url without a port probed another host (http://orin.localhealth)
    (("nodes.0.health_path", "health/ready"), "fleet.yaml: nodes[0].health_path: a path on the node's server "
                                              "starts with '/'; write /health/ready; got 'health/ready'"),
    # the front binds it first, then that router's SMG cannot (fleet check said the file was valid); the pools
    # are in the order yaml.safe_dump sorts them: batch is pool 0
    (("gateway", {"port": 30103, "smg_base_port": 30100}),
     "fleet.yaml: gateway.port 30103 is also the Prometheus port of the SMG router of pool 'realtime' "
     "(gateway.smg_base_port 30100 + 3); move gateway.port or gateway.smg_base_port"),
    (("gateway", {"port": 30104, "smg_base_port": 30100}),
     "fleet.yaml: gateway.port 30104 is also the health adapter port of node 'line-pc' (gateway.smg_base_port 30100 "
     "+ 4)"),
    (("nodes.0.health_path", "http://10.0.0.11:8000/health"), "nodes[0].health_path: a path on the node's server "
                                                              "starts with '/'"),
    # documented, but SMG probes each node's own health_path: the key did nothing
    (("gateway", {"health": {"path": "/health"}}), "fleet.yaml: gateway.health.path: the gateway probes "
                                                    "each node on its own health_path"),
])
def test_bad_files_are_one_line_each(change, expected):
    msg = _err(_with(*change))
    assert msg.startswith(expected) or expected in msg, msg


def test_model_that_fits_nowhere_names_the_numbers():
    d = _with("nodes.0.model", "deepseek-v4-flash")
    d["nodes"][2]["gpus"] = "8xH100"  # V4-Flash fits 8xH100 too: no GPU set of this fleet holds V4-Pro
    d["nodes"][0]["model"] = "deepseek-v4-pro"
    msg = _err(d)
    assert "agx-orin-64 has 60.0 GiB" in msg and "fits no node of this fleet" in msg
    assert "serve it from a datacenter node" in msg


def test_a_model_too_big_for_an_orin_names_the_fleets_datacenter_node():
    """V4-Flash on an Orin, with an 8xH200 datacenter node in the fleet: that node is where it fits (the line
    said "fits no node of this fleet" and sent the user to deploy one)."""
    assert _err(_with("nodes.0.model", "deepseek-v4-flash")).endswith("it would fit on gpu")


def test_a_datacenter_node_too_small_is_told_to_grow_not_to_use_a_datacenter_node():
    """V4-Pro on 8xH100: the line sent a datacenter node to `deploy datacenter`; it names the fleet's node that
    holds it, else more or larger GPUs."""
    d = _with("nodes.2.model", "deepseek-v4-pro")
    d["nodes"][2]["gpus"] = "8xH100"
    msg = _err(d)
    assert "8xH100" in msg and "more or larger GPUs" in msg and "serve it from a datacenter node" not in msg
    d["nodes"].append({"name": "gpu-2", "kind": "datacenter", "engine": "sglang", "url": "http://10.0.1.6:8000",
                       "model": "deepseek-v4-flash", "gpus": "8xH200"})
    d["pools"]["batch"]["members"].append("gpu-2")
    assert _err(d).endswith("it would fit on gpu-2")


@pytest.mark.parametrize(("model", "gpus", "grow_to"), [("deepseek-v4-flash", "2xH100", "4xH100"),
                                                     ("deepseek-v4-pro", "8xH100", "8xH200"),
                                                     ("deepseek-v4-flash", "3xH100", "4xH100")])
def test_a_datacenter_node_too_small_is_told_the_smallest_gpu_set_that_holds_its_model(model, gpus, grow_to):
    """The advice said "gpus: 8xH200 or 8xB200" whatever the model: V4-Flash on 2xH100
    and 3xH100 need 4xH100; it names the set `deploy datacenter` would (which does fit), and not the old guess."""
    from lineside.deploy.sizing import plan_datacenter

    d = _with("nodes.2.model", model)
    d["nodes"][2]["gpus"] = gpus
    msg = _err(d)
    assert msg.endswith(f"it fits no node of this fleet: give the node more or larger GPUs (gpus: {grow_to})"), msg
    assert plan_datacenter(model, grow_to).fits and not plan_datacenter(model, gpus).fits


def test_model_too_big_for_its_node_names_where_it_would_fit():
    d = _with("nodes.0.device", "orin-nano-4")
    d["nodes"].append({"name": "orin-2", "kind": "jetson", "url": "http://10.0.0.12:8000", "device": "agx-orin-64",
                       "model": "deepseek-r1-distill-qwen-1.5b"})
    d["pools"]["realtime"]["members"].append("orin-2")
    assert _err(d).endswith("it would fit on orin-2")


def test_cli_check_is_one_line(tmp_path):
    bad = tmp_path / "fleet.yaml"
    bad.write_text(yaml.safe_dump(_with("pools.batch.members", [])))
    p = run_cli("fleet", "check", bad)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "has no members" in p.stderr, p.stderr
    bad.write_text("nodes: [\n")
    p = run_cli("fleet", "check", bad)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "not valid YAML" in p.stderr
    bad.write_bytes(b"\xff\xfenodes: []\n")  # a UTF-16 editor's save, or not text at all
    p = run_cli("fleet", "check", bad)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "not UTF-8" in p.stderr, p.stderr
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(GOOD))
    p = run_cli("fleet", "check", good)
    assert p.returncode == 0 and "valid, every model fits its node" in p.stdout, p.stderr


def test_gateway_on_a_taken_port_is_one_line_and_starts_nothing(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        f = tmp_path / "fleet.yaml"
        f.write_text(yaml.safe_dump({"nodes": [{"name": "w", "kind": "x86", "url": "http://127.0.0.1:9"}],
                                     "pools": {"realtime": {"members": ["w"]}},
                                     "gateway": {"host": "127.0.0.1", "port": port}}))
        p = run_cli("fleet", "gateway", f, "-o", tmp_path / "gw")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in last and "Traceback" not in p.stderr, p.stderr
    assert not list((tmp_path / "gw" / "logs").glob("smg-*.log"))  # no router was started


def test_gateway_with_a_health_adapter_port_taken_is_one_line_and_starts_nothing(tmp_path):
    import socket

    from tests.fleet.conftest import free_ports

    base = free_ports(4)  # router + metrics of one pool, then the llama.cpp node's health adapter at base + 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        f = tmp_path / "fleet.yaml"
        f.write_text(yaml.safe_dump({
            "nodes": [{"name": "l", "kind": "x86", "engine": "llama.cpp", "url": "http://127.0.0.1:9",
                       "health_path": "/v1/models"}],
            "pools": {"realtime": {"members": ["l"]}},
            "gateway": {"host": "127.0.0.1", "port": base + 3, "smg_base_port": base}}))
        p = run_cli("fleet", "gateway", f, "-o", tmp_path / "gw")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and f"health adapter cannot listen on 127.0.0.1:{base + 2}" in last, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert not list((tmp_path / "gw" / "logs").glob("smg-*.log"))  # no router was started


def test_a_utf8_fleet_file_is_read_as_utf8_whatever_the_locale(tmp_path):
    """The fleet file is UTF-8 (the error says so): a non-ASCII name is read under an ASCII locale too (Python
    started without UTF-8 mode), not refused as 'not UTF-8'."""
    import subprocess
    import sys

    f = tmp_path / "fleet.yaml"
    f.write_text("name: café\n", encoding="utf-8")
    code = f"from lineside.fleet.spec import load_fleet\ntry:\n    load_fleet({str(f)!r})\nexcept Exception as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-X", "utf8=0", "-c", code], capture_output=True, text=True,
                         env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}, check=True).stdout
    assert "not UTF-8" not in out and "nodes is required" in out, out


def test_a_key_written_twice_is_refused_not_silently_overwritten():
    """YAML keeps the last of two equal keys; an operator who pasted a second `pools:` (or `url:`) would lose the
    first without a word."""
    text = yaml.safe_dump(GOOD) + "pools:\n  realtime: {members: [orin-1]}\n"
    with pytest.raises(FleetError) as e:
        parse_fleet(text, Path("fleet.yaml"))
    assert str(e.value).startswith("fleet.yaml: key 'pools' is written twice (lines "), e.value
    node = "nodes:\n  - {name: a, kind: x86, url: 'http://h:80', url: 'http://h:81'}\npools: {p: {members: [a]}}\n"
    with pytest.raises(FleetError, match="key 'url' is written twice"):
        parse_fleet(node, Path("fleet.yaml"))
    merged = "nodes:\n  - &n {name: a, kind: x86, url: 'http://h:80'}\n  - {<<: *n, name: b, url: 'http://h:81'}\n" \
             "pools: {p: {members: [a, b]}}\n"
    assert [n.url for n in parse_fleet(merged, Path("f.yaml")).nodes] == ["http://h:80", "http://h:81"]  # << overrides


@pytest.mark.parametrize(("url", "expected"), [
    ("10.0.0.11:8000", "has no scheme; write http://10.0.0.11:8000"),
    ("http://10.0.0.11:80000", "port 80000 is not 1-65535"),
    ("http://10.0.0.11:abc", "port 'abc' is not a number"),  # was accepted, then a traceback in `fleet status`
    ("http://10.0.0.11:8000/v1", "ends in /v1: give the server's root (http://10.0.0.11:8000)"),
    ("http://10.0.0.11:8000/?x=1", "has a query or fragment"),
    ("http://::1:8000", "an IPv6 address goes in brackets: http://[::1]:8000"),
    # accepted, then the pool's SMG router exited at start ("Invalid URL format: invalid IPv6 address")
    ("http://[fe80::1%eth0]:8000", "has an IPv6 zone (%eth0), which SMG (the gateway's router) cannot route to"),
])
def test_a_url_that_is_not_a_server_root_is_one_line(url, expected):
    msg = _err(_with("nodes.0.url", url))
    assert msg.startswith(f"fleet.yaml: nodes[0].url: {expected}") and msg.endswith(f"; got {url!r}"), msg


def test_ipv6_urls_and_urls_that_differ_only_in_spelling():
    d = _with("nodes.0.url", "http://[::1]:8000")
    assert _parse(d).nodes[0].url == "http://[::1]:8000"
    same = _with("nodes.1.url", "http://10.0.0.11")  # port 80 either way
    same["nodes"][0]["url"] = "HTTP://10.0.0.11:80/"
    assert "have the same url" in _err(same)


def test_a_pool_name_x_mode_cannot_reach_is_refused():
    """The front matches X-Mode lower-cased, so a pool named 'Batch' would answer every `X-Mode: Batch` with 400
    unknown_pool."""
    d = _with("pools", {"realtime": {"members": ["orin-1"]}, "Batch": {"members": ["gpu", "line-pc"]}})
    assert _err(d).startswith("fleet.yaml: pools: pool name 'Batch' has capitals; X-Mode is matched in lower case: "
                              "name it 'batch'")


def test_a_node_down_when_the_gateway_starts_is_retried_until_it_comes_back():
    """SMG gives up adding a worker it cannot reach within --worker-startup-timeout-secs, and never tries again
    (without service discovery): a Jetson rebooting while `fleet gateway` started got no traffic until the
    gateway was restarted. The routers keep trying, once per health interval."""
    from lineside.fleet.gateway import gateway_plan

    rt = gateway_plan(_parse({**GOOD, "gateway": {"health": {"interval_s": 7}}}), base_cmd=["smg"]).routers[0].argv
    assert int(rt[rt.index("--worker-startup-timeout-secs") + 1]) >= 10 * 365 * 86400
    assert rt[rt.index("--worker-startup-check-interval") + 1] == "7"


FAKE_ROUTER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
srv = HTTPServer(("127.0.0.1", port), H)
srv.handle_request()  # answers the gateway's first /health, then dies as a crashed or OOM-killed router would
print("fake router: out of memory", flush=True)
sys.exit(3)
"""


def test_a_router_that_dies_stops_the_gateway_with_one_line(tmp_path):
    """A pool's SMG router that exited left the gateway up, answering that pool's every request with 502
    'router unreachable' until someone restarted it by hand; now the gateway stops and says which router died,
    so its service manager restarts the whole of it."""
    import subprocess
    import sys

    from tests.fleet.conftest import REPO, free_ports

    base = free_ports(3)
    (tmp_path / "router.py").write_text(FAKE_ROUTER)
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump({"nodes": [{"name": "w", "kind": "x86", "url": "http://127.0.0.1:9"}],
                                 "pools": {"realtime": {"members": ["w"]}},
                                 "gateway": {"port": base + 2, "smg_base_port": base}}))
    code = ("import sys\nfrom lineside.fleet.gateway import gateway_plan, run_gateway\n"
            "from lineside.fleet.spec import FleetError, load_fleet\n"
            f"plan = gateway_plan(load_fleet({str(f)!r}), base_cmd=[sys.executable, {str(tmp_path / 'router.py')!r}])\n"
            f"try:\n    run_gateway(plan, __import__('pathlib').Path({str(tmp_path / 'logs')!r}))\n"
            "except FleetError as e:\n    print(e); sys.exit(1)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stdout.strip() == ("the SMG router of pool 'realtime' exited (3) while serving (its log ends: fake "
                                "router: out of memory); the gateway stopped (run it under a service manager that "
                                "restarts it)"), p


def test_a_gateway_port_beside_the_routers_is_fine_on_another_address():
    d = _with("gateway", {"host": "10.0.0.5", "port": 30101, "smg_base_port": 30100})  # the routers: 127.0.0.1
    assert _parse(d).gateway.port == 30101


@pytest.mark.parametrize(("text", "expected"), [
    # YAML 1.1 reads an unquoted on/yes/no as a boolean: pydantic put the key's value where an index goes
    ("pools: {on: {members: [a]}}", "fleet.yaml: pools key True is a boolean in YAML, not text"),
    ("pools: {realtime: {members: [no]}}", "fleet.yaml: pools.realtime.members[0] False is a boolean in YAML, not text"),
    ("pools: {realtime: {members: [1]}}", "fleet.yaml: pools.realtime.members[0] 1 is a number in YAML, not text"),
])
def test_a_name_yaml_reads_as_a_boolean_or_number_says_to_quote_it(text, expected):
    head = "nodes: [{name: a, kind: x86, engine: openai, url: 'http://127.0.0.1:9001'}]\n"
    with pytest.raises(FleetError) as e:
        parse_fleet(head + text + "\n", Path("fleet.yaml"))
    assert str(e.value).startswith(expected) and "put it in quotes" in str(e.value), str(e.value)


@pytest.mark.parametrize(("text", "expected"), [
    # YAML 1.1 reads yes/on unquoted as true, which pydantic took as the number 1: a batch of 1, silently
    ("nodes: [{name: a, kind: x86, engine: openai, url: 'http://127.0.0.1:9001', batch: yes}]",
     "fleet.yaml: nodes[0].batch: true is not a number (YAML reads yes/no/on/off unquoted as true/false); give a number"),
    ("nodes: [{name: a, kind: x86, engine: openai, url: 'http://127.0.0.1:9001'}]\ngateway: {retry: {max_retries: on}}",
     "fleet.yaml: gateway.retry.max_retries: true is not a number"),
    # .inf seconds: a rollout that waits for a dead canary forever
    ("nodes: [{name: a, kind: x86, engine: openai, url: 'http://127.0.0.1:9001'}]\nrollout: {health_timeout_s: .inf}",
     "fleet.yaml: rollout.health_timeout_s: Input should be a finite number"),
])
def test_a_boolean_or_infinity_where_a_number_goes_is_refused(text, expected):
    with pytest.raises(FleetError) as e:
        parse_fleet(text + "\npools: {realtime: {members: [a]}}\n", Path("fleet.yaml"))
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)


def test_yes_no_still_set_the_yes_no_keys():
    text = ("nodes: [{name: a, kind: x86, engine: openai, url: 'http://127.0.0.1:9001', health_adapter: yes}]\n"
            "pools: {realtime: {members: [a]}}\ngateway: {priority: off}\n")
    f = parse_fleet(text, Path("fleet.yaml"))
    assert (f.nodes[0].health_adapter, f.gateway.priority) == (True, False)


def test_plan_table_shows_names_and_paths_as_text():
    """`fleet plan` printed a bundle path or detail holding brackets as rich markup: "bundles/r1[q4]" lost "[q4]",
    and "[/]" would raise a MarkupError."""
    from rich.console import Console

    from lineside.fleet.plan import NodePlan, format_plans

    plan = NodePlan(node="orin-[1]", kind="jetson", pools=["rt"], runs="bundles/r1[q4]", where="agx-orin-64",
                    fits=True, detail="[/] odd")
    console = Console(record=True, width=200)
    console.print(format_plans([plan]))
    shown = console.export_text()
    assert "bundles/r1[q4]" in shown and "orin-[1]" in shown and "[/] odd" in shown


def test_the_shipped_example_checks_on_a_fresh_clone_and_push_refuses_its_unbuilt_bundles(tmp_path):
    # its own comment says to check it; its Jetsons' bundle is not built in a fresh clone
    assert not (EXAMPLE.parent / "../bundles/r1-qwen-7b").exists()
    p = run_cli("fleet", "check", EXAMPLE)
    assert p.returncode == 0 and "valid, every model fits its node" in p.stdout, p.stderr
    assert p.stderr.strip() == ("note: the bundles of orin-1, orin-2 are not built yet (planned from their model:); "
                                "build them before `fleet push`")
    p = run_cli("fleet", "push", EXAMPLE, "--ssh", "false")
    assert_one_line_error(p, "nothing pushed: no bundle for orin-1", "orin-2", "lineside build")
    assert "planned from model deepseek-r1-distill-qwen-7b" in plan_fleet(load_fleet(EXAMPLE))[1].notes[0]


def test_plan_shows_the_notes_under_its_table():
    """`fleet plan`'s table showed none of the plans' notes (--json has them): an unbuilt bundle planned from its
    model read as if the bundle were what was planned."""
    p = run_cli("fleet", "plan", EXAMPLE)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    bottom = max(i for i, line in enumerate(lines) if line.startswith("\u2514"))  # the table's last line
    notes = lines[bottom + 1:]
    want = [f"note: {n['node']}: {note}" for n in json.loads(run_cli("fleet", "plan", EXAMPLE, "--json").stdout)
            for note in n["notes"]]
    assert notes == want and len(want) >= 2, (notes, want)
    assert any(line.startswith("note: orin-1: bundle ") and "not built yet: planned from model "
               "deepseek-r1-distill-qwen-7b" in line for line in notes), notes


def test_an_unbuilt_bundle_without_a_model_is_one_line(tmp_path):
    d = _with("nodes.0.model", KeyError)
    d["nodes"][0].update(bundle="bundles/not-yet", target="lineside@10.0.0.11:/opt/lineside")
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(d))
    p = run_cli("fleet", "check", f)
    assert_one_line_error(p, f"node 'orin-1': its bundle {tmp_path / 'bundles/not-yet'} does not exist",
                          "lineside build", "model:", code=1)


# A child lineside that finds neither the fleet extra's modules (sys.modules[...] = None: not importable, and
# importlib.util.find_spec says None) nor an smg on PATH: a base `pip install lineside`, as setup.sh makes.
_WITHOUT_FLEET_EXTRA = ("import sys; sys.modules['aiohttp'] = sys.modules['smg'] = None; "
                        "from lineside.cli import main; main(sys.argv[1:])")


def test_gateway_dry_run_needs_no_fleet_extra_and_a_real_run_says_what_to_install(tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": "/usr/bin:/bin"}

    def gateway(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _WITHOUT_FLEET_EXTRA, "fleet", "gateway", str(EXAMPLE), *args],
                              capture_output=True, text=True, timeout=120, env=env)

    p = gateway("-o", str(tmp_path / "gw"), "--dry-run")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "note: smg and aiohttp not installed here" in p.stderr and "lineside[fleet]" in p.stderr
    cfg = json.loads((tmp_path / "gw" / "gateway.json").read_text())
    assert [r["argv"][:2] for r in cfg["routers"]] == [["smg", "launch"]] * 2, cfg["routers"]
    p = gateway("-o", str(tmp_path / "gw2"))
    assert_one_line_error(p, "smg and aiohttp not installed", "pip install 'lineside[fleet]'", "--dry-run", code=1)
    assert not (tmp_path / "gw2").exists()  # refused before anything was written
