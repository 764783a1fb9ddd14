"""The rows kernel (kernels/rows.c): MatMulNBits that loads each weight tile once for all rows of a step.

onnxruntime's own 4-bit kernel re-reads and re-scales every block per row, so 8 decode streams cost ~2.9x one;
this one costs one row's weight traffic plus each row's dot products, with each row's result independent of the
others. It is an onnxruntime custom-op library, compiled here (``python -m lineside.runtime.rows_kernel``, run by
scripts/setup.sh) against onnxruntime's C API header from Debian's ``libonnxruntime-dev`` (pinned by sha256: no
PyPI wheel ships the header). The cpu backend uses it on x86-64 CPUs with AVX-512 VNNI (4- and 8-bit nodes) or AVX2
(4-bit nodes) when it is built, and onnxruntime's kernel otherwise; ``LINESIDE_ROWS_KERNEL=0`` turns it off (an A/B
switch).
"""

from __future__ import annotations

import ctypes
import hashlib
import http.client
import io
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.request
from functools import lru_cache
from pathlib import Path
from typing import Any

from lineside import user_cache
from lineside.errors import LinesideError

log = logging.getLogger("lineside.runtime")

ENV = "LINESIDE_ROWS_KERNEL"  # "0": onnxruntime's MatMulNBits everywhere
DOMAIN = "ai.lineside"
SOURCE = Path(__file__).with_name("kernels") / "rows.c"
BUILD_DIR = Path(__file__).with_name("kernels") / "build"
FLAGS = ("-O3", "-fPIC", "-shared")  # the instruction sets are per function (target attributes), chosen at run time
# onnxruntime's C API header: Debian 13's libonnxruntime-dev (the API is append-only, so a 1.21 header serves
# every onnxruntime lineside supports, 1.22 and newer). Should Debian replace the package, the error says where
# to put the header instead.
HEADER_DEB = "libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
HEADER_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
HEADER_URLS = (f"http://deb.debian.org/debian/pool/main/o/onnxruntime/{HEADER_DEB}",)
HEADER_MEMBER = "./usr/include/onnxruntime/onnxruntime_c_api.h"


# What moves a node to the kernel (this module's text): in the graph cache's key beside the kernel's digest, so a
# cache rewritten by other rules is not loaded.
RULES = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]


