"""The fleet file (YAML): nodes, the bundle or model each serves, pools, the gateway and the rollout.

The schema is pydantic models with unknown keys forbidden; every problem is reported as one line that
names the place in the file (``nodes[2].bundel``) and what to do. docs/fleet.md documents each key.
"""

from __future__ import annotations

import datetime
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from lineside.errors import LinesideError
from lineside.strenum import StrEnum
from lineside.yaml_keys import DuplicateKey, load_unique

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MIN_STICKY_S = 60  # seed report §5.2: a session stays on one node for at least a minute


class FleetError(LinesideError):
    """The fleet file is unreadable or invalid."""


class NodeKind(StrEnum):
    JETSON = "jetson"  # reached over ssh, serves a pushed bundle with `lineside serve`
    X86 = "x86"  # a line PC: same as a Jetson, or a foreign OpenAI-compatible server (no bundle)
    DATACENTER = "datacenter"  # an engine (vLLM/SGLang/TensorRT-LLM) by URL; never pushed to


class Engine(StrEnum):
    LINESIDE = "lineside"
    LLAMA_CPP = "llama.cpp"
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"
    OPENAI = "openai"  # any other OpenAI-compatible server


class SmgPolicy(StrEnum):
    """SMG's load-balancing policies for plain HTTP workers (`smg launch --policy`)."""

    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    CACHE_AWARE = "cache_aware"
    POWER_OF_TWO = "power_of_two"
    LEAST_LOAD = "least_load"
    CONSISTENT_HASHING = "consistent_hashing"
    PREFIX_HASH = "prefix_hash"
    MANUAL = "manual"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML reads yes/on/true unquoted as a boolean, which pydantic took as the number 1 (batch: yes → 1)
        if isinstance(value, bool) and _unwrap(cls.model_fields[str(info.field_name)].annotation) in (int, float):
            raise ValueError(f"{str(value).lower()} is not a number (YAML reads yes/no/on/off unquoted as true/"
                             "false); give a number")
        return value


class Node(_Strict):
    """One serving node."""

    name: Annotated[str, Field(pattern=NAME_RE)]
    kind: NodeKind
    url: str  # its OpenAI-compatible server's root (scheme, host, port; no /v1)
    engine: Engine = Engine.LINESIDE
    target: str | None = None  # push target: user@host:/opt/lineside or a local/mounted directory
    bundle: str | None = None  # the bundle directory (on this machine) the node serves
    model: str | None = None  # for planning when there is no bundle: a name `lineside jetson plan` takes
    device: str | None = None  # planner device key (agx-orin-64, ...); required with bundle/model off-datacenter
    gpus: str | None = None  # datacenter nodes: 8xH200, 8xB200, ...
    quant: str | None = None
    ctx: Annotated[int | None, Field(ge=1)] = None  # None: 4096, or all of a shorter bundle's max_seq_len
    batch: Annotated[int, Field(ge=1)] = 1
    kv_dtype: str | None = None  # planning: None is the bundle's own cache dtype, else fp16
    restart: str | None = None  # run on the node after a switch (over ssh for ssh targets), e.g. systemctl restart
    health_path: str = "/health/ready"
    # SMG registers a worker only once GET /health answers; for a server without it (llama-cpp-python) the
    # gateway puts lineside.fleet.adapter in front. Default: on for engine llama.cpp.
    health_adapter: bool | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        url_key(v)
        return v

    @field_validator("health_path")
    @classmethod
    def _health_path(cls, v: str) -> str:
        # it is appended to the url: "health" would probe http://host:8000health (or the host orin.localhealth)
        if not v.startswith("/"):
            path = urlsplit(v).path if "://" in v else "/" + v
            raise ValueError(f"a path on the node's server starts with '/'; write {path or '/health/ready'}")
        return v

    @property
    def needs_adapter(self) -> bool:
        return self.health_adapter if self.health_adapter is not None else self.engine == Engine.LLAMA_CPP


