"""The command that restarts what serves a target, said after `jetson push` / `rollback` switched `current`.

Neither the unit `jetson service` writes nor the Dockerfile.jetson container notices the switch: each keeps
serving the bundle it opened at start (docker resolved the `current` symlink then) until it is restarted.
"""

from __future__ import annotations

import shlex

from lineside.jetson.device_runtime import UNIT, DeviceRuntime, Source


def restart_command(rt: DeviceRuntime | None, login: str | None) -> str | None:
    """The one command (run from here, over ``login``'s ssh) that restarts the server the probe found; None when
    what serves the target is not known (a local directory, a lineside run by hand)."""
    if rt is None or login is None:
        return None
    if rt.source is Source.UNIT:
        return f"{login} sudo systemctl restart {UNIT.removesuffix('.service')}"
    if rt.source is Source.CONTAINER and len(rt.interpreter) > 3:  # ("docker", "exec", "-i", ID, "python3")
        return f"{login} docker restart {shlex.quote(rt.interpreter[3][:12])}"
    return None


def restart_note(command: str | None, target_label: str, ssh: str = "ssh", rollback: bool = False) -> str:
    """One line: how to make the server serve the new `current`, and how to go back if it then is not ready."""
    how = f"`{command}`" if command else f"restart the server that serves {target_label}/current"
    again = shlex.join(["lineside", "jetson", "rollback", target_label, *(["--ssh", ssh] if ssh != "ssh" else [])])
    back = (f"if it does not come back ready, `{again}` and restart it again" if not rollback
            else f"if it does not come back ready, `{again}` undoes the rollback")
    return f"  the running server keeps the old bundle until restarted: {how}; {back}"
