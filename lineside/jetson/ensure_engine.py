"""Build the TensorRT engine only when the bundle has none for this machine (first start on a device).

Used by the container entrypoint and the systemd unit's ExecStartPre: `lineside engine` always
rebuilds (minutes on an Orin), so every restart would otherwise pay for it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from lineside.bundle import read_manifest
from lineside.errors import LinesideError


def ensure_engine(bundle: str | os.PathLike[str], engine_args: str = "") -> tuple[bool, str]:
    """(built now?, machine key). Runs `lineside engine BUNDLE ENGINE_ARGS` when no engine matches."""
    from lineside.runtime.tensorrt.key import ENGINES_DIR, has_engine_for, machine_key

    path = Path(bundle)
    read_manifest(path)  # one line if this is not a bundle
    here = machine_key()  # one line if there is no GPU / TensorRT / cuda-python
    if has_engine_for(path, here):
        return False, here.key
    engines = path / ENGINES_DIR
    writable = os.access(engines if engines.is_dir() else path, os.W_OK)
    if not writable:
        raise LinesideError(f"{path} has no engine for this machine ({here.key}) and is read-only; mount it "
                           f"writable (the engine is kept in {engines}) or run `lineside engine {path}` elsewhere")
    cmd = [sys.executable, "-m", "lineside", "engine", str(path), *shlex.split(engine_args)]
    p = subprocess.run(cmd)
    if p.returncode != 0:
        raise LinesideError(f"building the engine for {here.key} failed (exit {p.returncode}); see the lines above")
    return True, here.key