class Pool(_Strict):
    members: list[str]
    policy: SmgPolicy | None = None  # default: gateway.policy


class Session(_Strict):
    idle_s: Annotated[int, Field(ge=MIN_STICKY_S)] = 300  # SMG --sticky-key-idle-secs
    cookie: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = "lineside_session"
    header: str = "x-session-id"


class Breaker(_Strict):
    failure_threshold: Annotated[int, Field(ge=1)] = 5
    success_threshold: Annotated[int, Field(ge=1)] = 2
    timeout_s: Annotated[int, Field(ge=1)] = 30
    window_s: Annotated[int, Field(ge=1)] = 60


class Retry(_Strict):
    max_retries: Annotated[int, Field(ge=1)] = 3
    initial_backoff_ms: Annotated[int, Field(ge=0)] = 50
    max_backoff_ms: Annotated[int, Field(ge=0)] = 2000


class Health(_Strict):
    interval_s: Annotated[int, Field(ge=1)] = 5
    timeout_s: Annotated[int, Field(ge=1)] = 3
    failure_threshold: Annotated[int, Field(ge=1)] = 2
    success_threshold: Annotated[int, Field(ge=1)] = 1
    # SMG probes each pool's nodes on their own health_path; a gateway-wide path did nothing (and was documented)
    path: str | None = None

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("the gateway probes each node on its own health_path; set nodes[].health_path instead "
                             "and remove gateway.health.path")
        return v


class Shadow(_Strict):
    source: str  # the pool whose traffic is mirrored
    candidate: str  # the pool that gets the copies (responses discarded)
    share: Annotated[float, Field(gt=0.0, le=1.0)]


class Gateway(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8080
    default_pool: str | None = None  # pool for requests with no X-Mode (default: the first pool)
    policy: SmgPolicy = SmgPolicy.CACHE_AWARE
    smg_base_port: Annotated[int, Field(ge=1, le=65000)] = 30100  # pool i: base+2i (router), base+2i+1 (metrics)
    session: Session = Session()
    breaker: Breaker = Breaker()
    retry: Retry = Retry()
    health: Health = Health()
    shadow: Shadow | None = None
    request_timeout_s: Annotated[int, Field(ge=1)] = 600
    # X-Priority high|normal|low → SMG's admission classes (X-SMG-Priority interactive|default|bulk,
    # --priority-scheduler-enabled), and to the nodes' schedulers in tracestate / the body's `priority`
    # (SMG forwards no X-Priority header); false: neither (the pool's mode still reaches the nodes).
    priority: bool = True


class Rollout(_Strict):
    canary: str | None = None  # default: the first node that serves a bundle
    parallel: Annotated[int, Field(ge=1)] = 4  # nodes pushed at once after the canary
    health_timeout_s: Annotated[float, Field(gt=0)] = 120.0


class FleetFile(_Strict):
    version: typing.Literal[1] = 1
    nodes: Annotated[list[Node], Field(min_length=1)]
    pools: Annotated[dict[str, Pool], Field(min_length=1)]
    gateway: Gateway = Gateway()
    rollout: Rollout = Rollout()

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, v: dict[str, Pool]) -> dict[str, Pool]:
        for name in v:
            if not re.match(NAME_RE, name):
                raise ValueError(f"pool name {name!r} must be letters, digits, '.', '_' or '-'")
            if name != name.lower():  # the front lower-cases X-Mode before it looks the pool up
                raise ValueError(f"pool name {name!r} has capitals; X-Mode is matched in lower case: "
                                 f"name it {name.lower()!r}")
        return v


_NETLOC = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.%\w-]+)\]|(?P<host>[^:\[\]/@\s]+))(?::(?P<port>[^:]*))?$")


