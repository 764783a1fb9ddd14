"""The memory planner: will this model, quantization, context and batch fit on that device?

MODEL is a Hugging Face checkpoint directory, a lineside bundle, a config.json, or the name of a
config shipped in ``lineside/data/configs`` (e.g. ``DeepSeek-R1-Distill-Qwen-7B``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

from lineside.bundle import MANIFEST, Manifest, read_manifest
from lineside.config import ModelConfig, family_of, load_hf_config
from lineside.errors import ConfigError, LinesideError
from lineside.jetson.devices import Device, get_device
from lineside.jetson.sizes import (
    DENSE_LINEAR_NAMES,
    Grid,
    KVSizes,
    KvStorage,
    WeightSizes,
    check_kv_dtype,
    check_quant,
    dense_activations,
    dense_kv,
    dense_weights,
)
from lineside.jetson.sizes_v4 import V4Shape, v4_activations, v4_kv, v4_weights

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "data" / "configs"


@dataclass
class ModelSpec:
    """What the planner needs to know about a model, whatever form it came in."""

    name: str
    architecture: str
    max_positions: int
    weights: Callable[[str, Grid], WeightSizes]
    kv: Callable[[int, int, int], KVSizes]
    activations: Callable[..., int]  # (ctx, batch, prefill_chunk): lineside's TensorRT step
    quantization: str | None = None  # from a bundle's manifest, when known
    grid: Grid | None = None  # a bundle's real quantization grid, when known
    kv_dtype: str | None = None  # a bundle's KV-cache dtype (`build --kv-dtype`), when known
    weights_as_built: Callable[[str, Grid], WeightSizes] | None = None  # a bundle's, some linears carried as they were
    context_from: str = "max_position_embeddings"  # what max_positions is


@dataclass
class Plan:
    """The answer to one planning question (all sizes in bytes)."""

    model: str
    architecture: str
    device: str
    device_name: str
    quant: str
    kv_dtype: str
    ctx: int
    batch: int
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    runtime_overhead_bytes: int
    total_bytes: int
    device_bytes: int
    device_memory_bytes: int
    unified_memory: bool
    fits: bool
    headroom_bytes: int
    max_context_at_batch: int
    max_batch_at_context: int
    model_max_context: int
    prefill_chunk: int = 512  # prompt tokens per step the plan counts (--max-prefill of the engine)
    prefill_chunk_picked: bool = False  # True: not pinned, the largest of PREFILL_CHUNKS that fits
    engine_args: str = ""  # `lineside engine BUNDLE ...` options that build what was planned
    weights_breakdown: dict[str, int] = field(default_factory=dict)
    kv_breakdown: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shipped_configs() -> list[str]:
    """Names of the configs shipped with lineside."""
    return sorted(p.name for p in CONFIGS_DIR.iterdir() if (p / "config.json").is_file())


def _spec_from_hf(d: dict[str, Any], name: str, quantization: str | None = None) -> ModelSpec:
    family = family_of(d)
    if family == "deepseek_v4":
        s = V4Shape.from_raw(d)
        return ModelSpec(
            name, family, s.max_positions,
            lambda q, g: v4_weights(s, q, g),
            lambda c, b, k: v4_kv(s, c, b, k),
            lambda c, b, p: v4_activations(s, c, b, p),
            quantization,
        )
    cfg = ModelConfig.from_hf_dict(d, name=name)
    return _spec_from_config(cfg, quantization)


def _spec_from_config(cfg: ModelConfig, quantization: str | None = None) -> ModelSpec:
    if cfg.architecture == "deepseek_v4":
        if not cfg.raw:
            raise ConfigError("DeepSeek-V4 bundle config has no raw Hugging Face fields; rebuild the bundle")
        return _spec_from_hf(cfg.raw, cfg.name, quantization)
    return ModelSpec(
        cfg.name, cfg.architecture, cfg.max_position_embeddings,
        lambda q, g: dense_weights(cfg, q, g),
        lambda c, b, k: dense_kv(cfg, c, b, k),
        lambda c, b, p: dense_activations(cfg, c, b, p),
        quantization,
    )


GGML_4BIT = {"Q4_0": 1, "Q4_1": 2}  # fp16 values per block of 32: scale (Q4_0), scale + minimum (Q4_1)
GGML_8BIT = "Q8_0"  # 8-bit codes and one scale per block of 32, carried as they are (not re-quantized to --quant)


def bundle_grid(manifest: Manifest) -> Grid | None:
    """The grid a bundle's linears really have: the trt flavor's group size when it has one (what TensorRT
    runs), else a GGUF 4-bit grid carried into the cpu flavor (blocks of 32; read from ``quantization.grid``,
    or from ``carried_from_source`` for bundles built before that was recorded), else its group size."""
    q = manifest.quantization
    if not isinstance(q, dict):
        return None
    gs = q.get("group_size")
    if "trt" in manifest.flavors and isinstance(gs, int) and gs > 0:
        return Grid(gs, 1, "the bundle's trt grid")
    g = q.get("grid")
    if isinstance(g, dict) and isinstance(g.get("block_size"), int) and g["block_size"] > 0:
        mins = 2 if "minimum" in str(g.get("per_block", "")) else 1
        return Grid(g["block_size"], mins, f"{g.get('source', 'carried')} grid from the bundle")
    kinds = _carried_linears(q)
    if kinds:
        kind = max(set(kinds), key=kinds.count)
        if kind in GGML_4BIT:
            return Grid(32, GGML_4BIT[kind], f"GGUF {kind} grid from the bundle")
        if kind == GGML_8BIT:
            return Grid(32, 1, f"GGUF {kind} blocks carried from the source")
    return Grid(gs, 1, "the bundle's group size") if isinstance(gs, int) and gs > 0 else None


def _carried_linears(q: dict[str, Any]) -> list[str]:
    """The GGML types a bundle's cpu graph carried its linears in (``carried_from_source``), 4- or 8-bit."""
    carried = q.get("carried_from_source")
    if not isinstance(carried, dict):
        return []
    return [str(k) for n, k in carried.items() if str(n).endswith("proj.weight") and (k in GGML_4BIT or k == GGML_8BIT)]


