"""checkpoint → bundle: read lazily, quantize per tensor, emit each flavor's graph, write the manifest.

The bundle is assembled in ``<out>.partial`` and renamed into place at the end, so a failed
or interrupted build never leaves a half-written bundle where a good one is expected.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lineside import __version__
from lineside.build.checkpoint import CheckpointReader, open_checkpoint
from lineside.build.models import model_family
from lineside.build.models.family import ModelFamily, Weight, WeightGetter, WeightSource
from lineside.build.models.rope import dynamic_past_context
from lineside.build.quant.spec import QuantSpec
from lineside.build.tensors import GGMLBlocks
from lineside.bundle import (
    DRAFT_GRAPHS,
    MTP_GRAPH,
    FlavorEntry,
    LoraGraphs,
    Manifest,
    holds_bundle,
    read_manifest,
    write_manifest,
)
from lineside.cli_checks import claim_staging, normalized, replace_dir
from lineside.config import DENSE_FAMILIES, ModelConfig
from lineside.errors import CheckpointError, LinesideError
from lineside.lora import ALL_TARGETS, LoraTarget

if TYPE_CHECKING:  # the calibrations are imported only when a build asks for one
    from lineside.build.quant.calibrate import AwqPlan
    from lineside.build.quant.calibrate_gptq import GptqPlan

FLAVORS = ("cpu", "trt")
CARRYABLE = {"Q4_0", "Q4_1", "Q8_0"}


@dataclass
class BuildOptions:
    """What `lineside build` was asked for (plain data, so build_engine.py and tests share it)."""

    quant: str = "w4a16"
    group_size: int = 128
    method: str = "rtn"
    calib: Path | None = None
    flavors: tuple[str, ...] = ("cpu",)
    max_seq_len: int | None = None
    requantize: bool = False  # force re-quantizing a GGUF that is already 4-bit
    accuracy_level: int = 4
    lm_head_bits: int | None = None  # w4a16's LM head: 8 (None: the default) or 4; only w4a16 has the choice
    kv_dtype: str = "fp16"
    draft_layers: tuple[int, ...] = ()  # layerskip draft graphs: the first N layers + final norm + LM head
    force: bool = False
    max_lora_rank: int = 0  # > 0: also emit each flavor's LoRA graph (graph/lora.py); the slots' default rank
    lora_targets: tuple[LoraTarget, ...] | None = None  # None: ALL_TARGETS; given, it needs max_lora_rank
    # the cpu flavor's int8 variant for prompt chunks (graph/prefill.py), dense families; None: at accuracy level 4
    prefill_graph: bool | None = None

    @property
    def builds_prefill_graph(self) -> bool:
        """Whether the cpu flavor gets the int8 prompt graph: asked for, or by default where the 4-bit graph's
        activations are int8 already (accuracy level 4). Levels 0-3 keep float activations, the exactness the
        option promises: int8 prompts would put every answer's first token ~5% off its decode steps' logits."""
        return self.accuracy_level == 4 if self.prefill_graph is None else self.prefill_graph

    def validate(self) -> None:
        if self.quant not in ("fp32", "fp16", "w8a16", "w4a16"):
            raise LinesideError(f"--quant {self.quant!r} is not one of fp32, fp16, w8a16, w4a16")
        if self.method not in ("rtn", "awq", "gptq"):
            raise LinesideError(f"--method {self.method!r} is not one of rtn, awq, gptq")
        if self.method == "gptq" and self.quant != "w4a16":
            raise LinesideError(f"--method gptq writes INT4 weights; use it with --quant w4a16, not {self.quant}")
        if self.method == "awq" and self.quant not in ("w4a16", "w8a16"):
            raise LinesideError(f"--method awq scales weights for integer quantization; use it with --quant w4a16 or "
                                f"w8a16, not {self.quant} (which keeps float weights)")
        bad = [f for f in self.flavors if f not in FLAVORS]
        if bad or not self.flavors:
            raise LinesideError(f"--flavors {','.join(self.flavors)!r}: choose from {', '.join(FLAVORS)}")
        if self.group_size < 16 or self.group_size & (self.group_size - 1):
            raise LinesideError(f"--group-size {self.group_size} must be a power of two ≥ 16 (64 or 128 for trt)")
        if "trt" in self.flavors and self.quant == "w4a16" and self.group_size not in (64, 128):
            raise LinesideError(f"--group-size {self.group_size}: TensorRT INT4 needs 64 or 128 for the trt flavor")
        if self.lm_head_bits not in (None, 4, 8):
            raise LinesideError(f"--lm-head-bits {self.lm_head_bits}: choose 4 or 8")
        if self.lm_head_bits is not None and self.quant != "w4a16":
            raise LinesideError(f"--lm-head-bits: only --quant w4a16 has an INT8/INT4 choice of LM head ({self.quant} "
                                f"keeps it {'8-bit' if self.quant == 'w8a16' else 'float'}); leave the option out")
        from lineside.build.quant.kv import check_kv_flavors, parse_kv_dtype

        check_kv_flavors(parse_kv_dtype(self.kv_dtype), self.flavors)
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise LinesideError("--max-seq-len must be at least 2")
        if any(n < 1 for n in self.draft_layers):
            raise LinesideError(f"--draft-layers {min(self.draft_layers)}: a draft needs at least 1 layer")
        if not 0 <= self.max_lora_rank <= 1024:
            raise LinesideError(f"--max-lora-rank {self.max_lora_rank} must be 0 (no LoRA graphs) to 1024")
        if self.calib is not None and not Path(self.calib).is_file():
            raise LinesideError(f"--calib {self.calib}: file not found")
        if self.calib is not None and self.method == "rtn" and not (self._calibrates_kv() or self.calibrates_prefill):
            raise LinesideError("--calib: --method rtn reads no calibration text here (no int8 prefill graph is "
                                "built); pass --method awq or gptq, or leave --calib out")
        if self.prefill_graph and (self.quant not in ("w4a16", "w8a16") or "cpu" not in self.flavors):
            # the int8 prompt graph is the cpu flavor's, beside its integer linears: asked for elsewhere, it was
            # silently not built
            raise LinesideError(f"--prefill-graph: the int8 prompt graph is built for the cpu flavor of a w4a16 or "
                                f"w8a16 build, not --quant {self.quant} --flavors {','.join(self.flavors)}; leave "
                                "the option out")
        if self.lora_targets is not None and not self.max_lora_rank:
            raise LinesideError("--lora-targets: no LoRA graphs are built without --max-lora-rank R; pass one, or "
                                "leave --lora-targets out")

    @property
    def calibrates_prefill(self) -> bool:
        """The cpu flavor's int8 prefill graph picks each linear's int8 form on the calibration text
        (quant/smooth.py), whatever the method; Llama and Qwen2 only (build_bundle checks the model)."""
        return self.builds_prefill_graph and "cpu" in self.flavors and self.quant in ("w4a16", "w8a16")

    def _calibrates_kv(self) -> bool:
        """An int4 KV cache in the trt flavor centres its keys on the calibration text (quant/kv_calib.py)."""
        return self.kv_dtype.strip().lower() == "int4" and "trt" in self.flavors

    @property
    def targets(self) -> tuple[LoraTarget, ...]:
        return ALL_TARGETS if self.lora_targets is None else self.lora_targets


ProgressFactory = Callable[[str, int], Callable[[int], None]]


def _no_progress(_desc: str, _total: int) -> Callable[[int], None]:
    return lambda _n: None


def build_bundle(checkpoint: str | Path, out: str | Path, opts: BuildOptions,
                 progress: ProgressFactory = _no_progress, log: Callable[[str], None] = lambda _m: None) -> Path:
    """Build a bundle directory from a HF checkpoint directory or a GGUF file; returns its path."""
    opts.validate()
    if opts.requantize and not (_is_gguf(checkpoint) and "cpu" in opts.flavors and opts.quant == "w4a16"
                                and opts.method == "rtn"):
        raise LinesideError("--requantize does nothing here: it re-quantizes the GGUF blocks a cpu-flavor rtn w4a16 "
                            "build would carry as they are, and this build carries none; leave it out")
    out = normalized(Path(out))  # `-o .` / `-o ..`: staged beside the directory it replaces, not inside it
    t0 = time.time()
    ckpt = open_checkpoint(checkpoint)
    try:
        refuse_taken(out, opts.force)
    except LinesideError:
        ckpt.close()
        raise
    tmp: Path | None = None
    lock: int | None = None  # held while <out>.partial is this build's
    try:
        from lineside.build.checkpoint.gguf_file import GGUFCheckpoint

        if isinstance(ckpt, GGUFCheckpoint):
            ckpt.check_model_metadata()
        cfg = ModelConfig.from_hf_dict(ckpt.hf_config, name=_model_name(checkpoint, ckpt.hf_config))
        held = len(ckpt.names())
        if cfg.num_layers > held:  # each layer is tensors of its own: listing a config of 2**31 layers ran for minutes
            raise CheckpointError(f"{checkpoint}: the config has {cfg.num_layers} layers but the checkpoint holds "
                                  f"{held} tensors in all; config.json (a GGUF's block_count) describes another "
                                  "model or the checkpoint is incomplete (re-download it)")
        family = model_family(cfg.architecture)
        if cfg.architecture in DENSE_FAMILIES:
            cfg = _untied_if_head_differs(ckpt, cfg, log)
        family.check_config(cfg, opts.flavors)
        _check_draft_layers(opts.draft_layers, cfg, family)
        _check_kv_shape(opts.kv_dtype, cfg)
        if opts.max_lora_rank and cfg.architecture not in DENSE_FAMILIES:
            raise LinesideError(f"--max-lora-rank: LoRA graphs are built for Llama and Qwen2 models, not "
                                f"{cfg.architecture}; leave the option out")
        if opts.prefill_graph and cfg.architecture not in DENSE_FAMILIES:
            raise LinesideError(f"--prefill-graph: the int8 prompt graph is built for Llama and Qwen2 models, not "
                                f"{cfg.architecture}; leave the option out")
        if opts.calib is not None and opts.method == "rtn" and cfg.architecture not in DENSE_FAMILIES:
            # what an rtn build calibrates on it (the prefill graph, an int4 trt KV cache) is Llama and Qwen2's
            raise LinesideError(f"--calib: --method rtn reads no calibration text for {cfg.architecture}; leave "
                                "--calib out")
        if opts.lm_head_bits == 4 and cfg.architecture not in DENSE_FAMILIES:
            raise LinesideError(f"--lm-head-bits 4: {cfg.architecture} keeps its LM head at 8 bits (only Llama and "
                                "Qwen2 have the 4-bit choice); leave the option out")
        # Families with their own naming (V4: official or HF) return the source their graphs read.
        source = family.open_weights(cfg, ckpt, str(checkpoint))
        max_seq = int(opts.max_seq_len or min(cfg.max_position_embeddings, 4096))
        _check_context(max_seq, cfg)
        spec = QuantSpec(scheme=opts.quant, group_size=opts.group_size, method=opts.method,
                         accuracy_level=opts.accuracy_level,
                         lm_head_bits=8 if opts.lm_head_bits is None else opts.lm_head_bits,
                         kv_dtype=opts.kv_dtype.strip().lower())
        spec.check()
        carry_cpu = _carries(opts, spec)
        if source is None:
            _check_shapes(ckpt, family.required_tensors(cfg), spec,
                          tuple(f for f in opts.flavors if not (f == "cpu" and carry_cpu and _is_gguf(checkpoint))))
        staging = out.with_name(out.name + ".partial")
        lock = claim_staging(staging, out)  # refused while another build writes there (never removed under it)
        tmp = staging
        refuse_taken(out, opts.force)  # something put in -o since the look above (another build's bundle) stays
        _write_bundle(ckpt, checkpoint, cfg, family, source, spec, opts, max_seq, tmp, t0, progress, log)
        replace_dir(tmp, out)  # an existing bundle goes only once the new one is in its place
    except BaseException as e:
        # A failed or interrupted build leaves nothing behind (no half-written <out>.partial either).
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise LinesideError(_disk_full(out, e)) from None
        raise
    finally:
        if lock is not None:
            os.close(lock)
        ckpt.close()
    log(f"bundle written to {out} in {time.time() - t0:.1f}s")
    return out


def _disk_full(out: Path, e: OSError) -> str:
    """The line for a disk (or quota) that filled while the bundle was written: the error alone named no file, or
    the checkpoint's file a copy was reading, and did not say that the partial bundle is gone."""
    kept = (" (the bundle that was there is kept: --force needs room for both until the new one is complete)"
            if out.exists() else "")
    return (f"{e.strerror or 'no space left'} in {out.parent} while writing the bundle {out.name}; the partial bundle "
            f"was removed{kept} — free some space there (df -h {out.parent}) or choose another -o")


