"""benchmarks/slo_ladder.py as a user runs it: a server that cannot start is one line and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_server_that_exits_before_ready_is_one_line(tmp_path):
    """`lineside serve` refusing the bundles (here: none there) printed its reason, then the script added a
    LinesideError traceback."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "slo_ladder.py"), str(tmp_path / "nope"),
                        str(tmp_path / "nope2")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("slo_ladder: the server at http://127.0.0.1:"), r.stderr