def _with_bundle(spec: ModelSpec, manifest: Manifest, cfg: ModelConfig | None = None) -> ModelSpec:
    """A bundle holds what it was built with: its grid, the linears its cpu graph carried from a GGUF in their own
    scheme (unless a trt flavor re-quantized them: TensorRT runs that one), and at most its max_seq_len of context."""
    spec.grid = bundle_grid(manifest)
    q: Any = manifest.quantization
    kv = (q.get("kv_cache") or {}) if isinstance(q, dict) else {}
    spec.kv_dtype = kv.get("dtype") if isinstance(kv, dict) and isinstance(kv.get("dtype"), str) else None
    carried = _carried_sizes(manifest)
    if carried and cfg is not None and cfg.architecture != "deepseek_v4":
        # the linears not carried were quantized at build, in the bundle's own groups (not the carried blocks)
        gs = q.get("group_size") if isinstance(q, dict) else None
        some_built = len(carried) < cfg.num_layers * len(DENSE_LINEAR_NAMES)
        built = Grid(gs, 1, "the bundle's group size") if some_built and isinstance(gs, int) and gs > 0 else None
        spec.weights_as_built = lambda q, g: dense_weights(cfg, q, built or g, carried)
    mx = manifest.max_seq_len
    if isinstance(mx, int) and 0 < mx:
        spec.max_positions = min(spec.max_positions, mx) if spec.max_positions else mx
        spec.context_from = "the bundle's max_seq_len"
    return spec


def _carried_sizes(manifest: Manifest) -> dict[str, tuple[str, Grid]]:
    """Linear name → (scheme, grid) for each one the cpu graph carried from a GGUF (none when a trt flavor is
    built: its graph re-quantizes every linear)."""
    q = manifest.quantization
    if not isinstance(q, dict) or "trt" in manifest.flavors or not isinstance(q.get("carried_from_source"), dict):
        return {}
    out = {}
    for name, kind in q["carried_from_source"].items():
        if str(name).endswith("proj.weight") and kind in GGML_4BIT:
            out[str(name)] = ("w4a16", Grid(32, GGML_4BIT[kind], f"GGUF {kind} blocks"))
        elif str(name).endswith("proj.weight") and kind == GGML_8BIT:
            out[str(name)] = ("w8a16", Grid(32, 1, f"GGUF {kind} blocks"))
    return out


def _bundle_quant(manifest: Manifest) -> str | None:
    """The scheme the bundle's linears were built in: the one asked for, unless (no trt flavor re-quantizing them)
    the cpu graph carried every linear from GGUF Q8_0 at 8 bits (the build summary's w8a16): then w8a16. When
    only some were, the others are in the scheme asked for (``ModelSpec.weights_as_built`` sizes each)."""
    q: Any = manifest.quantization
    kinds = _carried_linears(q) if isinstance(q, dict) and "trt" not in manifest.flavors else []
    if kinds and kinds.count(GGML_8BIT) == max(len(kinds), int(q.get("linears") or 0)):
        return "w8a16"
    if isinstance(q, dict):
        q = q.get("scheme") or q.get("quant") or q.get("name")
    return q if isinstance(q, str) else None


