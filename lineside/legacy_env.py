"""Environment variables under the name this project had before 0.2.0 (trtedge, renamed lineside).

The rename moved the variables trtedge read from ``TRTEDGE_*`` to ``LINESIDE_*``; a container, unit environment
file or shell profile written for trtedge still sets the old names, and nothing read them after an upgrade:
``TRTEDGE_API_KEY`` left `lineside serve` without a key, open to every client on the network, and said nothing.
Each old name the CLI reads is taken as its new one while the new one is unset, with a warning to rename it; when
both are set the new one wins and the warning says the old one is ignored. Only the names trtedge read are
looked at: NVIDIA's TensorRT Edge-LLM, whose CLI is now called trtedge, may have variables of its own.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OLD, NEW = "TRTEDGE_", "LINESIDE_"
# What trtedge 0.1 read in Python (server/app.py, jetson/commands.py): the container entrypoint and the systemd
# unit's variables are read by the shell and systemd, not here.
RENAMED = ("API_KEY", "SSH", "ENGINE_ARGS")


def adopt_old_names(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Copy each set ``TRTEDGE_<name>`` of ``RENAMED`` to ``LINESIDE_<name>`` where that is unset; return one
    warning line per old name found (its value is never printed: it may be the API key)."""
    env = os.environ if environ is None else environ
    notes = []
    for name in RENAMED:
        old, new = OLD + name, NEW + name
        if old not in env:
            continue
        if new in env:
            if env[new] != env[old]:
                notes.append(f"warning: {old} is ignored: {new} is set (trtedge was renamed lineside in 0.2.0); "
                             f"remove {old}")
            continue
        env[new] = env[old]
        notes.append(f"warning: {old} is trtedge's name from before 0.2.0; read as {new}: rename it {new}")
    return notes