def refuse_taken(out: Path, force: bool) -> None:
    """One line when ``out`` holds something the build must keep: anything without --force, and with it anything
    but a bundle (a user's directory named by mistake is never deleted to make room)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        raise LinesideError(f"{out} exists and is not empty; choose another -o or pass --force to replace it")
    if not out.is_dir() or not holds_bundle(out):
        raise LinesideError(f"-o {out} is not a lineside bundle (no lineside manifest.json), so --force does not replace it: "
                            "it may hold your own files; choose another -o, or remove it yourself")


def _write_bundle(ckpt: CheckpointReader, checkpoint: str | Path, cfg: ModelConfig, family: ModelFamily,
                  source: WeightSource | None, spec: QuantSpec,
                  opts: BuildOptions, max_seq: int, tmp: Path, t0: float, progress: ProgressFactory,
                  log: Callable[[str], None]) -> None:
    """Graphs, tokenizer, config and manifest of one bundle, written into ``tmp``."""
    tok = ckpt.write_tokenizer(tmp / "tokenizer")  # first: its checks are one line each, before the long steps
    plan = gplan = None
    if opts.quant in ("w4a16", "w8a16") and opts.method == "awq":
        from lineside.build.quant.calibrate import awq_scales_for

        plan = awq_scales_for(cfg, ckpt, spec, opts.calib, progress=progress, log=log)
    elif opts.method == "gptq":
        from lineside.build.quant.calibrate_gptq import gptq_plan_for

        gplan = gptq_plan_for(cfg, ckpt, spec, opts.flavors, opts.calib, progress=progress, log=log)
    key_means = None
    if spec.kv_dtype == "int4" and "trt" in opts.flavors and cfg.architecture in DENSE_FAMILIES:
        from lineside.build.quant.kv_calib import key_means_for

        key_means = key_means_for(cfg, ckpt, opts.calib, log)
    prefill_stats = None
    if opts.calibrates_prefill and cfg.architecture in DENSE_FAMILIES:
        from lineside.build.quant.smooth import prefill_calibration

        # the linears' inputs as the graph computes them: AWQ's scales folded into norms and up_proj change them
        get = ckpt.get if plan is None else (lambda n: plan.transform(n, ckpt.get(n)))
        prefill_stats = prefill_calibration(cfg, ckpt, get, opts.calib, progress)
    carried: dict[str, str] = {}
    flavors: dict[str, FlavorEntry] = {}
    for flavor in opts.flavors:
        getter = _weight_getter(ckpt, spec, flavor, opts, carried)
        if plan is not None:
            getter = (lambda g: (lambda n: plan.transform(n, g(n))))(getter)
        if gplan is not None and gplan.grids:  # GPTQ's INT4 grids go to the emitters as they are
            getter = (lambda g: (lambda n: gplan.transform(n, g)))(getter)
        rel = f"graphs/{flavor}/model.onnx"
        tick = progress(f"emit {flavor} graph", cfg.num_layers)
        kw: dict[str, Any] = {"draft_layers": opts.draft_layers} if opts.draft_layers else {}
        if opts.max_lora_rank:
            kw["lora_targets"] = opts.targets
            if plan is not None and plan.col_scale:  # the LoRA graph undoes AWQ's folded scales on its inputs
                kw["lora_x_scales"] = plan.col_scale
        if key_means is not None and flavor == "trt":
            kw["key_means"] = key_means
        if flavor == "cpu" and prefill_stats is not None:
            kw["prefill_stats"] = prefill_stats
        entry = family.emit_graph(cfg, source if source is not None else getter, spec, flavor, tmp / rel,
                                  max_seq, progress=tick, awq_scales=plan.input_scale if plan else None, **kw)
        for draft in entry.extra.get(DRAFT_GRAPHS, {}).values():  # written beside the graph, named by file
            draft["graph"] = f"graphs/{flavor}/{draft['graph']}"
        if MTP_GRAPH in entry.extra:
            entry.extra[MTP_GRAPH]["graph"] = f"graphs/{flavor}/{entry.extra[MTP_GRAPH]['graph']}"
        flavors[flavor] = replace(entry, graph=rel)
    (tmp / "config.json").write_text(cfg.to_json())
    manifest = Manifest(
        lineside_version=__version__,
        architecture=cfg.architecture,
        model_name=cfg.name,
        source={"path": str(checkpoint), "format": "gguf" if _is_gguf(checkpoint) else "hf"},
        quantization=_quant_record(spec, carried, cfg, plan, gplan,
                                   carried_grid=_carried_grid(family, cfg, source, carried, opts.flavors),
                                   linears=None if source is not None else len(_linears(family, cfg))),
        flavors=flavors,
        max_seq_len=max_seq,
        config="config.json",
        tokenizer={"dir": "tokenizer", **tok},
        build_seconds=round(time.time() - t0, 2),
        lora=LoraGraphs(max_rank=opts.max_lora_rank, targets=opts.targets) if opts.max_lora_rank else None,
    )
    write_manifest(tmp, manifest)


def _untied_if_head_differs(ckpt: CheckpointReader, cfg: ModelConfig, log: Callable[[str], None]) -> ModelConfig:
    """A config with tied embeddings whose checkpoint stores an lm_head.weight of other values: transformers (5.x)
    then keeps the stored head (it does not tie them), so the bundle computes with it too, and says so."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if not (cfg.tie_word_embeddings and ckpt.has(head) and ckpt.has(embed)):
        return cfg
    if tuple(ckpt.shape(head)) != tuple(ckpt.shape(embed)):
        return cfg  # not a head of this vocabulary: ignored, as a tied model ignores any stored head
    a, b = ckpt.get_raw(head), ckpt.get_raw(embed)
    if not isinstance(a, GGMLBlocks) and not isinstance(b, GGMLBlocks) and a.dtype == b.dtype \
            and np.array_equal(a.view(np.uint8), b.view(np.uint8)):
        return cfg  # the tied head stored anyway: the embedding is it
    log(f"note: config.json ties the embeddings but the checkpoint's {head} differs from {embed}; using the stored "
        "head, as transformers does (set tie_word_embeddings to false in config.json to silence this)")
    return replace(cfg, tie_word_embeddings=False)