def digest() -> str:
    """What a built library is named by: its source and flags, so an edited kernel is never run stale."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(HEADER_SHA256.encode())
    return h.hexdigest()[:16]


def _candidates() -> list[Path]:
    name = f"librows-{digest()}.so"
    user = user_cache.root()
    return [BUILD_DIR / name] + ([user / "kernels" / name] if user is not None else [])


def host_ok() -> str | None:
    """Why this host cannot run the kernel (None: it can, on AVX-512 VNNI or on AVX2 + FMA)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is written for x86-64 (AVX-512 VNNI or AVX2), not {platform.machine()}"
    flags = _cpu_flags()
    missing = [f for f in ("avx2", "fma") if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


ISA_ENV = "LINESIDE_ROWS_ISA"  # "avx2" / "avxvnni": that path on a CPU with more (tests, comparisons); the library reads it


@lru_cache(maxsize=4)
def _isa_of(path: Path, forced: str) -> str:
    del forced  # part of the cache key: the library reads the variable itself
    code = ctypes.CDLL(str(path)).lineside_rows_isa()
    return {3: "avx512", 4: "avxvnni", 2: "avx2"}.get(code, "none")


def isa(path: Path) -> str:
    """The instruction set the library at ``path`` runs in this process: "avx512" or "avxvnni" (4- and 8-bit nodes),
    or "avx2" (4-bit nodes only: the 8-bit products would saturate in vpmaddubsw's 16-bit sums)."""
    return _isa_of(path, os.environ.get(ISA_ENV, ""))


def bits_for(kernel_isa: str) -> tuple[int, ...]:
    return (4, 8) if kernel_isa in ("avx512", "avxvnni") else (4,)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


_said = threading.Event()


@lru_cache(maxsize=1)
def _library_cached(key: str) -> Path | None:
    del key
    why = host_ok()
    if why is not None:
        log.debug("rows kernel not used: %s", why)
        return None
    for path in _candidates():
        if path.is_file():
            return path
    if not _said.is_set():
        _said.set()
        log.info("rows kernel not built (python -m lineside.runtime.rows_kernel builds it): several decode streams "
                 "run on onnxruntime's 4-bit kernel, ~25%% slower at 8 streams")
    return None


def library() -> Path | None:
    """The built library for this host, or None (not x86-64 with AVX2, not built, or turned off by ``ENV``)."""
    if os.environ.get(ENV, "1").strip() == "0":
        return None
    return _library_cached(digest())


def _numel(t: Any) -> int:
    n = 1
    for d in t.dims:
        n *= int(d)
    return n


def eligible(node: Any, initializers: dict[str, Any], bits: tuple[int, ...] = (4, 8),
             overridable: frozenset[str] = frozenset()) -> bool:
    """Whether a graph node is a MatMulNBits the kernel computes as onnxruntime's does (to float rounding): 4 or 8 bits,
    accuracy level 4 (int8 activations per block), a block of 32..256, float32 (not fp16/bf16), uint8 zero points or
    none, no g_idx, not prepacked, and weights, scales, zero points and bias constant initializers of exactly the
    sizes K, N and the block say (the kernel reads that many bytes and repacks them once); ``overridable``: names
    that are also graph inputs, which a run may replace."""
    from onnx import TensorProto, helper

    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, block, nbits = attrs.get("K", 0), attrs.get("N", 0), attrs.get("block_size", 0), attrs.get("bits", 4)
    if nbits not in bits or attrs.get("accuracy_level", 0) != 4 or block < 32 or block % 32 or block > 256:
        return False
    if k <= 0 or n <= 0 or attrs.get("weight_prepacked", 0):
        return False
    inputs = list(node.input) + [""] * 6
    b_name, s_name, zp_name, g_idx, bias_name = inputs[1], inputs[2], inputs[3], inputs[4], inputs[5]
    if g_idx:
        return False
    used = [name for name in (b_name, s_name, zp_name, bias_name) if name]
    if any(name not in initializers or name in overridable for name in used):
        return False
    blocks = -(-k // block)
    b, scales = initializers[b_name], initializers[s_name]
    if b.data_type != TensorProto.UINT8 or list(b.dims) != [n, blocks, block * nbits // 8]:
        return False
    if scales.data_type != TensorProto.FLOAT or _numel(scales) != n * blocks:
        return False
    if zp_name:
        zp = initializers[zp_name]
        if zp.data_type != TensorProto.UINT8 or _numel(zp) != n * -(-blocks * nbits // 8):
            return False
    if bias_name:
        bias = initializers[bias_name]
        if bias.data_type != TensorProto.FLOAT or _numel(bias) != n:
            return False
    return True


def rewrite(graph: Path, bits: tuple[int, ...] = (4, 8)) -> tuple[bytes, int]:
    """``graph``'s model with every eligible MatMulNBits moved to the kernel's domain (same inputs and
    attributes), serialized; and how many nodes moved. Weights stay external (read from the graph's folder)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(graph), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    overridable = frozenset(i.name for i in model.graph.input)
    moved = 0
    for node in model.graph.node:
        if eligible(node, inits, bits, overridable):
            node.domain = DOMAIN
            moved += 1
    if moved and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model.SerializeToString(), moved


def rewritten(graph: Path, bits: tuple[int, ...] = (4, 8)) -> bytes | None:
    """``rewrite`` for ort_cache: the rewritten model, or None when no node of ``graph`` is eligible."""
    raw, moved = rewrite(graph, bits)
    return raw if moved else None


# ---- building -------------------------------------------------------------------------------------------------


def _header(into: Path) -> Path:
    """onnxruntime_c_api.h, taken from the pinned Debian package (checked by sha256) into ``into``."""
    dest = into / "onnxruntime_c_api.h"
    if dest.is_file():
        return dest
    deb = None
    errors = []
    for url in HEADER_URLS:
        try:
            with urllib.request.urlopen(url, timeout=20) as r:  # noqa: S310 - pinned http(s) URLs, sha256-checked
                data = r.read()
        except (OSError, http.client.HTTPException) as e:  # an unreachable host, or a download cut short
            errors.append(f"{url}: {e or type(e).__name__}")
            continue
        if hashlib.sha256(data).hexdigest() != HEADER_SHA256:
            errors.append(f"{url}: sha256 mismatch")
            continue
        deb = data
        break
    if deb is None:
        raise LinesideError(f"could not fetch onnxruntime's C API header ({'; '.join(errors)}): check the network "
                            f"or put onnxruntime_c_api.h in {into}")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.write_bytes(_member(_deb_data(deb), HEADER_MEMBER))
    os.replace(tmp, dest)  # whole or not there: a cut-short header would fail every later build
    return dest


def _deb_data(deb: bytes) -> bytes:
    """The data.tar.* member of a .deb (an ar archive: 8-byte magic, then 60-byte headers)."""
    if not deb.startswith(b"!<arch>\n"):
        raise LinesideError("the header package is not a .deb")
    at = 8
    while at + 60 <= len(deb):
        name = deb[at:at + 16].decode().strip().rstrip("/")
        size = int(deb[at + 48:at + 58].decode().strip())
        body = deb[at + 60:at + 60 + size]
        if name.startswith("data.tar"):
            return body
        at += 60 + size + (size & 1)
    raise LinesideError("the header package has no data.tar member")


def _member(tar_bytes: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        f = tar.extractfile(name)
        if f is None:
            raise LinesideError(f"the header package has no {name}")
        return f.read()


def build(force: bool = False) -> Path:
    """Compile the kernel for this host (a C compiler and the header download needed); its path."""
    why = host_ok()
    if why is not None:
        raise LinesideError(f"the rows kernel is not for this host: {why}")
    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if cc is None:
        raise LinesideError(f"no C compiler ({os.environ.get('CC') or 'cc'}) found: install one (Debian: apt-get "
                            f"install gcc) to build the rows kernel")
    errors = []
    for dest in _candidates():
        if dest.is_file() and not force:
            return dest
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            headers = dest.parent / "include"
            headers.mkdir(exist_ok=True)
            _header(headers)
            fd, tmp = tempfile.mkstemp(prefix=".librows.", suffix=".so", dir=dest.parent)
            os.close(fd)
        except OSError as e:
            errors.append(f"{dest.parent}: {e.strerror or e}")
            continue
        cmd = [cc, *FLAGS, "-I", str(headers), str(SOURCE), "-o", tmp, "-lm", "-lpthread"]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            Path(tmp).unlink(missing_ok=True)
            first = (run.stderr.strip().splitlines() or ["no output"])[0]
            raise LinesideError(f"compiling the rows kernel failed ({first})")
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
        if dest.parent == BUILD_DIR:  # this checkout's earlier builds (a server running one keeps it open); the
            for old in dest.parent.glob("librows-*.so"):  # per-user cache is shared with other checkouts: kept
                if old != dest:
                    old.unlink(missing_ok=True)
        _library_cached.cache_clear()
        return dest
    raise LinesideError(f"nowhere to put the rows kernel ({'; '.join(errors)})")


def main() -> int:
    """``python -m lineside.runtime.rows_kernel [--force]``: build it, or say in one line why not (exit 0 when the
    host cannot use it: onnxruntime's kernel serves there)."""
    why = host_ok()
    if why is not None:
        print(f"rows kernel: not built, {why} (onnxruntime's 4-bit kernel serves)")
        return 0
    try:
        path = build(force="--force" in sys.argv[1:])
    except LinesideError as e:
        print(f"rows kernel: not built: {e}", file=sys.stderr)
        return 1
    print(f"rows kernel: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
