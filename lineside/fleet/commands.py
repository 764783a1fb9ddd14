"""`lineside fleet ...`: plan, push, gateway, status over a fleet file (docs/fleet.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from lineside import cli_checks as checks

fleet = typer.Typer(help="A fleet of nodes behind one gateway: plan, rolling push, gateway (SMG), status.",
                    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

FLEET_ARG = typer.Argument(help="fleet file (YAML, see docs/fleet.md)")
SSH_HELP = "ssh command for user@host targets, e.g. 'ssh -p 2222 -i key' (env LINESIDE_SSH)"


def _ssh(ssh: str | None) -> str:
    return ssh or os.environ.get("LINESIDE_SSH", "ssh")


def _print(renderable: object) -> None:
    from rich.console import Console

    Console(width=max(120, Console().width)).print(renderable)


@fleet.command("check")
def check_cmd(fleet_file: Annotated[Path, FLEET_ARG]) -> None:
    """Validate the fleet file (schema, references, memory fit) and say so in one line."""
    from lineside.fleet.plan import plan_fleet
    from lineside.fleet.spec import load_fleet

    f = load_fleet(checks.input_file(fleet_file, "FLEET_FILE", "fleet file"))
    plans = plan_fleet(f)
    unbuilt = [p.node for p in plans if p.unbuilt_bundle]
    if unbuilt:
        print(f"note: the bundles of {', '.join(unbuilt)} are not built yet (planned from their model:); "
              "build them before `fleet push`", file=sys.stderr)
    print(f"{fleet_file}: {len(f.nodes)} nodes in {len(f.pools)} pools; valid, every model fits its node")


@fleet.command("plan")
def plan_cmd(
    fleet_file: Annotated[Path, FLEET_ARG],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Which model each node runs and whether it fits there (the memory planner per node)."""
    from lineside.fleet.plan import format_plans, plan_fleet, plan_notes
    from lineside.fleet.spec import load_fleet

    plans = plan_fleet(load_fleet(checks.input_file(fleet_file, "FLEET_FILE", "fleet file")))
    if as_json:
        print(json.dumps([p.to_dict() for p in plans], indent=2))
    else:
        _print(format_plans(plans))
        for line in plan_notes(plans):  # plain lines: a path in a note is not wrapped or read as markup
            print(line)


