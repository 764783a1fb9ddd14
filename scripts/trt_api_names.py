"""Write the Python API surface of one TensorRT release (class → members, keyword names) as JSON.

The names come from TensorRT's own pybind11 binding sources (python/src/**/*.cpp in NVIDIA/TensorRT at a
release tag), so the CPU tests can hold the fake TensorRT used by tests/runtime/tensorrt to the real API:
every attribute lineside touches must exist in the release it claims to support.

    python scripts/trt_api_names.py /path/to/TensorRT.git v10.3.0 > tests/runtime/tensorrt/data/tensorrt_api_10.3.json
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

DEF_RE = re.compile(r"\.(def|def_property|def_property_readonly|def_readwrite|def_readonly|def_static|value)\s*\(")
HEAD_RE = re.compile(r"py::(class_|enum_)\s*<")
KWARG_RE = re.compile(r'"(\w+)"_a|py::arg\(\s*"(\w+)"')


def strip_comments(src: str) -> str:
    """Drop // and /* */ comments and preprocessor lines, keeping string literals intact."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        elif src.startswith("//", i):
            i = src.find("\n", i)
            i = n if i < 0 else i
        elif src.startswith("/*", i):
            i = src.find("*/", i) + 2
        else:
            out.append(c)
            i += 1
    return "\n".join(line for line in "".join(out).splitlines() if not line.lstrip().startswith("#"))


def balanced(src: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes the one at ``src[i]`` (strings skipped)."""
    depth = 0
    for j, c, _ in scan(src, i):
        depth += (c == open_) - (c == close)
        if c == close and depth == 0:
            return j + 1
    raise ValueError("unbalanced source")


def scan(src: str, i: int = 0):
    """(index, char, depth) of each character outside string literals; depth = brackets open before it."""
    depth, n = 0, len(src)
    while i < n:
        c = src[i]
        if c == '"':
            i = balanced_string(src, i)
            continue
        yield i, c, depth
        depth += (c in "([{") - (c in ")]}")
        i += 1


def statement_end(src: str, i: int) -> int:
    """Index of the ``;`` that ends the statement starting at ``i``, outside brackets and strings."""
    return next((j for j, c, depth in scan(src, i) if c == ";" and depth == 0), len(src))


def chain_members(chain: str) -> tuple[set[str], dict[str, list[str]], bool, list[str]]:
    """Members, keyword names per member, export_values(), and constructor keywords of a ``.def(...)`` chain."""
    members: set[str] = set()
    kwargs: dict[str, list[str]] = {}
    init_kwargs: list[str] = []
    for i, c, depth in scan(chain):
        m = DEF_RE.match(chain, i) if c == "." and depth == 0 else None
        if not m:
            continue
        start = m.end() - 1
        args = chain[start + 1:balanced(chain, start, "(", ")") - 1].strip()
        names = [a or b for a, b in KWARG_RE.findall(args)]
        lit = re.match(r'"(\w+)"', args)
        if lit:
            members.add(lit.group(1))
            kwargs.setdefault(lit.group(1), []).extend(x for x in names if x not in kwargs[lit.group(1)])
        elif args.startswith("py::init"):
            init_kwargs = names
    return members, kwargs, ".export_values()" in chain, init_kwargs


def balanced_string(src: str, i: int) -> int:
    j = i + 1
    while j < len(src) and src[j] != '"':
        j += 2 if src[j] == "\\" else 1
    return j + 1


def split_template(args: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for c in args:
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
    return parts + [cur.strip()] if cur.strip() else parts


def parse(sources: list[str]) -> dict:
    classes: dict[str, dict] = {}
    cpp_to_py: dict[str, str] = {}
    var_to_py: dict[str, str] = {}
    bases: dict[str, list[str]] = {}
    module_funcs: set[str] = set()
    for src in sources:
        src = strip_comments(src)
        for m in re.finditer(r"\bm\.def\(\s*\"(\w+)\"", src):
            module_funcs.add(m.group(1))
        for m in HEAD_RE.finditer(src):
            t_end = balanced(src, m.end() - 1, "<", ">")
            targs = split_template(src[m.end():t_end - 1])
            rest = src[t_end:]
            h = re.match(r"\s*(\w+)?\s*([({])", rest)
            if not h:
                continue
            var = h.group(1)
            open_at = t_end + h.start(2)
            close_at = balanced(src, open_at, h.group(2), ")" if h.group(2) == "(" else "}")
            ctor = src[open_at + 1:close_at - 1]
            cm = re.match(r'\s*(\w+)\s*,\s*"(\w+)"', ctor)
            if not cm:
                continue
            scope, name = cm.groups()
            owner = var_to_py.get(scope)
            full = f"{owner}.{name}" if owner else name
            cpp_to_py[targs[0]] = full
            if var:
                var_to_py[var] = full
            bases[full] = targs[1:]
            stop = statement_end(src, close_at)
            entry = classes.setdefault(full, {"members": set(), "kwargs": {}, "init": [], "enum": m.group(1) == "enum_"})
            members, kwargs, exported, init = chain_members(src[close_at:stop])
            entry["members"] |= members
            entry["kwargs"].update(kwargs)
            entry["init"] = init or entry["init"]
            if owner:
                classes.setdefault(owner, {"members": set(), "kwargs": {}, "init": [], "enum": False})
                classes[owner]["members"].add(name)
                if exported:
                    classes[owner]["members"] |= members
        # later statements on a bound variable: ``baseLoggerBinding.def(...)...;``
        for var, full in list(var_to_py.items()):
            for m in re.finditer(rf"\b{re.escape(var)}\s*(?=\.def)", src):
                stop = statement_end(src, m.end())
                members, kwargs, _, init = chain_members(src[m.end():stop])
                classes[full]["members"] |= members
                classes[full]["kwargs"].update(kwargs)
                classes[full]["init"] = init or classes[full]["init"]
    # inherit members from bound base classes
    def all_members(name: str, seen: frozenset = frozenset()) -> set[str]:
        out = set(classes[name]["members"])
        for b in bases.get(name, []):
            py = cpp_to_py.get(b)
            if py and py in classes and py not in seen:
                out |= all_members(py, seen | {name})
        return out

    return {
        "module": sorted(module_funcs | {n for n in classes if "." not in n}),
        "classes": {n: {"members": sorted(all_members(n)), "kwargs": {k: v for k, v in sorted(c["kwargs"].items()) if v},
                        "init": c["init"], "enum": c["enum"]}
                    for n, c in sorted(classes.items())},
    }


def main() -> None:
    repo, tag = sys.argv[1], sys.argv[2]
    files = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "--name-only", tag, "python/src"],
                           check=True, capture_output=True, text=True).stdout.split()
    sources = [subprocess.run(["git", "-C", repo, "show", f"{tag}:{f}"], check=True, capture_output=True,
                              text=True).stdout for f in files if f.endswith(".cpp")]
    api = parse(sources)
    api["tag"] = tag
    json.dump(api, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
