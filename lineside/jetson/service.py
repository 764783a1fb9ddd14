"""A systemd unit that runs `lineside serve` on the device, restarting it on failure.

The stop timeout covers the server's drain (finish in-flight requests after SIGTERM) plus a
margin; the environment file carries settings that differ per device (port, threads, tokens).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from lineside.errors import LinesideError


@dataclass
class ServiceSpec:
    bundle: str = "/opt/lineside/current"
    user: str = "lineside"
    group: str = "video"  # the Jetson GPU device nodes belong to group video
    host: str = "0.0.0.0"
    port: int = 8000
    env_file: str = "/etc/lineside/lineside.env"
    drain_timeout_s: int = 30
    exec_path: str = ""
    build_engine: bool = True
    description: str = "lineside LLM server"


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*|[0-9]+")  # a user or group systemd takes (or a numeric id)
_HOST = re.compile(r"[A-Za-z0-9_.:\[\]%-]+")  # an address or name, one word


def _check(spec: ServiceSpec) -> None:
    """What systemd would read otherwise than meant is refused in one line: it runs the unit from /, so a relative
    bundle or environment file is another path (or ignored); a space or line break splits a value."""
    for option, value in (("--bundle", spec.bundle), ("--env-file", spec.env_file), ("--exec-path", spec.exec_path),
                          ("--user", spec.user), ("--host", spec.host)):
        if any(ch in value for ch in "\n\r\0"):
            raise LinesideError(f"{option} {value!r}: a unit value is one line; remove the line break")
    for option, value in (("--bundle", spec.bundle), ("--env-file", spec.env_file)):
        if value and not value.startswith("/"):
            raise LinesideError(f"{option} {value}: give the absolute path on the device (systemd runs the service "
                                f"from /, so a relative path is another file)")
    if "/" in spec.exec_path and not spec.exec_path.startswith("/"):
        raise LinesideError(f"--exec-path {spec.exec_path}: give an absolute path (or a bare name systemd finds on "
                            "its PATH)")
    if not _NAME.fullmatch(spec.user) or not _NAME.fullmatch(spec.group):
        raise LinesideError(f"--user {spec.user!r}: give a user name (letters, digits, '_', '.', '-') or a numeric id")
    if not _HOST.fullmatch(spec.host):
        raise LinesideError(f"--host {spec.host!r}: give one address or host name, e.g. 0.0.0.0")


def _literal(text: str) -> str:
    """Text systemd reads as it is: '%' starts a specifier everywhere and '$' a variable in Exec lines."""
    return text.replace("%", "%%")


def _exec_word(text: str) -> str:
    return _literal(shlex.quote(text)).replace("$", "$$")


def render_unit(spec: ServiceSpec) -> str:
    """The unit file text."""
    if spec.drain_timeout_s < 0 or not 0 < spec.port < 65536:
        raise LinesideError("--drain-timeout must be >= 0 and --port in 1..65535")
    _check(spec)
    exe = _exec_word(spec.exec_path or "/usr/local/bin/lineside")
    bundle = _exec_word(spec.bundle)
    lines = [
        "[Unit]",
        f"Description={_literal(f'{spec.description} ({spec.bundle})')}",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"User={spec.user}",
        f"Group={spec.group}",
        f"EnvironmentFile=-{_literal(spec.env_file)}",
    ]
    if spec.build_engine:
        # First start on a new device or after a push: build the engine for this GPU (slow, once);
        # LINESIDE_ENGINE_ARGS in the environment file passes options to `lineside engine`.
        lines += [f"ExecStartPre={exe} jetson ensure-engine {bundle}", "TimeoutStartSec=3600"]
    lines += [
        # $LINESIDE_SERVE_ARGS (from the environment file) adds options, e.g. --backend tensorrt
        f"ExecStart={exe} serve {bundle} --host {_literal(spec.host)} --port {spec.port} "
        f"--drain-timeout {spec.drain_timeout_s} $LINESIDE_SERVE_ARGS",
        # a failed engine (its backend failing step after step) makes `serve` exit 1: restarted here
        "Restart=on-failure",
        "RestartSec=5",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={spec.drain_timeout_s + 15}",
        "LimitNOFILE=65536",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def install_hint(path: str) -> str:
    return (f"install: sudo cp {path} /etc/systemd/system/lineside.service && sudo systemctl daemon-reload "
            "&& sudo systemctl enable --now lineside")


def write_unit(spec: ServiceSpec, output: str | None) -> str:
    """Write the unit to ``output`` (returns a note for the user) or return the unit text."""
    text = render_unit(spec)
    if output is None:
        return text
    out = Path(output)
    if out.is_dir():
        out = out / "lineside.service"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        raise LinesideError(f"cannot write {out}: {e.strerror}; pick another --output or use sudo") from None
    return str(out)


def on_systemd_jetson(sysroot: str = "/") -> tuple[bool, bool]:
    """(is a Jetson, runs systemd) for the off-device note."""
    root = Path(sysroot)
    return (root / "etc/nv_tegra_release").is_file(), (root / "run/systemd/system").is_dir()
