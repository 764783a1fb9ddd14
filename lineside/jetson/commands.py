"""`lineside jetson ...`: probe, plan, table, push, rollback, power, service."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from lineside import cli_checks as checks
from lineside.jetson.devices import TABLE_DEVICES

jetson = typer.Typer(help="Jetson deployment: probe, memory plan, push/rollback, power modes, systemd unit.",
                     no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

SSH_HELP = "ssh command for user@host targets, e.g. 'ssh -p 2222 -i key' (env LINESIDE_SSH)"


def _is_remote(target: str) -> bool:
    """user@host:/dir (an ssh target), as jetson.targets.open_target tells them apart."""
    from lineside.jetson.targets import LocalTarget, open_target

    return not isinstance(open_target(target, "ssh"), LocalTarget)  # no connection is made (nor closed)


def _ssh(ssh: str | None) -> str:
    return ssh or os.environ.get("LINESIDE_SSH", "ssh")


@jetson.command("probe")
def probe_cmd(
    sysroot: Annotated[Path, typer.Option(help="read the device files under this directory")] = Path("/"),
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Board, L4T/JetPack, memory, GPU load, power mode and TensorRT version of this device."""
    from lineside.jetson.probe import format_probe, probe

    checks.input_dir(sysroot, "--sysroot")
    r = probe(sysroot)
    print(json.dumps(r.to_dict(), indent=2) if as_json else format_probe(r))


@jetson.command("plan")
def plan_cmd(
    model: Annotated[str, typer.Argument(help="checkpoint dir, bundle dir, config.json, or a shipped config name")],
    device: Annotated[str, typer.Option(help="agx-orin-64 | agx-orin-32 | orin-nx-16 | orin-nano-8 | h100-80 ...")],
    quant: Annotated[str | None, typer.Option(help="w4a16 | w8a16 | fp16 | fp32 (default: the bundle's, else w4a16)")] = None,
    ctx: Annotated[int | None, checks.number_option(
        low=1, help="context length per sequence, prompt + output (default: 4096, or a shorter bundle's own)")] = None,
    batch: Annotated[int, checks.number_option(low=1, high=1 << 20, help="sequences decoded together")] = 1,
    kv_dtype: Annotated[str | None, typer.Option(help="fp16 | int8 | int4 | fp8 (default: the bundle's, else fp16)")]
    = None,
    group_size: Annotated[int | None, checks.number_option(
        low=16, help="quantization group size, weights per fp16 scale, a power of two (default: a bundle's own grid, else 128)")] = None,
    prefill_chunk: Annotated[int | None, checks.number_option(
        low=1, help="prompt tokens processed per step (default: the largest of 512/256/128/64 that fits)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    fallback: Annotated[str | None, typer.Option(help="a fallback bundle served beside it (`serve --fallback`): "
                                                      "plan both together")] = None,
) -> None:
    """Memory for weights, KV cache, activations and runtime vs the device; largest context that fits."""
    from lineside.jetson.planner import format_plan, format_plan_with_fallback, plan, plan_with_fallback

    p = plan(model, device, quant, ctx, batch, kv_dtype, group_size, prefill_chunk)
    if fallback is not None:
        f = plan(fallback, device, None, ctx, batch, kv_dtype, group_size, prefill_chunk)
        pair = plan_with_fallback(p, f)
        print(json.dumps(pair, indent=2) if as_json else format_plan_with_fallback(pair, p, f))
        return
    print(json.dumps(p.to_dict(), indent=2) if as_json else format_plan(p))


@jetson.command("table")
def table_cmd(
    quant: Annotated[str, typer.Option(help="w4a16 | w8a16 | fp16")] = "w4a16",
    ctx: Annotated[int, checks.number_option(low=1, help="context length")] = 4096,
    batch: Annotated[int, checks.number_option(low=1, high=1 << 20, help="batch")] = 1,
    kv_dtype: Annotated[str, typer.Option(help="fp16 | int8 | int4 | fp8")] = "fp16",
    devices: Annotated[str, typer.Option(help="comma list of devices")] = ",".join(TABLE_DEVICES),
    kv_columns: Annotated[str, typer.Option(help="extra columns DEVICE:KV_DTYPE, comma list "
                                                 "(e.g. orin-nano-8:int8)")] = "",
) -> None:
    """Markdown table of what fits where, for the configs shipped with lineside."""
    from lineside.jetson.planner import fit_table, parse_columns

    print(fit_table([d.strip() for d in devices.split(",") if d.strip()], quant, ctx, batch, kv_dtype,
                    parse_columns(kv_columns)))


