"""`--gpus auto`: this host's GPUs, read from nvidia-smi, as the COUNTxKIND `deploy datacenter` plans for.

Only a set of one known kind is taken: a GPU lineside has no sizes for, a mix of kinds, no nvidia-smi, or more
GPUs than one node plans is one line asking for an explicit --gpus, since a guess would size the wrong memory.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter

from lineside.deploy.parallel import MAX_GPUS
from lineside.deploy.sizing import GPUS, MIB, Gpu
from lineside.errors import LinesideError

QUERY = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
TIMEOUT_S = 30
_ASK = "pass --gpus COUNTxKIND (e.g. 8xH200)"


def kind_of(name: str, memory_mib: int) -> Gpu | None:
    """The known kind a reported GPU is (its model token in the name: 'NVIDIA H100 80GB HBM3', 'NVIDIA H100 NVL',
    'NVIDIA H200'), when it has at least that kind's memory; None otherwise (GH200, A100, a smaller variant)."""
    for gpu in GPUS.values():
        if re.search(rf"(?<![A-Za-z0-9]){gpu.key}(?![0-9])", name, re.IGNORECASE):
            return gpu if memory_mib * MIB >= gpu.memory_bytes else None
    return None


def parse_query(text: str) -> str:
    """nvidia-smi's CSV (``name, 81559 MiB`` a line) → '3xH100', or the one line saying why not."""
    rows = [line.rsplit(",", 1) for line in text.splitlines() if line.strip()]
    if not rows:
        raise LinesideError(f"--gpus auto: nvidia-smi lists no GPUs on this host; {_ASK}")
    kinds: list[Gpu] = []
    for i, row in enumerate(rows):
        m = re.fullmatch(r"\s*(\d+)\s*MiB\s*", row[1]) if len(row) == 2 else None
        if m is None:
            raise LinesideError(f"--gpus auto: cannot read nvidia-smi's line {','.join(row)[:80]!r}; {_ASK}")
        gpu = kind_of(row[0].strip(), int(m.group(1)))
        if gpu is None:
            known = ", ".join(g.key.upper() for g in GPUS.values())
            raise LinesideError(f"--gpus auto: GPU {i} is {row[0].strip()[:60]!r} ({m.group(1)} MiB), not a kind "
                                f"lineside sizes ({known}); {_ASK} with the kind whose memory it has at least")
        kinds.append(gpu)
    counts = Counter(g.key.upper() for g in kinds)
    if len(counts) > 1:
        mix = ", ".join(f"{n}x{k}" for k, n in counts.items())
        raise LinesideError(f"--gpus auto: mixed GPU kinds ({mix}); one engine plans one kind: pass --gpus "
                            f"COUNTxKIND for the GPUs to use")
    label = f"{len(kinds)}x{kinds[0].key.upper()}"
    if len(kinds) > MAX_GPUS:
        raise LinesideError(f"--gpus auto: {len(kinds)} GPUs; one node plans 1 to {MAX_GPUS}: pass --gpus "
                            f"{MAX_GPUS}x{kinds[0].key.upper()}")
    return label


def detect_gpus() -> str:
    """This host's GPU set as COUNTxKIND, from ``nvidia-smi --query-gpu=name,memory.total``."""
    try:
        p = subprocess.run(QUERY, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise LinesideError(f"--gpus auto: nvidia-smi is not on PATH (no NVIDIA driver on this host?); "
                            f"{_ASK}") from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinesideError(f"--gpus auto: nvidia-smi did not answer ({type(e).__name__}); {_ASK}") from None
    if p.returncode != 0:
        why = next((ln.strip() for ln in (p.stderr + p.stdout).splitlines() if ln.strip()), "no message")
        raise LinesideError(f"--gpus auto: nvidia-smi failed (exit {p.returncode}: {why[:120]}); {_ASK}")
    return parse_query(p.stdout)
