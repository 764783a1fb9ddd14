"""`fleet plan`: what each node will run and whether it fits there (the memory planner per node)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lineside.errors import LinesideError
from lineside.fleet.spec import FleetError, FleetFile, Node, NodeKind, pool_of

GIB = 1 << 30


@dataclass
class NodePlan:
    node: str
    kind: str
    pools: list[str]
    runs: str  # the bundle, the model, or "its own model"
    where: str  # device or GPU set
    fits: bool | None  # None: not planned (a foreign server with no model named)
    needs_bytes: int | None = None
    has_bytes: int | None = None
    max_context: int | None = None
    detail: str = ""
    notes: list[str] = field(default_factory=list)
    unbuilt_bundle: str | None = None  # the bundle it names, not built yet (planned from its model meanwhile)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_node(n: Node, pools: list[str]) -> NodePlan:
    """Plan one node: the planner for edge devices, the datacenter math for GPU servers."""
    if n.kind == NodeKind.DATACENTER:
        if not n.model:
            return NodePlan(n.name, n.kind, pools, f"its own model ({n.engine})", n.gpus or "?", None,
                            detail="no model named: not planned")
        from lineside.deploy.sizing import plan_datacenter

        p = plan_datacenter(n.model, n.gpus or "")
        layout = f"TP{p.tp}" + (f" PP{p.pp}" if p.pp > 1 else "") + f" DP{p.dp} EP{p.ep}" + (" attention-DP" if p.attention_dp else "")
        return NodePlan(n.name, n.kind, pools, n.model, p.gpus, p.fits, p.weights_per_gpu_bytes,
                        int(p.gpu_memory_bytes * p.gpu_memory_utilization), p.max_model_len,
                        detail=f"{p.weight_format}; {layout}; {p.seqs_at_max_len} seqs at {p.max_model_len} tokens",
                        notes=p.notes)
    source = n.bundle or n.model
    unbuilt = unbuilt_bundle(n)
    if unbuilt and not n.model:
        raise LinesideError(f"its bundle {unbuilt} does not exist; build it (`lineside build CHECKPOINT -o "
                            f"{unbuilt}`) or add a `model:` to plan the node from until it is built")
    if unbuilt:  # planned from the model the bundle will hold; `fleet push` still needs the bundle
        source = n.model
    if not source:
        return NodePlan(n.name, n.kind, pools, f"its own model ({n.engine})", n.device or "-", None,
                        detail="foreign server, no model named: not planned")
    from lineside.jetson.planner import plan

    p = plan(source, n.device or "", n.quant, n.ctx, n.batch, n.kv_dtype)
    notes = ([f"bundle {unbuilt} not built yet: planned from model {n.model}"] if unbuilt else []) + p.notes
    return NodePlan(n.name, n.kind, pools, source, p.device, p.fits, p.total_bytes, p.device_bytes,
                    p.max_context_at_batch, detail=f"{p.quant}, ctx {p.ctx} x batch {p.batch}, kv {p.kv_dtype}",
                    notes=notes, unbuilt_bundle=unbuilt)


def unbuilt_bundle(n: Node) -> str | None:
    """The node's bundle path when it names one that is not on this machine yet (a fleet file is often written
    before its bundles are built), else None."""
    if n.bundle is None or Path(n.bundle).exists():
        return None
    return n.bundle


def plan_fleet(fleet: FleetFile, *, strict: bool = True) -> list[NodePlan]:
    """Every node's plan; with ``strict`` a model that fits its node raises one line naming where it would fit."""
    pools = pool_of(fleet)
    plans = []
    for n in fleet.nodes:
        try:
            plans.append(plan_node(n, pools[n.name]))
        except LinesideError as e:
            raise FleetError(f"node {n.name!r}: {e}") from None
        except (TypeError, KeyError, ValueError) as e:  # a config the planner cannot read
            raise FleetError(f"node {n.name!r}: cannot plan {n.bundle or n.model}: its config is incomplete or "
                             f"invalid ({type(e).__name__}: {str(e)[:120]}); rebuild the bundle") from None
    if strict:
        for p in plans:
            if p.fits is False:
                raise FleetError(_nowhere(fleet, p))
    return plans


