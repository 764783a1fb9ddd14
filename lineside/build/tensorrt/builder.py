"""ONNX → TensorRT engine on the target GPU: profiles from the bundle, fp16 + INT4 weight-only,
a builder memory limit, a timing cache kept in the bundle, progress bars, and the engine.json.

The INT4 weights reach TensorRT as ``DequantizeLinear`` (INT4, block 64/128, zero point 0) in
front of each MatMul: the parser turns them into IDequantizeLayer with INT4 weights, which
TensorRT fuses into weight-only GEMMs; no calibration is involved.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from lineside.build.tensorrt.check import check_bundle
from lineside.build.tensorrt.profiles import (
    BUCKET_STEP,
    FIRST_BUCKET,
    Limits,
    ProfileSpec,
    derive_limits,
    derive_profiles,
)
from lineside.build.tensorrt.progress import end_build, make_monitor
from lineside.build.tensorrt.reuse import builder_settings, reusable_engine, wanted_settings
from lineside.bundle import Bundle, open_bundle
from lineside.console_line import say
from lineside.errors import LinesideError
from lineside.file_lock import LockState, lock_exclusive
from lineside.runtime.graph_context import check_rope_positions
from lineside.runtime.tensorrt.buffers import check_kv_support, kv_dtype_of
from lineside.runtime.tensorrt.env import import_tensorrt
from lineside.runtime.tensorrt.key import (
    ENGINE_FILE,
    ENGINE_JSON,
    TIMING_CACHE,
    MachineKey,
    engine_dir,
    engine_seal,
    graph_files_sha,
    lora_engine_dir,
    machine_key,
    user_engines,
)
from lineside.user_cache import ENV_DIR as USER_CACHE_ENV

BUILD_LOCK = ".build.lock"  # in the engine directory: one build of an engine at a time


class EngineBuildError(LinesideError):
    """TensorRT could not parse the graph or build an engine for it."""


@dataclass
class BuildOptions:
    num_slots: int = 4
    max_prefill: int | None = None
    max_logits: int | None = None
    fp16: bool = True
    workspace_gb: float | None = None  # builder memory pool limit; None = TensorRT's default (device memory)
    opt_level: int | None = None  # builder optimization level 0-5 (TensorRT default 3)
    first_bucket: int = FIRST_BUCKET  # smallest past-length bucket (profiles' past_seq minimum)
    bucket_step: int = BUCKET_STEP  # past-length buckets grow by doubling up to this, then by this
    max_loras: int = 0  # > 0: the LoRA graph's engine with this many adapter slots (a separate engine)
    max_lora_rank: int | None = None  # their rank (default: the bundle's --max-lora-rank)


def table_for(trt_version: str) -> str:
    """Which op-support table to pre-check a graph against for this TensorRT."""
    return "10.3" if trt_version.startswith("10.3") else "newest"


def engine_meta(key: MachineKey, lim: Limits, profiles: list[ProfileSpec], opts: BuildOptions,
                graph_sha256: str | None, build_s: float, kv_dtype: str = "fp16") -> dict[str, Any]:
    """The engine.json written next to the engine (what the runtime checks before loading it)."""
    return {
        "key": key.key,
        "machine": key.to_dict(),
        "gpu_name": key.gpu_name,
        "compute_capability": key.compute_capability,
        "tensorrt": key.tensorrt,
        "cuda": key.cuda,
        "limits": lim.to_dict(),
        "profiles": [p.to_dict() for p in profiles],
        "fp16": opts.fp16,
        "kv_dtype": kv_dtype,
        "builder": builder_settings(opts.workspace_gb, opts.opt_level),
        "graph_sha256": graph_sha256,
        "build_seconds": round(build_s, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _parse(trt: Any, network: Any, parser: Any, graph: Path) -> None:
    if parser.parse_from_file(str(graph)):
        return
    errs = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = e.node_name() if hasattr(e, "node_name") else str(e.node())
        op = e.node_operator() if hasattr(e, "node_operator") else "?"
        errs.append(f"node {node or '?'} ({op}): {e.desc()}")
    first = errs[0] if errs else "unknown parser error"
    more = f" (+{len(errs) - 1} more; run `lineside check` for the full list)" if len(errs) > 1 else ""
    raise EngineBuildError(f"TensorRT could not parse {graph.name}: {first}{more}")


@dataclass(frozen=True)
class EngineOutcome:
    """Where the engine is, and whether this run built it or found one of the same settings (another build's)."""

    path: Path
    built: bool


def build_engine(bundle_path: Path, opts: BuildOptions | None = None, console: Console | None = None,
                 force: bool = False) -> Path:
    """Build ``engines/<key>/model.engine`` for this machine; returns the engine directory."""
    return ensure_built(bundle_path, opts, console, force).path


def ensure_built(bundle_path: Path, opts: BuildOptions | None = None, console: Console | None = None,
                 force: bool = False) -> EngineOutcome:
    """Build the engine unless, once its build lock is held, a good one of these settings is there (another
    `lineside engine` or `jetson ensure-engine` built it meanwhile: minutes saved on an Orin); ``force``: build."""
    opts = opts or BuildOptions()
    console = console or Console(stderr=True)
    bundle: Bundle = open_bundle(bundle_path)
    fl = bundle.flavor("trt")
    trt = import_tensorrt()
    key = machine_key()
    check_kv_support(fl.state, key.compute_capability)  # fp8 KV on Orin: refused before any build work
    check_rope_positions(bundle.file(fl.graph), fl.graph, bundle.max_seq_len,
                         bundle.config.context_limit)  # the profiles would span max_seq_len
    pre = check_bundle(bundle, table_for(key.tensorrt))
    if not pre.ok:  # advisory: the documented tables can lag the parser, which has the last word below
        for o in pre.offenders[:5]:
            say(console, f"warning: node {o.node} ({o.op}, {o.dtypes}): {o.reason}", style="yellow")
        say(console, f"warning: {pre.summary()} per onnx-tensorrt's documentation "
                      f"(`lineside check {bundle_path} --trt {table_for(key.tensorrt)}` lists all); building anyway", style="yellow")
    cfg = bundle.config
    lim = derive_limits(bundle.max_seq_len, cfg.vocab_size, opts.num_slots, opts.max_prefill, opts.max_logits,
                        opts.first_bucket, opts.bucket_step)
    graph, graph_sha, lora_meta, lora_shapes = fl.graph, bundle.manifest.graph_sha("trt"), None, None
    if opts.max_loras:
        graph, lora_meta, lora_shapes = _lora_engine_inputs(bundle, opts)
        graph_sha = bundle.manifest.files[graph].sha256
    out = engine_dir(bundle.path, key) if lora_meta is None else \
        lora_engine_dir(bundle.path, key, lora_meta["max_loras"], lora_meta["max_rank"])
    out = _writable_out(bundle, out, console)
    profiles = derive_profiles(fl, bundle.config, lim, lora_shapes)
    wanted = wanted_settings(lim.to_dict(), [p.to_dict() for p in profiles], opts.fp16, kv_dtype_of(fl.state),
                             lora_meta, builder_settings(opts.workspace_gb, opts.opt_level))
    lock_fd = os.open(out / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited = lock_exclusive(lock_fd, wait=False) == LockState.BUSY
        if waited:
            say(console, f"waiting for another `lineside engine` building {out} to finish")
            lock_exclusive(lock_fd, wait=True)
        # checked under the lock: the other build has written its engine.json (or given up) by now
        if not force and reusable_engine(out, key, graph_sha, graph_files_sha(bundle.manifest), wanted):
            who = "another `lineside engine` built it while this one waited" if waited else "already built"
            say(console, f"{out} holds this machine's engine with these settings ({who}): using it; "
                         "--force rebuilds it")
            return EngineOutcome(out, built=False)
        _build_locked(trt, key, bundle, fl, graph, graph_sha, lora_meta, lim, profiles, opts, out, console)
    finally:
        os.close(lock_fd)  # releases the lock
    return EngineOutcome(out, built=True)


def _writable_out(bundle: Bundle, out: Path, console: Console) -> Path:
    """``out`` when the bundle's engines/ can be written to; else (a read-only mount, another user's bundle) the
    same engine directory in the per-user cache, said in one line, before minutes of building are spent."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=out)
        os.close(fd)
        os.unlink(probe)
        return out
    except OSError as e:
        why = e.strerror or type(e).__name__
    root = user_engines(graph_files_sha(bundle.manifest), make=True)
    if root is None:
        raise EngineBuildError(f"{bundle.path} can't be written to ({why}) and there is no per-user cache to keep its "
                               f"engine in; mount the bundle writable, or set {USER_CACHE_ENV} to a directory only "
                               "you can write to")
    mine = root / out.name
    mine.mkdir(exist_ok=True)
    say(console, f"note: {bundle.path} can't be written to ({why}): the engine goes to {mine}")
    return mine


def _build_locked(trt: Any, key: MachineKey, bundle: Bundle, fl: Any, graph: str, graph_sha: str | None,
                  lora_meta: dict[str, int] | None, lim: Limits, profiles: list[ProfileSpec],
                  opts: BuildOptions, out: Path, console: Console) -> None:
    """Build and write the engine into ``out`` while holding its build lock (a second build waits, so neither
    writes over the other's files)."""

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = int(trt.__version__.split(".")[0]) >= 11  # TensorRT 11: strongly typed only
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    _parse(trt, network, parser, bundle.file(graph))

    config = builder.create_builder_config()
    if opts.workspace_gb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(opts.workspace_gb * (1 << 30)))
    if opts.fp16 and not strongly_typed:
        config.set_flag(trt.BuilderFlag.FP16)
    if opts.opt_level is not None:
        config.builder_optimization_level = int(opts.opt_level)
    cache_path = out / TIMING_CACHE
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    monitor = make_monitor(trt, console)
    config.progress_monitor = monitor
    for spec in profiles:
        prof = builder.create_optimization_profile()
        for name, (mn, op, mx) in spec.shapes.items():
            prof.set_shape(name, mn, op, mx)
        config.add_optimization_profile(prof)

    t0 = time.time()
    try:
        serialized = builder.build_serialized_network(network, config)
    finally:
        end_build(monitor)  # a Ctrl-C during the build cancelled it: an interrupt, not "built no engine"
    if serialized is None:
        raise EngineBuildError(
            f"TensorRT {key.tensorrt} built no engine for {key.gpu_name} (SM {key.compute_capability}); the "
            "log above names the layer — often no INT4 weight-only tactic on this GPU: rebuild the bundle with "
            "--quant w8a16 or fp16, or use --backend onnxruntime")
    # engine.json is what makes the directory an engine (key.list_engines): the one of an engine being replaced
    # goes first, so an interruption before the new one is written leaves no engine, not the new engine under
    # the old record's slots and profiles.
    plan = bytes(serialized)
    (out / ENGINE_JSON).unlink(missing_ok=True)
    _atomic_write(out / ENGINE_FILE, plan)
    _atomic_write(cache_path, bytes(config.get_timing_cache().serialize()))
    meta = engine_meta(key, lim, profiles, opts, graph_sha, time.time() - t0, kv_dtype=kv_dtype_of(fl.state))
    meta.update(engine_seal(plan), content_sha256=graph_files_sha(bundle.manifest))
    if lora_meta is not None:
        meta["lora"] = lora_meta
    _atomic_write(out / ENGINE_JSON, json.dumps(meta, indent=2).encode())


def _lora_engine_inputs(bundle: Bundle, opts: BuildOptions) -> tuple[str, dict[str, int], dict[str, tuple[int, ...]]]:
    """The LoRA graph, the engine.json record of its slots, and the fixed shapes of its stacked adapter inputs."""
    from lineside.lora import LoraTarget
    from lineside.runtime.onnxruntime_backend import lora_graph_of
    from lineside.runtime.tensorrt.lora_buffers import lora_input_shapes

    graph = lora_graph_of(bundle, "trt")
    assert bundle.manifest.lora is not None
    rank = int(opts.max_lora_rank or bundle.manifest.lora.max_rank)
    targets = tuple(LoraTarget(t) for t in bundle.manifest.lora.targets)
    shapes = lora_input_shapes(bundle.config, targets, opts.max_loras, rank)
    return graph, {"max_loras": int(opts.max_loras), "max_rank": rank}, shapes


def _atomic_write(path: Path, data: bytes) -> None:
    """``path`` whole or not at all, through a temporary file of its own (removed when the write fails: an engine
    is gigabytes) and flushed to disk before the rename, so a power cut leaves the old file or the new one."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        need = f" ({len(data) / (1 << 20):.0f} MiB)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise EngineBuildError(f"could not write {path}{need}: {e.strerror or type(e).__name__}; the engine was "
                               f"built but not kept: free space in {path.parent} (or fix its permissions) and run "
                               "`lineside engine` again") from None