@jetson.command("push")
def push_cmd(
    bundle: Annotated[Path, typer.Argument(help="bundle directory (with manifest.json)")],
    target: Annotated[str, typer.Argument(help="user@host:/dir or a local/mounted directory")],
    ssh: Annotated[str | None, typer.Option(help=SSH_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    force: Annotated[bool, typer.Option(help="push even when the device's lineside (the one lineside.service runs) "
                                             "is missing, too old for the bundle, or on an unsupported Python")]
    = False,
) -> None:
    """Copy a bundle to TARGET/versions/ (resumable), verify every sha256 there, switch TARGET/current.

    Over ssh it first asks the device's lineside whether it can open the bundle and refuses before copying if not."""
    from lineside.jetson.push import push
    from lineside.jetson.restart_hint import restart_note

    checks.input_dir(bundle, "BUNDLE", "bundle directory")
    if not _is_remote(target):
        checks.target_dir(Path(target), "TARGET")

    r = push(bundle, target, _ssh(ssh), force=force)
    if r.device_warning:
        print(f"warning: pushed anyway (--force): {r.device_warning}", file=sys.stderr)
    if as_json:
        print(json.dumps(r.to_dict(), indent=2))
        return
    how = "already installed" if r.already_installed else f"{r.bytes_sent} of {r.bytes_total} bytes sent"
    print(f"{r.target}: current -> versions/{r.version} ({r.files} files verified, {how})"
          + (f"; previous -> {r.previous}" if r.previous else ""))
    if r.device:
        print(f"  device runtime: {r.device}")
    if r.switched:
        print(restart_note(r.restart, r.target, _ssh(ssh)))


@jetson.command("rollback")
def rollback_cmd(
    target: Annotated[str, typer.Argument(help="user@host:/dir or a local/mounted directory")],
    ssh: Annotated[str | None, typer.Option(help=SSH_HELP)] = None,
    force: Annotated[bool, typer.Option(help="roll back even when the device's lineside (the one lineside.service "
                                             "runs) cannot open the previous version")] = False,
) -> None:
    """Point TARGET/current back at the previous version (run again to undo).

    Over ssh it first asks the device's lineside whether it can open that version and refuses if not."""
    from lineside.jetson.push import rollback
    from lineside.jetson.restart_hint import restart_note

    r = rollback(target, _ssh(ssh), force=force)
    if r.device_warning:
        print(f"warning: rolled back anyway (--force): {r.device_warning}", file=sys.stderr)
    print(f"{target}: current -> {r.current}; previous -> {r.previous}")
    if r.device:
        print(f"  device runtime: {r.device}")
    print(restart_note(r.restart, r.target, _ssh(ssh), rollback=True))


@jetson.command("ensure-engine")
def ensure_engine_cmd(
    bundle: Annotated[Path, typer.Argument(help="bundle directory")],
    engine_args: Annotated[str, typer.Option(envvar="LINESIDE_ENGINE_ARGS",
                                             help="options for `lineside engine`, e.g. '--slots 8'")] = "",
) -> None:
    """Build the TensorRT engine only if the bundle has none for this GPU/TensorRT (first start)."""
    from lineside.jetson.ensure_engine import ensure_engine

    built, key = ensure_engine(bundle, engine_args)
    # "ready", not "built": `lineside engine` may have found the engine of a run it waited for (its line says so)
    print(f"{bundle}: engine {key} " + ("ready" if built else "already present"), file=sys.stderr)


@jetson.command("power")
def power_cmd(
    mode: Annotated[str | None, typer.Option(help="nvpmodel mode id or name (MAXN, 30W, 15W, ...)")] = None,
    clocks: Annotated[bool | None, typer.Option("--clocks/--no-clocks",
                                                help="pin clocks to max (jetson_clocks) / restore them")] = None,
    query: Annotated[bool, typer.Option(help="show the current mode and the modes available")] = False,
    dry_run: Annotated[bool, typer.Option(help="print the commands without running them")] = False,
    sysroot: Annotated[Path, typer.Option(help="device files root (tests)")] = Path("/"),
) -> None:
    """Set the power mode (nvpmodel -m) and clocks (jetson_clocks); Jetson only."""
    from lineside.jetson.power import query_power, set_power

    checks.input_dir(sysroot, "--sysroot")
    if query or (mode is None and clocks is None):
        print(query_power(str(sysroot)))
        return
    for c in set_power(mode, clocks, str(sysroot), dry_run):
        print(("would run: " if dry_run else "ran: ") + c)


@jetson.command("service")
def service_cmd(
    bundle: Annotated[str, typer.Option(help="bundle path on the device (the push symlink)")] = "/opt/lineside/current",
    output: Annotated[str | None, typer.Option("--output", "-o", help="write the unit here (file or dir)")] = None,
    user: Annotated[str, typer.Option(help="user the server runs as")] = "lineside",
    host: Annotated[str, typer.Option(help="listen address")] = "0.0.0.0",
    port: Annotated[int, checks.number_option(low=1, high=65535, help="listen port")] = 8000,
    env_file: Annotated[str, typer.Option(help="EnvironmentFile (optional at runtime)")] = "/etc/lineside/lineside.env",
    drain_timeout: Annotated[int, checks.number_option(
        low=0, high=int(checks.MAX_SECONDS), help="server drain timeout in s; TimeoutStopSec adds 15")] = 30,
    exec_path: Annotated[str, typer.Option(help="lineside on the device (default: found on PATH on a Jetson, "
                                           "else /usr/local/bin/lineside)")] = "",
    build_engine: Annotated[bool, typer.Option(help="ExecStartPre builds the engine if none matches")] = True,
    sysroot: Annotated[Path, typer.Option(help="device files root (tests)")] = Path("/"),
) -> None:
    """Write (or print) a systemd unit running `lineside serve` with restart and drain-aware stop."""
    from lineside.jetson.service import ServiceSpec, install_hint, on_systemd_jetson, write_unit

    checks.input_dir(sysroot, "--sysroot")
    if output is not None:  # a directory gets lineside.service inside; checked before anything is written
        target = Path(output).expanduser()
        output = str(checks.output_file(target / "lineside.service" if target.is_dir() else target, "--output"))
    is_jetson, systemd = on_systemd_jetson(str(sysroot))
    if not exec_path and is_jetson:
        exec_path = shutil.which("lineside") or ""
    spec = ServiceSpec(bundle=bundle, user=user, host=host, port=port, env_file=env_file,
                       drain_timeout_s=drain_timeout, exec_path=exec_path, build_engine=build_engine)
    result = write_unit(spec, output)
    if output is None:
        print(result, end="")
    else:
        print(f"wrote {result}; {install_hint(result)}")
    if not is_jetson:
        print("note: this machine is not a Jetson; copy the unit to the device's /etc/systemd/system/",
              file=sys.stderr)
    elif not systemd:
        print("note: systemd is not running here (a container?); install the unit on the host", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.add_typer(jetson, name="jetson")