def url_key(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of a node's url, for telling two spellings of one server apart; ValueError
    (a message saying what to write) for what is not the root of an HTTP server."""
    if "://" not in url:
        raise ValueError(f"has no scheme; write http://{url.strip()}")
    u = urlsplit(url.strip())
    scheme = u.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"scheme {u.scheme!r} is not http or https")
    if "@" in u.netloc:
        raise ValueError("carries credentials; give scheme://host:port (a node's API key: fleet status --api-key)")
    if u.query or u.fragment:
        raise ValueError("has a query or fragment; give scheme://host:port")
    m = _NETLOC.match(u.netloc)
    if m is None:
        if u.netloc.count(":") > 1 and "[" not in u.netloc:
            raise ValueError("an IPv6 address goes in brackets: http://[::1]:8000")
        raise ValueError("has no host; give scheme://host:port")
    if m["v6"] and "%" in m["v6"]:  # SMG parses worker urls with Rust's url crate: no zone ids (RFC 6874)
        zone = m["v6"][m["v6"].index("%"):]
        raise ValueError(f"has an IPv6 zone ({zone}), which SMG (the gateway's router) cannot route to; give the "
                         "node's global or unique-local address, or its host name")
    port_s = m["port"]
    if port_s is None or port_s == "":
        port = 443 if scheme == "https" else 80
    elif not port_s.isdigit():
        raise ValueError(f"port {port_s!r} is not a number")
    elif not 1 <= int(port_s) <= 65535:
        raise ValueError(f"port {port_s} is not 1-65535")
    else:
        port = int(port_s)
    path = u.path.rstrip("/")
    if path.lower().endswith("/v1"):  # an OpenAI client's base_url; SMG and the probes add /v1/... themselves
        root = f"{u.scheme}://{u.netloc}{path[:-3]}"
        raise ValueError(f"ends in /v1: give the server's root ({root})")
    return scheme, (m["v6"] or m["host"]).lower(), port, path


# ---------------------------------------------------------------------------------------------------------------


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that the path ``loc`` (minus its last element) points into."""
    tp: Any = FleetFile
    for part in loc[:-1]:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            f = tp.model_fields.get(str(part))
            if f is None:
                return None
            tp = f.annotation
        elif typing.get_origin(tp) in (list, dict):
            tp = typing.get_args(tp)[-1]
        else:
            return None
    tp = _unwrap(tp)
    if typing.get_origin(tp) in (list, dict):
        tp = _unwrap(typing.get_args(tp)[-1])
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if len(args) == 1 else tp
            if len(args) != 1:
                return tp
        else:
            return tp


def _one_line(path: Path, e: ValidationError) -> str:
    err = e.errors()[0]
    loc = tuple(err["loc"])
    where = _loc(loc)
    if err["type"] == "extra_forbidden":
        model = _model_at(loc)
        known = ", ".join(model.model_fields) if model else ""
        return f"{path}: unknown key {where!r}" + (f"; the keys allowed there are: {known}" if known else "")
    if err["type"] == "missing":
        return f"{path}: {where} is required; add it (see docs/fleet.md)"
    got = err.get("input")
    if err["type"] == "string_type" and isinstance(got, (bool, int, float, datetime.date)):
        # YAML reads an unquoted on/off/yes/no as a boolean, 1 or 1.5 as a number, 2024-01-01 as a date
        if loc[-1:] == ("[key]",):  # pydantic puts the key itself (True as 1) where an index would go
            where = f"{_loc(loc[:-2])} key"
        kind = "boolean" if isinstance(got, bool) else "date" if isinstance(got, datetime.date) else "number"
        shown = got.isoformat() if isinstance(got, datetime.date) else repr(got)
        return f"{path}: {where} {shown} is a {kind} in YAML, not text; put it in quotes"
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {len(e.errors()) - 1} more problem(s))" if len(e.errors()) > 1 else ""
    return f"{path}: {where}: {msg}; got {err.get('input')!r}{more}"