def _check_draft_layers(layers: tuple[int, ...], cfg: ModelConfig, family: ModelFamily) -> None:
    if not layers:
        return
    if not getattr(family, "draft_graphs", False):
        raise LinesideError(f"--draft-layers: {cfg.architecture} gets no layerskip draft graph in this version "
                            "(Llama, Qwen2 and DeepSeek-V4 do); leave --draft-layers out")
    bad = [n for n in layers if not 1 <= n < cfg.num_layers]
    if bad:
        raise LinesideError(f"--draft-layers {bad[0]}: a draft needs 1 to {cfg.num_layers - 1} of the model's "
                            f"{cfg.num_layers} layers")


def _check_kv_shape(kv_dtype: str, cfg: ModelConfig) -> None:
    """A quantized cache's layout must tile the head vector (int4: two per byte, a scale per 16 channels)."""
    from lineside.build.quant.kv import FORMATS, parse_kv_dtype

    fmt = FORMATS.get(parse_kv_dtype(kv_dtype))
    if fmt is not None:
        fmt.stored_dim(cfg.head_dim)
        fmt.scale_dim(cfg.head_dim)


def _check_context(max_seq: int, cfg: ModelConfig) -> None:
    """--max-seq-len no longer than the model's own context (RoPE tables and caches grow with it)."""
    limit = cfg.context_limit
    if max_seq > limit and (cfg.rope_scaling or {}).get("rope_type") == "dynamic":
        raise LinesideError(dynamic_past_context(max_seq, limit, cfg.name or "the checkpoint"))
    if max_seq > limit:
        how = ("max_position_embeddings" if limit == cfg.max_position_embeddings
               else f"RoPE {cfg.rope_scaling.get('rope_type')} scaling" if cfg.rope_scaling else "")
        raise LinesideError(f"--max-seq-len {max_seq} is above the model's context limit {limit} ({how} of "
                            f"{cfg.name or 'the checkpoint'}); choose at most {limit}")


