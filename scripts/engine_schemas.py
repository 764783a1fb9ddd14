"""Write the configuration schema of one serving engine, taken from its own source, as a JSON test fixture.

`lineside deploy datacenter` writes engine configs; tests/fleet/test_deploy_datacenter.py holds them to
these fixtures, so an option an engine does not have (or a value outside its choices) fails a test.

    python scripts/engine_schemas.py vllm   SRC > tests/fleet/fixtures/vllm_args.json
    python scripts/engine_schemas.py sglang SRC > tests/fleet/fixtures/sglang_args.json
    python scripts/engine_schemas.py trtllm SRC [COMMIT] > tests/fleet/fixtures/trtllm_serve_schema.json

SRC is a checkout of the engine (vllm-project/vllm, sgl-project/sglang, NVIDIA/TensorRT-LLM at a release) or an
unpacked wheel (`pip download --no-deps vllm==X && unzip`): what is read is
- vLLM: the fields of ``EngineArgs`` (vllm/engine/arg_utils.py) and ``FrontendArgs``
  (vllm/entrypoints/common/cli_args.py); a field ``foo_bar`` is the option ``--foo-bar``; ``Literal`` type aliases
  defined in vllm/config/*.py give the choices;
- SGLang: the namespace fields of sglang/srt/arg_groups/fields/*.py (``A[T, "help" | Arg(...)]``: the CLI name,
  aliases and choices) and the options sglang/srt/server_args.py registers by hand (deprecated spellings);
- TensorRT-LLM: tensorrt_llm/schemas/trtllm-serve-config.schema.json (the fields of ``TorchLlmArgs``, generated
  in that repository from llm_args.py) verbatim, with its repository, path, commit and sha256 in front
  (``x-source``); COMMIT is read from SRC when it is a git checkout, else give it (e.g. a file reassembled from
  the public code index at that commit).
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _literal_aliases(files: list[Path]) -> dict[str, list[Any]]:
    """Module-level ``Name = Literal[...]`` (or ``Name: TypeAlias = Literal[...]``) → its values."""
    out: dict[str, list[Any]] = {}
    for f in files:
        try:
            tree = ast.parse(f.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                target, value = node.target.id, node.value
            vals = _literal_values(value, out) if value is not None else None
            if target and vals is not None:
                out[target] = vals
    return out


def _literal_values(node: ast.AST, known: dict[str, list[Any]]) -> list[Any] | None:
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        vals = [e.value for e in elts if isinstance(e, ast.Constant)]
        return vals if len(vals) == len(elts) else None
    if isinstance(node, ast.Name) and node.id in known:
        return known[node.id]
    return None


def _type_info(ann: ast.AST, aliases: dict[str, list[Any]]) -> dict[str, Any]:
    """{"type": source text, "choices": [...] when the annotation is a Literal (or alias) alone or | None}."""
    info: dict[str, Any] = {"type": ast.unparse(ann)}
    parts = _union_parts(ann)
    non_none = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)
                and not (isinstance(p, ast.Name) and p.id == "None")]
    if len(non_none) == 1:
        vals = _literal_values(non_none[0], aliases)
        if vals is not None:
            info["choices"] = vals
    return info


def _union_parts(ann: ast.AST) -> list[ast.AST]:
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _union_parts(ann.left) + _union_parts(ann.right)
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return [ann.slice, ast.Constant(None)]
    return [ann]


def _class_fields(path: Path, name: str) -> list[tuple[str, ast.AST]]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [(st.target.id, st.annotation) for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                    and not st.target.id.startswith("_")]
    raise SystemExit(f"class {name} not found in {path}")


def vllm(src: Path) -> dict[str, Any]:
    config_files = sorted((src / "vllm" / "config").glob("*.py")) + [src / "vllm" / "engine" / "arg_utils.py"]
    aliases = _literal_aliases(config_files)
    args: dict[str, Any] = {}
    sources = [(src / "vllm" / "engine" / "arg_utils.py", "EngineArgs"),
               (src / "vllm" / "entrypoints" / "common" / "cli_args.py", "BaseFrontendArgs"),
               (src / "vllm" / "entrypoints" / "common" / "cli_args.py", "FrontendArgs")]
    for path, cls in sources:
        for field, ann in _class_fields(path, cls):
            args["--" + field.replace("_", "-")] = {"field": field, "class": cls, **_type_info(ann, aliases)}
    return {"engine": "vllm", "source": "vllm/engine/arg_utils.py EngineArgs + entrypoints FrontendArgs",
            "options": dict(sorted(args.items())), "literal_aliases": dict(sorted(aliases.items()))}


def _arg_call(meta: ast.AST) -> dict[str, Any]:
    """Keyword values of an ``Arg(...)`` call that are plain literals."""
    out: dict[str, Any] = {}
    if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
        for kw in meta.keywords:
            try:
                out[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                out[kw.arg] = "<dynamic>"
    return out


def sglang(src: Path) -> dict[str, Any]:
    base = src / "sglang" / "srt"
    aliases = _literal_aliases(sorted((base / "arg_groups").rglob("*.py")))
    options: dict[str, Any] = {}
    for f in sorted((base / "arg_groups" / "fields").glob("*.py")):
        tree = ast.parse(f.read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for st in cls.body:
                if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                    continue
                ann = st.annotation
                if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "A"):
                    continue
                elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
                tp, meta = elts[0], (elts[1] if len(elts) > 1 else None)
                if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Derived":
                    continue
                kw = _arg_call(meta) if meta is not None else {}
                if kw.get("no_cli"):
                    continue
                field = st.target.id
                name = kw.get("cli_name") or "--" + field.replace("_", "-")
                info = {"field": field, "namespace": f.stem, **_type_info(tp, aliases)}
                if isinstance(kw.get("choices"), list):
                    info["choices"] = kw["choices"]
                if kw.get("aliases") and kw["aliases"] != "<dynamic>":
                    info["aliases"] = kw["aliases"]
                if kw.get("nargs"):
                    info["nargs"] = kw["nargs"]
                options[name] = info
    tree = ast.parse((base / "server_args.py").read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--")):
            flag = node.args[0].value
            deprecated = any(isinstance(k.value, ast.Name) and "Deprecated" in k.value.id for k in node.keywords
                             if k.arg == "action")
            options.setdefault(flag, {"field": flag[2:].replace("-", "_"), "namespace": "server_args",
                                      "type": "manual", **({"deprecated": True} if deprecated else {})})
    return {"engine": "sglang", "source": "sglang/srt/arg_groups/fields/*.py + server_args.py add_argument",
            "options": dict(sorted(options.items()))}


TRTLLM_REPO = "NVIDIA/TensorRT-LLM"
TRTLLM_SCHEMA = "tensorrt_llm/schemas/trtllm-serve-config.schema.json"
PROVENANCE_KEYS = ("x-source", "x-version")  # added in front of the verbatim schema; JSON Schema ignores them


def trtllm(src: Path, commit: str | None = None) -> dict[str, Any]:
    """The serve-config schema verbatim (every key, description and default kept), with its provenance in
    front: repository, path, commit and the sha256 of the source bytes, which `without_provenance` re-creates."""
    raw = (src / TRTLLM_SCHEMA).read_bytes()
    schema = json.loads(raw)
    if commit is None:
        head_rev = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = head_rev.stdout.strip() if head_rev.returncode == 0 else None
    version = str(schema.get("title", "")).removeprefix("TensorRT-LLM ").split(" ")[0] or None
    head = {"x-source": {"repo": TRTLLM_REPO, "path": TRTLLM_SCHEMA,
                         "commit": commit,
                         "sha256": hashlib.sha256(raw).hexdigest()},
            "x-version": version}
    if json_text(schema) != raw.decode():
        raise SystemExit(f"{TRTLLM_SCHEMA} is not in json.dumps(indent=2) form; the fixture could not re-create it")
    return {**head, **schema}


def json_text(obj: Any) -> str:
    """The text form the TensorRT-LLM schema file is generated in (scripts/generate_trtllm_serve_schemas.py)."""
    return json.dumps(obj, indent=2) + "\n"


def without_provenance(fixture: dict[str, Any]) -> str:
    """The source file's text back from the fixture (its sha256 is in x-source)."""
    return json_text({k: v for k, v in fixture.items() if k not in PROVENANCE_KEYS})


def main(argv: list[str]) -> None:
    if argv[1:2] == ["trtllm"] and len(argv) in (3, 4):
        sys.stdout.write(json_text(trtllm(Path(argv[2]), argv[3] if len(argv) == 4 else None)))
        return
    if len(argv) != 3 or argv[1] not in ("vllm", "sglang"):
        raise SystemExit(__doc__)
    fn = {"vllm": vllm, "sglang": sglang}[argv[1]]
    out = fn(Path(argv[2]))
    version = _version(Path(argv[2]), argv[1])
    if version:
        out["x-version"] = version
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


def _version(src: Path, engine: str) -> str | None:
    pkg = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}[engine]
    for meta in src.glob(f"{pkg.replace('_', '[-_]')}-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


if __name__ == "__main__":
    main(sys.argv)