@fleet.command("push")
def push_cmd(
    fleet_file: Annotated[Path, FLEET_ARG],
    node: Annotated[list[str] | None, typer.Option(help="push only these nodes (repeat)")] = None,
    ssh: Annotated[str | None, typer.Option(help=SSH_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    force: Annotated[bool, typer.Option(help="push to a node even when its device's lineside cannot open the "
                                             "bundle (as `jetson push --force`; with --node, that node alone); its "
                                             "restart and health check still decide, and it is rolled back if "
                                             "unhealthy")] = False,
) -> None:
    """Rolling push: the canary first, then the rest in waves while each comes back healthy."""
    from lineside.errors import LinesideError
    from lineside.fleet.plan import plan_fleet, unbuilt_bundle
    from lineside.fleet.rollout import rolling_push
    from lineside.fleet.spec import load_fleet

    f = load_fleet(checks.input_file(fleet_file, "FLEET_FILE", "fleet file"))
    plan_fleet(f)
    missing = [f"{n.name} ({n.bundle})" for n in f.nodes if unbuilt_bundle(n) and (not node or n.name in node)]
    if missing:  # before the canary: a rollout must not stop half-way over a bundle that was never built
        raise LinesideError(f"nothing pushed: no bundle for {', '.join(missing)}; build it (`lineside build "
                            "CHECKPOINT -o BUNDLE`) or push only the other nodes (--node)")
    report = rolling_push(f, ssh=_ssh(ssh), only=node or None, force=force,
                          log=(lambda s: None) if as_json else (lambda s: print(s, file=sys.stderr)))
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        for r in report.nodes:
            ver = f" -> {r.version}" if r.version else ""
            print(f"{r.node}: {r.outcome}{ver}" + (f" ({r.error})" if r.error else "")
                  + (f" (warning: {r.warning})" if r.warning else ""))
    if not report.ok:
        raise LinesideError(f"rollout stopped: {report.stopped}")


@fleet.command("gateway")
def gateway_cmd(
    fleet_file: Annotated[Path, FLEET_ARG],
    output: Annotated[Path, typer.Option("--output", "-o", help="directory for gateway.json and logs")] = Path(
        "gateway"),
    dry_run: Annotated[bool, typer.Option(help="write the configuration, start nothing")] = False,
    log_level: Annotated[str, typer.Option(help="front log level")] = "warning",
) -> None:
    """Write the gateway configuration (one SMG router per pool + the header/session/shadow front), start it."""
    from lineside.fleet.gateway import gateway_plan, run_gateway, write_gateway
    from lineside.fleet.smg import missing_fleet_extra, smg_command
    from lineside.fleet.spec import FleetError, load_fleet

    missing = missing_fleet_extra()
    if missing and not dry_run:  # a dry run only writes the configuration: it runs none of them
        raise FleetError(f"{' and '.join(missing)} not installed (the gateway's routers and front); "
                         "`pip install 'lineside[fleet]'`, or --dry-run to only write the configuration")
    checks.target_dir(output, "--output")  # before anything is written or started
    f = load_fleet(checks.input_file(fleet_file, "FLEET_FILE", "fleet file"))
    plan = gateway_plan(f, base_cmd=["smg"] if "smg" in missing else smg_command())
    written = write_gateway(plan, output)
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if dry_run:
        if missing:
            print(f"note: {' and '.join(missing)} not installed here; the gateway needs them where it runs "
                  "(`pip install 'lineside[fleet]'`)", file=sys.stderr)
        return
    print(f"gateway on http://{plan.host}:{plan.port} (pools: " +
          ", ".join(f"{r.pool} -> {r.url}" for r in plan.routers) + ")", file=sys.stderr)
    run_gateway(plan, output / "logs", log_level=log_level)


@fleet.command("status")
def status_cmd(
    fleet_file: Annotated[Path, FLEET_ARG],
    ssh: Annotated[str | None, typer.Option(help=SSH_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LINESIDE_API_KEY", show_envvar=True,
        help="the nodes' key (`serve --api-key`), sent as 'Authorization: Bearer KEY' for their load and model")] = None,
) -> None:
    """Every node's health, bundle version, degradation level and load in one table; under it, why each node
    that is not ready is not (its engine's failure, a load error, unreachable). Exit status: 0 when every node is
    ready, 3 when any is not (loading, draining, failed, unreachable; the table or JSON is printed all the same,
    and a line on stderr names them), 1 when the fleet file cannot be read."""
    import sys

    from lineside.fleet.spec import load_fleet
    from lineside.fleet.status import check_ready, fleet_status, status_json, status_notes, status_table

    f = load_fleet(checks.input_file(fleet_file, "FLEET_FILE", "fleet file"))
    health = fleet_status(f, ssh=_ssh(ssh), api_key=api_key)
    if as_json:
        print(json.dumps(status_json(f, health), indent=2))
    else:
        _print(status_table(f, health))
        for line in status_notes(health):  # plain lines: a node's reason is its own text, not wrapped or markup
            print(line)
    locked = [h.node for h in health if h.unauthorized]
    if locked:
        print(f"note: {', '.join(locked)} answered 401 for their load and model: "
              + ("a wrong key (--api-key)" if api_key else "pass the nodes' key with --api-key (or LINESIDE_API_KEY)"),
              file=sys.stderr)
    sys.stdout.flush()  # the report comes before the exit's line, also where stdout and stderr share a file
    check_ready(health)


def register(app: typer.Typer) -> None:
    app.add_typer(fleet, name="fleet")