def _check_shapes(ckpt: CheckpointReader, names: list[str], spec: QuantSpec, flavors: tuple[str, ...]) -> None:
    """Fail before any work if the group size cannot tile a linear layer (checked on shapes only)."""
    for name in names:
        shape = ckpt.shape(name)
        if len(shape) == 2 and name.endswith("proj.weight"):
            for flavor in flavors:
                spec.validate(int(shape[1]), name, flavor)


def _carries(opts: BuildOptions, spec: QuantSpec) -> bool:
    return spec.scheme == "w4a16" and spec.method == "rtn" and not opts.requantize


def _is_gguf(checkpoint: str | Path) -> bool:
    return str(checkpoint).lower().endswith(".gguf")


def _weight_getter(ckpt: CheckpointReader, spec: QuantSpec, flavor: str, opts: BuildOptions,
                   carried: dict[str, str]) -> WeightGetter:
    """The cpu flavor takes GGUF 4/8-bit blocks as they are (no second quantization) when it can."""
    carry = flavor == "cpu" and _carries(opts, spec)

    def get(name: str) -> Weight:
        if carry:
            raw = ckpt.get_raw(name)
            if isinstance(raw, GGMLBlocks) and raw.ggml_type in CARRYABLE:
                carried[name] = raw.ggml_type
                return raw
        return ckpt.get(name)

    return get


