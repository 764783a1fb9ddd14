"""Build the TensorRT engine only when the bundle has none for this machine (first start on a device).

A read-only bundle's engine is built into, and found in, the per-user cache (see runtime/tensorrt/key.py).

Used by the container entrypoint and the systemd unit's ExecStartPre: `lineside engine` rebuilds an engine of
other settings (minutes on an Orin), so every restart would otherwise risk paying for it; a run racing another
takes turns on the engine's build lock and `lineside engine` then uses the engine the other one built. On a Jetson the planner
picks the engine's prefill chunk (``--max-prefill``) when the engine options pin none: the largest that
fits the bundle's whole context on this board (`jetson plan` prints the same).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from lineside.bundle import read_manifest
from lineside.errors import LinesideError

ENGINE_SLOTS = 4  # `lineside engine --slots` default


def _option(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def planned_engine_args(bundle: Path, engine_args: str, sysroot: str | os.PathLike[str] = "/") -> tuple[str, str]:
    """``engine_args`` plus ``--max-prefill N`` when none is given and the planner, for this board (probed),
    the bundle's max_seq_len and the engine's slots, picks a chunk below the default; and a line saying why."""
    from lineside.jetson.planner import PREFILL_CHUNKS, plan
    from lineside.jetson.probe import probe

    args = shlex.split(engine_args)
    if _option(args, "--max-prefill") is not None:
        return engine_args, ""
    device = probe(sysroot).device
    if device is None:
        return engine_args, ""
    m = read_manifest(bundle)
    slots = _option(args, "--slots")
    batch = int(slots) if slots and slots.isdigit() and int(slots) > 0 else ENGINE_SLOTS
    kv = ((m.quantization or {}).get("kv_cache") or {}).get("dtype", "fp16") if isinstance(m.quantization, dict) \
        else "fp16"
    p = plan(str(bundle), device, ctx=m.max_seq_len, batch=batch, kv_dtype=kv)
    if not p.fits:
        return engine_args, (f"note: the planner finds no prefill chunk at which {bundle} (ctx {p.ctx} x {batch} "
                             f"slots) fits {device}; building with the engine's defaults (`lineside jetson plan` "
                             "says what to change)")
    if p.prefill_chunk >= PREFILL_CHUNKS[0]:
        return engine_args, ""
    return (f"{engine_args} --max-prefill {p.prefill_chunk}".strip(),
            f"note: --max-prefill {p.prefill_chunk}: the planner's chunk for ctx {p.ctx} x {batch} slots on {device} "
            f"({PREFILL_CHUNKS[0]} tokens per step do not fit); pin one in the engine options to override")


def ensure_engine(bundle: str | os.PathLike[str], engine_args: str = "",
                  sysroot: str | os.PathLike[str] = "/") -> tuple[bool, str]:
    """(built now?, machine key). Runs `lineside engine BUNDLE ENGINE_ARGS` when no engine matches (with the
    planner's --max-prefill on a Jetson when ENGINE_ARGS pins none)."""
    from lineside import user_cache
    from lineside.runtime.tensorrt.key import ENGINES_DIR, USER_FOLDER, has_engine_for, machine_key

    path = Path(bundle)
    manifest = read_manifest(path)  # one line if this is not a bundle
    try:
        shlex.split(engine_args)
    except ValueError as e:  # an unbalanced quote in the environment file
        raise LinesideError(f"LINESIDE_ENGINE_ARGS {engine_args!r}: {e}; fix the quoting (the engine options are "
                            "split like a shell command line)") from None
    here = machine_key()  # one line if there is no GPU / TensorRT / cuda-python
    if has_engine_for(path, here, manifest):  # a stale (rebuilt bundle) or damaged engine is rebuilt
        return False, here.key
    engines = path / ENGINES_DIR
    writable = os.access(engines if engines.is_dir() else path, os.W_OK)
    if not writable and user_cache.folder(USER_FOLDER) is None:  # else `lineside engine` keeps it in that cache
        raise LinesideError(f"{path} has no engine for this machine ({here.key}) and is read-only, and there is no "
                            f"writable per-user cache to build one into; mount the bundle writable (the engine is "
                            f"kept in {engines}) or set {user_cache.ENV_DIR} to a directory only this user can write to")
    engine_args, why = planned_engine_args(path, engine_args, sysroot)
    if why:
        print(why, file=sys.stderr)
    cmd = [sys.executable, "-m", "lineside", "engine", str(path), *shlex.split(engine_args)]
    p = subprocess.run(cmd)
    if p.returncode != 0:
        raise LinesideError(f"building the engine for {here.key} failed (exit {p.returncode}); see the lines above")
    return True, here.key