def parse_fleet(text: str, path: Path) -> FleetFile:
    """YAML text → validated FleetFile (structure and cross-references, not memory fit)."""
    try:
        raw = load_unique(text)
    except DuplicateKey as e:
        raise FleetError(f"{path}: key {e.key!r} is written twice (lines {e.first} and {e.second}); YAML keeps only "
                         "the last: remove one or merge them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise FleetError(f"{path}: not valid YAML{at} ({getattr(e, 'problem', None) or e}); fix the syntax") from None
    if not isinstance(raw, dict):
        raise FleetError(f"{path}: the fleet file must be a mapping with 'nodes' and 'pools' (see docs/fleet.md)")
    try:
        fleet = FleetFile.model_validate(raw)
    except ValidationError as e:
        raise FleetError(_one_line(path, e)) from None
    check_references(fleet, path)
    return fleet


def check_references(fleet: FleetFile, path: Path) -> None:
    """Names are unique, every pool has members that exist, the gateway and rollout name real pools/nodes."""
    seen: dict[str, int] = {}
    for i, n in enumerate(fleet.nodes):
        if n.name in seen:
            raise FleetError(f"{path}: node {n.name!r} is listed twice (nodes[{seen[n.name]}] and nodes[{i}]); "
                             "give each node its own name")
        seen[n.name] = i
    urls: dict[tuple[str, str, int, str], str] = {}
    for n in fleet.nodes:
        u = url_key(n.url)  # http://h and HTTP://h:80/ are one server
        if u in urls:
            raise FleetError(f"{path}: nodes {urls[u]!r} and {n.name!r} have the same url {n.url}; one server is one node")
        urls[u] = n.name
    for pname, pool in fleet.pools.items():
        if not pool.members:
            raise FleetError(f"{path}: pool {pname!r} has no members; list node names under pools.{pname}.members "
                             "or remove the pool")
        dup = {m for m in pool.members if pool.members.count(m) > 1}
        if dup:
            raise FleetError(f"{path}: pool {pname!r} lists node {sorted(dup)[0]!r} twice; list each node once")
        for m in pool.members:
            if m not in seen:
                raise FleetError(f"{path}: pool {pname!r} lists {m!r}, which is not a node; nodes are: "
                                 f"{', '.join(seen)}")
    for n in fleet.nodes:
        _check_node(n, path)
    g = fleet.gateway
    if g.default_pool is not None and g.default_pool not in fleet.pools:
        raise FleetError(f"{path}: gateway.default_pool {g.default_pool!r} is not a pool ({', '.join(fleet.pools)})")
    if g.shadow is not None:
        for key in ("source", "candidate"):
            p = getattr(g.shadow, key)
            if p not in fleet.pools:
                raise FleetError(f"{path}: gateway.shadow.{key} {p!r} is not a pool ({', '.join(fleet.pools)})")
        if g.shadow.source == g.shadow.candidate:
            raise FleetError(f"{path}: gateway.shadow mirrors pool {g.shadow.source!r} onto itself; "
                             "name a different candidate pool")
    uses = gateway_ports(fleet)
    on_loopback = g.host in ("", "0.0.0.0", "::", "localhost", "::1") or g.host.startswith("127.")  # noqa: S104
    if g.port in uses and on_loopback:  # the routers listen on 127.0.0.1
        raise FleetError(f"{path}: gateway.port {g.port} is also {uses[g.port]} (gateway.smg_base_port "
                         f"{g.smg_base_port} + {g.port - g.smg_base_port}); move gateway.port or gateway.smg_base_port")
    if max(uses) > 65535:
        raise FleetError(f"{path}: gateway.smg_base_port {g.smg_base_port} leaves no room for the gateway's "
                         f"{len(uses)} ports (up to {max(uses)}); lower it")
    if fleet.rollout.canary is not None and fleet.rollout.canary not in seen:
        raise FleetError(f"{path}: rollout.canary {fleet.rollout.canary!r} is not a node ({', '.join(seen)})")
    if fleet.rollout.canary is not None and fleet.nodes[seen[fleet.rollout.canary]].bundle is None:
        raise FleetError(f"{path}: rollout.canary {fleet.rollout.canary!r} serves no bundle; pick a node with one")


def gateway_ports(fleet: FleetFile) -> dict[int, str]:
    """The loopback ports `fleet gateway` takes from smg_base_port, and what each is: pool i's SMG router on
    base + 2i, its Prometheus metrics on base + 2i + 1, then one health adapter per node that needs one."""
    base = fleet.gateway.smg_base_port
    out: dict[int, str] = {}
    for i, pname in enumerate(fleet.pools):
        out[base + 2 * i] = f"the port of the SMG router of pool {pname!r}"
        out[base + 2 * i + 1] = f"the Prometheus port of the SMG router of pool {pname!r}"
    adapted = [n.name for n in fleet.nodes if n.needs_adapter]
    for j, name in enumerate(adapted):
        out[base + 2 * len(fleet.pools) + j] = f"the health adapter port of node {name!r}"
    return out


def _check_node(n: Node, path: Path) -> None:
    where = f"{path}: node {n.name!r}"
    if n.kind == NodeKind.DATACENTER:
        if n.bundle or n.target:
            raise FleetError(f"{where}: a datacenter node runs its own engine and is never pushed to; "
                             "remove bundle/target (deploy it with `lineside deploy datacenter`)")
        if n.engine in (Engine.LINESIDE, Engine.LLAMA_CPP):
            raise FleetError(f"{where}: engine {n.engine} is not a datacenter engine; use vllm, sglang or trtllm")
        if n.model and not n.gpus:
            raise FleetError(f"{where}: gpus is required with model on a datacenter node (e.g. gpus: 8xH200)")
        return
    if n.gpus:
        raise FleetError(f"{where}: gpus is for datacenter nodes; use device for a {n.kind} node")
    if n.bundle and not n.target:
        raise FleetError(f"{where}: bundle needs target (user@host:/opt/lineside or a directory) to push it to")
    if n.bundle and n.engine != Engine.LINESIDE:
        raise FleetError(f"{where}: only lineside nodes serve a pushed bundle (engine is {n.engine})")
    if (n.bundle or n.model) and not n.device:
        raise FleetError(f"{where}: device is required to plan its model (e.g. device: agx-orin-64)")


def load_fleet(path: str | Path) -> FleetFile:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")  # not the locale's: the error below says UTF-8
    except OSError as e:
        raise FleetError(f"{p}: cannot read the fleet file ({e.strerror or e}); pass the path of a fleet YAML") from None
    except UnicodeDecodeError as e:
        raise FleetError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); save the fleet file as UTF-8") from None
    return resolve_paths(parse_fleet(text, p), p.parent)


def resolve_paths(fleet: FleetFile, base: Path) -> FleetFile:
    """Bundle paths relative to the fleet file's directory become absolute (targets that are local dirs too)."""
    nodes = []
    for n in fleet.nodes:
        upd: dict[str, Any] = {}
        if n.bundle and not Path(n.bundle).is_absolute():
            upd["bundle"] = str((base / n.bundle).resolve())
        if n.target and ":" not in n.target and not Path(n.target).is_absolute():
            upd["target"] = str((base / n.target).resolve())
        nodes.append(n.model_copy(update=upd))
    return fleet.model_copy(update={"nodes": nodes})


def pool_of(fleet: FleetFile) -> dict[str, list[str]]:
    """node name → the pools it is in."""
    out: dict[str, list[str]] = {n.name: [] for n in fleet.nodes}
    for pname, pool in fleet.pools.items():
        for m in pool.members:
            out[m].append(pname)
    return out


def node(fleet: FleetFile, name: str) -> Node:
    for n in fleet.nodes:
        if n.name == name:
            return n
    raise FleetError(f"no node named {name!r} in the fleet ({', '.join(x.name for x in fleet.nodes)})")