GGML_BLOCK = 32  # weights per block of GGUF's Q4_0 / Q4_1 / Q8_0


def _carried_grid(family: ModelFamily, cfg: ModelConfig, source: WeightSource | None, carried: dict[str, str],
                  flavors: tuple[str, ...]) -> str | None:
    """The GGUF 4-bit type every linear of the bundle kept (so its grid is that type's blocks of 32), or None
    when some linear was quantized here (or a trt flavor, which always re-quantizes, was built)."""
    if "trt" in flavors or source is not None:
        return None
    linears = _linears(family, cfg)
    kinds = {carried.get(n) for n in linears}
    return kinds.pop() if linears and len(kinds) == 1 and kinds <= {"Q4_0", "Q4_1"} else None


def _linears(family: ModelFamily, cfg: ModelConfig) -> list[str]:
    """The linear layers' weights (what --quant quantizes, or a GGUF block type is carried for)."""
    return [n for n in family.required_tensors(cfg) if n.endswith("proj.weight")]


def _quant_record(spec: QuantSpec, carried: dict[str, str], cfg: ModelConfig, plan: AwqPlan | None = None,
                  gplan: GptqPlan | None = None, carried_grid: str | None = None,
                  linears: int | None = None) -> dict[str, Any]:
    from lineside.build.quant.kv import kv_record, parse_kv_dtype
    from lineside.build.quant.size import kept_high_precision_note

    kept = kept_high_precision_note() if spec.quantized else []
    kept.append({"tensors": "RoPE cos/sin tables", "precision": "float32", "why": "position tables, not weights"})
    return {
        "scheme": spec.scheme, "group_size": GGML_BLOCK if carried_grid else spec.group_size, "method": spec.method,
        "accuracy_level": spec.accuracy_level, "lm_head_bits": spec.lm_head_bits if spec.scheme == "w4a16" else None,
        "carried_from_source": dict(sorted(carried.items())),
        **({"linears": linears} if linears is not None else {}),  # of which carried_from_source lists the carried
        "kept_high_precision": kept,
        "kv_cache": kv_record(parse_kv_dtype(spec.kv_dtype), cfg.head_dim),
        "symmetric": carried_grid != "Q4_1", "zero_point": 0,
        **({"grid": {"source": f"GGUF {carried_grid}", "block_size": GGML_BLOCK,
                     "per_block": "fp16 scale" + (" + fp16 minimum" if carried_grid == "Q4_1" else "")}}
           if carried_grid else {}),
        "trt_group_note": "trt flavor: a layer whose in_features the group size does not divide uses 64",
        **({"awq": {"calibration_nll_rtn": plan.nll_rtn, "calibration_nll_awq": plan.nll_awq,
                    "fell_back_to_rtn": plan.fallback, "guard_tokens": plan.guard_tokens,
                    "guard_held_out": plan.guard_held_out,
                    "relative_output_error": {k: {"rtn": round(a, 5), "awq": round(b, 5)}
                                              for k, (a, b) in plan.errors.items()}}} if plan else {}),
        **({"gptq": gplan.record()} if gplan else {}),
    }