def _fits_on(n: Node, src: Node, model: str) -> bool:
    """Whether ``model`` (the source node's) fits node ``n``: the datacenter math on a GPU set, else the planner."""
    if n.kind == NodeKind.DATACENTER:
        if not n.gpus:
            return False
        from lineside.deploy.sizing import plan_datacenter

        return plan_datacenter(model, n.gpus).fits
    if not n.device:
        return False
    from lineside.jetson.planner import plan

    return plan(model, n.device, src.quant, src.ctx, src.batch, src.kv_dtype).fits


def _nowhere(fleet: FleetFile, bad: NodePlan) -> str:
    """One line for a node whose model does not fit: the numbers, and the fleet's nodes where it would (a
    datacenter node's GPU set included: V4 on an Orin belongs there)."""
    src = next(x for x in fleet.nodes if x.name == bad.node)
    dc = src.kind == NodeKind.DATACENTER
    fits: dict[bool, list[str]] = {True: [], False: []}  # datacenter node? -> nodes where it fits
    for n in fleet.nodes:
        if n.name == bad.node:
            continue
        try:
            if _fits_on(n, src, bad.runs):
                fits[n.kind == NodeKind.DATACENTER].append(n.name)
        except LinesideError:
            continue
    elsewhere = fits[dc] or fits[not dc]  # nodes of its own kind first: an edge model stays on the edge
    need = f"{bad.needs_bytes / GIB:.1f} GiB" if bad.needs_bytes else "?"
    has = f"{bad.has_bytes / GIB:.1f} GiB" if bad.has_bytes else "?"
    if elsewhere:
        where = f"it would fit on {', '.join(elsewhere)}"
    elif src.kind == NodeKind.DATACENTER:  # it is on a datacenter node already: more or larger GPUs
        where = "it fits no node of this fleet: " + _grow(src, bad.runs)
    else:
        where = ("it fits no node of this fleet: serve it from a datacenter node (`lineside deploy datacenter`) "
                 "or pick a smaller model")
    return f"node {bad.node!r}: {bad.runs} needs {need} ({bad.detail}) but {bad.where} has {has}; {where}"


def _grow(node: Node, model: str) -> str:
    """Advice for a datacenter node too small for its model: the smallest GPU set that holds it (as
    `deploy datacenter` names one), or that none of one node does."""
    from lineside.deploy.engines import smallest_fit
    from lineside.deploy.parallel import MAX_GPUS
    from lineside.deploy.sizing import parse_gpus

    fit = smallest_fit(model, parse_gpus(node.gpus or ""))
    if fit is None:
        return f"no node of up to {MAX_GPUS} GPUs of a kind lineside knows holds it: pick a smaller model"
    return f"give the node more or larger GPUs (gpus: {fit.label})"


def format_plans(plans: list[NodePlan]) -> Any:
    """A rich table of the plans."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title="fleet plan")
    for col in ("node", "kind", "pools", "runs", "on", "fits", "needs / has", "max ctx", "detail"):
        t.add_column(col)
    for p in plans:
        fits = "-" if p.fits is None else ("yes" if p.fits else "NO")
        nh = (f"{p.needs_bytes / GIB:.1f} / {p.has_bytes / GIB:.1f} GiB" if p.needs_bytes is not None
              and p.has_bytes is not None else "-")
        # names, paths and details are the fleet file's text, not rich markup ("bundles/r1[q4]" lost its "[q4]")
        t.add_row(*(Text(c) for c in (p.node, str(p.kind), ",".join(p.pools), p.runs, p.where, fits, nh,
                                      str(p.max_context or "-"), p.detail)))
    return t


def plan_notes(plans: list[NodePlan]) -> list[str]:
    """The plans' notes (an unbuilt bundle planned from its model, the planner's caveats) as lines for under the
    table, each naming its node (``--json`` carries them in each plan's ``notes``)."""
    return [f"note: {p.node}: {n}" for p in plans for n in p.notes]