def load_model(model: str) -> ModelSpec:
    """Resolve MODEL (path or shipped name) to a ModelSpec; one-line errors for everything else."""
    p = Path(model)
    if not p.exists():
        lowered = {n.lower(): n for n in shipped_configs()}
        key = model.strip().lower().removeprefix("deepseek-ai/")
        if key in lowered:
            p = CONFIGS_DIR / lowered[key]
        else:
            raise LinesideError(
                f"{model}: no such file or directory, and not a shipped config "
                f"({', '.join(shipped_configs())}); pass a checkpoint dir, a bundle or a config.json"
            )
    if p.is_file() and p.name == MANIFEST:  # a bundle named by its manifest: plan the bundle
        p = p.parent
    if p.is_dir() and (p / MANIFEST).is_file():
        manifest = read_manifest(p)
        cfg_rel = manifest.config
        try:
            d = json.loads((p / cfg_rel).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise LinesideError(f"{p}: bundle config {cfg_rel} unreadable ({e}); rebuild the bundle") from None
        if isinstance(d, dict) and "architecture" in d and "architectures" not in d:
            cfg = _lineside_config(d, p / cfg_rel)
            return _with_bundle(_spec_from_config(cfg, _bundle_quant(manifest)), manifest, cfg)
        spec = _spec_from_hf(d, p.name, _bundle_quant(manifest))
        return _with_bundle(spec, manifest, None if spec.architecture == "deepseek_v4"
                            else ModelConfig.from_hf_dict(d, name=p.name))
    if p.is_dir():
        return _spec_from_hf(load_hf_config(p / "config.json"), p.name)
    if p.suffix == ".gguf":
        raise LinesideError(f"{p}: plan a GGUF through its bundle (`lineside build {p} -o BUNDLE`) or a config.json")
    d = load_hf_config(p)
    if "architecture" in d and "architectures" not in d and "model_type" not in d:
        return _spec_from_config(_lineside_config(d, p))
    name = p.parent.name if p.name == "config.json" else p.stem
    return _spec_from_hf(d, name)


def _lineside_config(d: dict, where: Path) -> ModelConfig:
    """A config.json as `lineside build` writes it into a bundle; one line when a field it needs is missing."""
    fields = ModelConfig.__dataclass_fields__.values()
    missing = [f.name for f in fields if f.name not in d and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise LinesideError(f"{where}: a lineside model config without {', '.join(missing)}; pass the bundle "
                            "directory, the checkpoint's own config.json or a shipped config name")
    return ModelConfig.from_json_dict(d)


# Prefill chunks the planner picks from when none is pinned: the engine's default (512) down to 64, where a
# 4-bit model's prefill step on an Orin stops being compute-bound (~4·t FLOP per weight byte read).
PREFILL_CHUNKS = (512, 256, 128, 64)


def _total(spec: ModelSpec, dev: Device, w: int, ctx: int, batch: int, kvb: KvStorage, chunk: int) -> int:
    return w + spec.kv(ctx, batch, kvb).total + spec.activations(ctx, batch, chunk) + dev.runtime_overhead_bytes


def _largest(fits: Callable[[int], bool], hi: int) -> int:
    """Largest n in [1, hi] with fits(n) (fits is monotone decreasing), or 0."""
    if hi < 1 or not fits(1):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _unbuildable_kv(kv_dtype: str) -> str:
    """Why the builder refuses a KV dtype the planner can size (fp8: TensorRT takes no FP8 network input), else ''."""
    from lineside.build.quant.kv import check_kv_flavors, parse_kv_dtype

    try:
        check_kv_flavors(parse_kv_dtype(kv_dtype), ("trt",))
    except LinesideError as e:
        return str(e).split(": ", 1)[-1]
    return ""


def plan(
    model: str | ModelSpec,
    device: str,
    quant: str | None = None,
    ctx: int | None = None,
    batch: int = 1,
    kv_dtype: str | None = None,
    group_size: int | None = None,
    prefill_chunk: int | None = None,
) -> Plan:
    """Size weights, KV cache, activations and overhead against the device's usable memory.

    ``prefill_chunk`` None: the largest of PREFILL_CHUNKS at which ctx x batch fits (attention scores grow
    with chunk x context), reported with the engine options that build it; the largest context and batch are then
    the ones the smallest chunk reaches."""
    spec = load_model(model) if isinstance(model, str) else model
    dev = get_device(device)
    q = check_quant(quant or spec.quantization or "w4a16")
    kv_dtype = kv_dtype or spec.kv_dtype or "fp16"  # a bundle's own cache unless asked otherwise
    kvb = check_kv_dtype(kv_dtype)
    if ctx is None:  # 4096, or all a shorter model/bundle has
        ctx = min(4096, spec.max_positions) if spec.max_positions > 0 else 4096
    if kvb.name == "fp8" and tuple(int(x) for x in dev.sm.split(".")[:2]) < (8, 9):
        raise LinesideError(f"--kv-dtype fp8: {dev.name} (SM {dev.sm}) has no FP8; use --kv-dtype int8")
    if ctx < 1 or batch < 1:
        raise LinesideError(f"--ctx and --batch must be at least 1 (got ctx={ctx}, batch={batch})")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise LinesideError("--prefill-chunk must be at least 1")
    if group_size is not None and (group_size < 16 or group_size & (group_size - 1)):
        raise LinesideError(f"--group-size {group_size}: `lineside build` makes groups of a power of two ≥ 16 "
                            "(64 or 128 for the trt flavor); plan one of those")
    grid = Grid(group_size) if group_size is not None else (spec.grid or Grid(128))
    # a bundle is sized as it was built, its carried linears included; --quant / --group-size ask "what if rebuilt"
    as_built = spec.weights_as_built if quant is None and group_size is None else None
    w = (as_built or spec.weights)(q, grid)
    kv = spec.kv(ctx, batch, kvb)
    usable = dev.usable_bytes

    def fits_at(c: int, b: int, chunk: int) -> bool:
        return _total(spec, dev, w.total, c, b, kvb, chunk) <= usable

    picked = prefill_chunk is None
    if prefill_chunk is None:
        prefill_chunk = next((ch for ch in PREFILL_CHUNKS if fits_at(ctx, batch, ch)), PREFILL_CHUNKS[0])
    reach = PREFILL_CHUNKS[-1] if picked else prefill_chunk  # the chunk the longest context would be planned at
    act = spec.activations(ctx, batch, prefill_chunk)
    total = w.total + kv.total + act + dev.runtime_overhead_bytes
    max_ctx = _largest(lambda c: fits_at(c, batch, reach), spec.max_positions)  # never above the model's/bundle's
    max_batch = _largest(lambda b: fits_at(ctx, b, reach), 4096)
    notes = list(w.notes)
    if ctx > spec.max_positions:
        notes.append(f"ctx {ctx} exceeds {spec.context_from} {spec.max_positions}"
                     + ("; rebuild the bundle with a larger --max-seq-len (up to the model's own)"
                        if spec.context_from.startswith("the bundle") else ""))
    if dev.unified:
        notes.append("unified memory: CPU and GPU share it; device_bytes excludes the OS/firmware reserve")
    if picked and prefill_chunk < PREFILL_CHUNKS[0]:
        notes.append(f"prefill chunk {prefill_chunk} picked: {PREFILL_CHUNKS[0]} tokens per step do not fit at ctx "
                     f"{ctx} (attention scores grow with chunk x context); prompts take more, smaller steps")
    if picked and max_ctx:
        at = next((ch for ch in PREFILL_CHUNKS if fits_at(max_ctx, batch, ch)), reach)
        notes.append(f"the largest context ({max_ctx}) is planned at prefill chunk {at}")
    refused = _unbuildable_kv(kvb.name)
    if refused:
        notes.append(f"`lineside build --flavors trt --kv-dtype {kvb.name}` refuses this cache for now ({refused})")
    notes.append("building the engine on the device needs extra memory, about the weights again, once")
    return Plan(
        model=spec.name, architecture=spec.architecture, device=dev.key, device_name=dev.name,
        quant=q, kv_dtype=kv_dtype.lower(), ctx=ctx, batch=batch,
        weights_bytes=w.total, kv_cache_bytes=kv.total, activation_bytes=act,
        runtime_overhead_bytes=dev.runtime_overhead_bytes, total_bytes=total,
        device_bytes=usable, device_memory_bytes=dev.memory_bytes, unified_memory=dev.unified,
        fits=total <= usable and ctx <= spec.max_positions, headroom_bytes=usable - total,
        max_context_at_batch=max_ctx, max_batch_at_context=max_batch, model_max_context=spec.max_positions,
        prefill_chunk=prefill_chunk, prefill_chunk_picked=picked,
        engine_args=f"--slots {batch} --max-prefill {min(ctx, prefill_chunk)}",
        weights_breakdown=w.breakdown, kv_breakdown=kv.breakdown, notes=notes,
    )


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def format_plan(p: Plan) -> str:
    """Human-readable plan (the --json form has every field)."""
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    lines = [
        f"{p.model} ({p.architecture}) on {p.device_name} [{p.device}], {p.quant}, KV {p.kv_dtype}, "
        f"ctx {p.ctx} x batch {p.batch}: {verdict}",
        f"  weights      {gib(p.weights_bytes):>12}  "
        + ", ".join(f"{k} {gib(v)}" for k, v in p.weights_breakdown.items() if v),
        f"  KV cache     {gib(p.kv_cache_bytes):>12}",
        f"  activations  {gib(p.activation_bytes):>12}  at prefill chunk {p.prefill_chunk}"
        + (" (picked; pin one with --prefill-chunk)" if p.prefill_chunk_picked else ""),
        f"  runtime      {gib(p.runtime_overhead_bytes):>12}",
        f"  total        {gib(p.total_bytes):>12}  of {gib(p.device_bytes)} usable "
        f"({gib(p.device_memory_bytes)} {'unified' if p.unified_memory else 'GPU'} memory)",
        f"  largest context at batch {p.batch}: {p.max_context_at_batch}; "
        f"largest batch at ctx {p.ctx}: {p.max_batch_at_context}",
    ]
    lines.append(f"  engine: lineside engine BUNDLE {p.engine_args}  (serve runs prefill chunks of at most the "
                 f"engine's --max-prefill; on the device: LINESIDE_ENGINE_ARGS='{p.engine_args}')")
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def parse_columns(text: str) -> list[tuple[str, str]]:
    """``DEVICE:KV_DTYPE,...`` (``jetson table --kv-columns``) as (device, kv dtype) pairs, each checked."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        dev, sep, kv = item.partition(":")
        if not sep or not dev.strip() or not kv.strip():
            raise LinesideError(f"--kv-columns {item!r}: give DEVICE:KV_DTYPE, e.g. orin-nano-8:int8")
        out.append((get_device(dev).key, check_kv_dtype(kv).name))
    return out


def fit_table(devices: list[str], quant: str = "w4a16", ctx: int = 4096, batch: int = 1,
              kv_dtype: str = "fp16", kv_columns: list[tuple[str, str]] | None = None) -> str:
    """Markdown table, smallest model first: weights, KV at ctx, and per device whether ctx x batch fits
    (with the largest context that fits at that batch); ``kv_columns`` adds (device, KV dtype) columns."""
    extra = list(kv_columns or [])
    if not devices and not extra:
        raise LinesideError("the table names no device: give --devices a comma list (e.g. orin-nano-8,agx-orin-64) "
                            "or --kv-columns DEVICE:KV_DTYPE")
    columns = ["model", "weights", "KV @ ctx", *devices, *(f"{d} KV {k}" for d, k in extra)]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    specs = sorted((load_model(n) for n in shipped_configs()), key=lambda s: s.weights(quant, 128).total)
    for spec in specs:
        name = spec.name
        cells = []
        first = None
        for d, kv in [(d, kv_dtype) for d in devices] + extra:
            p = plan(spec, d, quant, ctx, batch, kv)
            first = first or p
            cells.append(f"yes (max ctx {_short(p.max_context_at_batch)})" if p.fits else
                         (f"no (max ctx {_short(p.max_context_at_batch)})" if p.max_context_at_batch else "no"))
        rows.append(f"| {name} | {gib(first.weights_bytes)} | {gib(first.kv_cache_bytes)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def plan_with_fallback(primary: Plan, fallback: Plan) -> dict[str, Any]:
    """Both bundles resident together (`serve --fallback`): their weights, KV and activations add up, the
    runtime overhead is paid once."""
    total = primary.total_bytes + fallback.total_bytes - fallback.runtime_overhead_bytes
    return {"primary": primary.to_dict(), "fallback": fallback.to_dict(), "total_bytes": total,
            "device_bytes": primary.device_bytes, "fits": primary.fits and fallback.fits and total <= primary.device_bytes,
            "headroom_bytes": primary.device_bytes - total}


def format_plan_with_fallback(pair: dict[str, Any], primary: Plan, fallback: Plan) -> str:
    verdict = "FITS" if pair["fits"] else "DOES NOT FIT"
    return "\n".join([format_plan(primary), "fallback:", format_plan(fallback),
                      f"primary + fallback: {gib(pair['total_bytes'])} of {gib(pair['device_bytes'])} usable "
                      f"(runtime counted once): {verdict}"])
