"""TensorRT ONNX-parser op-support tables: parsed from onnx-tensorrt's docs/operators.md, stored as JSON.

The tables in ``data/`` are derived with ``python -m lineside.build.tensorrt.optable OPERATORS_MD OUT_JSON
--version V --source TEXT``; the check (check.py) reads them, so it runs without TensorRT.
"""

from __future__ import annotations

import argparse
import json
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from lineside.errors import LinesideError

# `--trt` names → data file. "newest" is the newest release whose table we store.
TABLES = {"10.3": "trt_ops_10.3.json", "10.15": "trt_ops_10.15.json"}
ALIASES = {"newest": "10.15", "10.3.0": "10.3", "jetpack6": "10.3"}

# Spelling fixes for typos in the upstream tables (recorded in each JSON's "fixes").
_TYPE_FIXES = {"INF64": "INT64", "FLOAT32": "FP32", "FLOAT16": "FP16", "BFLOAT16": "BF16"}

# Restriction sentences we can check statically: "`name` must be <constant-ish>".
_CONST_RE = re.compile(
    r"`(\w+)`\s+(?:input\s+)?must be (an initializer|a build-time constant|a constant tensor|resolvable to a constant)"
)


def parse_operators_md(text: str) -> dict[str, Any]:
    """Parse the operator support matrix (and header) of onnx-tensorrt's operators.md into plain data."""
    header = re.search(r"TensorRT\s+([0-9.]+)\s+supports operators in the inclusive range of opset\s+(\d+)\s+to opset\s+(\d+)",
                       text)
    dtypes_line = re.search(r"TensorRT supports the following ONNX data types:([^\n]*)", text)
    graph_types: list[str] = []
    if dtypes_line:
        for t in re.split(r",|\band\b", dtypes_line.group(1)):
            t = t.strip().upper()
            if t:
                graph_types.append(_TYPE_FIXES.get(t, t))
    ops: dict[str, Any] = {}
    fixes: list[str] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("Operator", "") or set(cells[0]) <= {"-"}:
            continue
        name, flag = cells[0], cells[1]
        supported = flag.upper().startswith("Y")
        types: list[str] = []
        if supported and len(cells) > 2:
            for t in cells[2].split(","):
                t = t.strip().upper()
                if not t:
                    continue
                if t in _TYPE_FIXES:
                    fixes.append(f"{name}: {t} read as {_TYPE_FIXES[t]}")
                    t = _TYPE_FIXES[t]
                types.append(t)
        restriction = cells[3] if len(cells) > 3 else ""
        entry: dict[str, Any] = {"supported": supported, "types": types, "restrictions": restriction}
        const = [{"input": m.group(1), "kind": m.group(2)} for m in _CONST_RE.finditer(restriction)]
        if const:
            entry["const_inputs"] = const
        ops[name] = entry
    return {
        "doc_version": header.group(1) if header else None,
        "opset_min": int(header.group(2)) if header else None,
        "opset_max": int(header.group(3)) if header else None,
        "graph_types": graph_types,
        "fixes": fixes,
        "ops": ops,
    }


def resolve_version(version: str) -> str:
    v = ALIASES.get(version, version)
    if v not in TABLES:
        have = ", ".join(list(TABLES) + list(ALIASES))
        raise LinesideError(f"no op-support table for TensorRT {version!r}; use one of: {have}")
    return v


@cache
def load_table(version: str) -> dict[str, Any]:
    """The stored op-support table for a TensorRT version (``10.3``, ``newest``, ...)."""
    v = resolve_version(version)
    text = resources.files("lineside.build.tensorrt").joinpath("data", TABLES[v]).read_text()
    return json.loads(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("operators_md", type=Path)
    p.add_argument("out_json", type=Path)
    p.add_argument("--version", required=True, help="TensorRT release the table describes")
    p.add_argument("--source", required=True, help="where the operators.md came from (repo, ref, commit)")
    p.add_argument("--drop-restriction", action="append", default=[],
                   help="OP: a restriction a later changelog entry lifted (recorded in 'changes')")
    a = p.parse_args(argv)
    table = parse_operators_md(a.operators_md.read_text())
    table["trt_version"] = a.version
    table["source"] = a.source
    table["changes"] = []
    for op in a.drop_restriction:
        entry = table["ops"][op]
        table["changes"].append(f"{op}: dropped restriction {entry['restrictions']!r} (changelog)")
        entry["restrictions"] = ""
        entry.pop("const_inputs", None)
    a.out_json.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