def _model_name(checkpoint: str | Path, hf_config: dict[str, Any]) -> str:
    p = Path(checkpoint)
    return hf_config.get("_name_or_path") or (p.stem if p.suffix == ".gguf" else p.name)


def describe(bundle_dir: Path) -> str:
    """The build's summary line: architecture, the weights it holds, flavors, size."""
    m = read_manifest(bundle_dir)
    size = sum(f.size for f in m.files.values())
    return f"{m.architecture} {weights_built(m.quantization or {}, tuple(m.flavors))} " \
           f"flavors={','.join(m.flavors)} {size / 1e6:.1f} MB"


def weights_built(quant: dict[str, Any], flavors: tuple[str, ...]) -> str:
    """The scheme asked for, unless the cpu graph carried GGUF Q8_0 linears as they are: those are 8-bit (a Q8_0
    GGUF built with --quant w4a16 is 8-bit throughout), and the line says so rather than the scheme."""
    scheme = str(quant.get("scheme"))
    carried = quant.get("carried_from_source") or {}
    n8 = sum(1 for n, t in carried.items() if str(n).endswith("proj.weight") and t == "Q8_0")
    if not n8:
        return scheme
    total = quant.get("linears")
    if n8 == total:
        cpu = f"w8a16 (every linear carried at 8 bits from GGUF Q8_0, not re-quantized to {scheme})"
    else:
        cpu = f"{scheme} + 8-bit ({f'{n8} of {total}' if total else n8} linears carried at 8 bits from GGUF Q8_0)"
    others = [f for f in flavors if f != "cpu"]
    return cpu if not others else f"{scheme} ({','.join(others)}), cpu graph {cpu}"
