"""Memory math for a model on N datacenter GPUs with its official weights (no requantization).

DeepSeek-V4's official checkpoints store attention and dense linears as FP8 e4m3 with one fp32 scale per
128×128 block and routed experts as MXFP4 (4-bit values, one e8m0 scale per 32): 4.25 bits a weight. The
planner's fp16 breakdown (lineside.jetson.sizes_v4) gives each part's parameter count; this module prices
them at those formats. The R1-Distill models ship in BF16. KV cache and activations reuse the planner.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from lineside.deploy.parallel import MAX_GPUS, Placement, Shape
from lineside.deploy.step_memory import step_memory
from lineside.errors import LinesideError
from lineside.jetson.planner import _largest, load_model
from lineside.jetson.sizes import EXTERNAL_KV_DTYPES, KvStorage, WeightSizes, check_kv_dtype

GIB = 1 << 30
MIB = 1 << 20
MXFP4_BITS = 4.25  # 4-bit E2M1 + one 8-bit exponent per 32 weights
FP8_BLOCK = 1 + 4 / (128 * 128)  # one byte + an fp32 scale per 128×128 block, per weight
RUNTIME_BYTES = 3 * GIB  # per GPU besides weights, KV and a step: CUDA context, NCCL buffers, CUDA graphs


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory_bytes: int  # as nvidia-smi reports the total
    sm: int  # compute capability × 10


GPUS: dict[str, Gpu] = {
    g.key: g
    for g in (
        Gpu("h100", "NVIDIA H100 80GB HBM3", 81559 * MIB, 90),
        Gpu("h200", "NVIDIA H200 141GB HBM3e", 143771 * MIB, 90),
        Gpu("b200", "NVIDIA B200 180GB HBM3e", 183359 * MIB, 100),
    )
}


@dataclass(frozen=True)
class GpuSet:
    count: int
    gpu: Gpu

    @property
    def label(self) -> str:
        return f"{self.count}x{self.gpu.key.upper()}"


def parse_gpus(text: str) -> GpuSet:
    """'8xH200' → GpuSet(8, H200), any count 1..8 (one node); one-line error otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*([A-Za-z0-9]+)\s*", text or "")
    kinds = ", ".join(g.upper() for g in GPUS)
    if not m or m.group(2).lower() not in GPUS:
        raise LinesideError(f"--gpus {text!r}: give COUNTxGPU with COUNT 1 to {MAX_GPUS} and GPU one of {kinds} "
                            "(e.g. 8xH200)")
    count = int(m.group(1))
    if not 1 <= count <= MAX_GPUS:
        raise LinesideError(f"--gpus {text!r}: {count} GPUs; give 1 to {MAX_GPUS}, the GPUs of one node "
                            f"(e.g. {MAX_GPUS}x{m.group(2).upper()})")
    return GpuSet(count, GPUS[m.group(2).lower()])


@dataclass
class DcPlan:
    """How a model sits on a GPU set (bytes are per GPU unless named total)."""

    model: str
    architecture: str
    gpus: str
    gpu_memory_bytes: int
    weight_format: str
    weights_total_bytes: int
    weights_per_gpu_bytes: int
    tp: int
    dp: int  # attention data-parallel ranks (V4) or engine replicas (dense)
    ep: int
    attention_dp: bool
    mtp_layers: int
    kv_dtype: str
    gpu_memory_utilization: float
    overhead_per_gpu_bytes: int
    kv_budget_per_gpu_bytes: int
    max_model_len: int
    model_max_context: int
    seqs_at_max_len: int  # whole fleet of ranks, sequences of max_model_len
    fits: bool
    servers: int = 1  # engine server processes, each a whole copy of the model (V4 groups)
    gpus_per_server: int = 1
    idle_gpus: int = 0  # GPUs of the set no whole replica could use
    pp: int = 1  # pipeline stages per replica (dense models only; each stage TP wide)
    breakdown: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def replicas(self) -> int:
        """Whole copies of the model: V4's and pipelined plans' servers, a dense TP plan's data-parallel ranks."""
        return self.servers if self.architecture == "deepseek_v4" or self.pp > 1 else self.dp

    @property
    def replica_gpus(self) -> int:
        """GPUs one copy of the model spans."""
        return self.gpus_per_server if self.architecture == "deepseek_v4" or self.pp > 1 else self.tp

    def layout_words(self) -> str:
        """'3 replicas of 2 GPUs (EP 2, attention-DP) on 6 of 6': how a note names this plan's layout."""
        if self.architecture == "deepseek_v4":
            split = f"EP {self.ep}, attention-DP" if self.attention_dp else f"TP {self.tp}, EP {self.ep}"
        else:
            split = f"TP {self.tp}" + (f" x PP {self.pp}" if self.pp > 1 else "")
        r, g, n = self.replicas, self.replica_gpus, self.replicas * self.replica_gpus + self.idle_gpus
        return (f"{r} replica{'s' if r != 1 else ''} of {g} GPU{'s' if g != 1 else ''} ({split}) "
                f"on {n - self.idle_gpus} of {n}")


def official_weights(model: str) -> tuple[WeightSizes, str, int]:
    """(weights, format label, MTP layers) of a shipped model in its published precision."""
    spec = load_model(model)
    fp16 = spec.weights("fp16", 128)
    if spec.architecture != "deepseek_v4":
        return fp16, "bf16 (as published)", 0
    b = fp16.breakdown
    parts = {
        "routed_experts (MXFP4)": int(b["routed_experts"] / 2 * MXFP4_BITS / 8),
        "attention (FP8 block)": int(b["attention"] / 2 * FP8_BLOCK),
        "shared_experts (FP8 block)": int(b["shared_experts"] / 2 * FP8_BLOCK),
        "embedding (bf16)": b["embedding"],
        "lm_head (bf16)": b["lm_head"],
        "router (bf16)": b["router"],
        "hash_tables": b["hash_tables"],
        "fp32_small": b["fp32_small"],
    }
    return WeightSizes(sum(parts.values()), parts, []), "FP8 e4m3 block-scaled + MXFP4 experts (as published)", 1


def default_max_num_seqs(profile: str) -> int:
    """Sequences an engine rank batches (vLLM max-num-seqs, TensorRT-LLM max_batch_size): wide for batch pools."""
    return 128 if profile == "throughput" else 32


def default_draft_tokens(profile: str) -> int:
    """MTP draft tokens a step verifies: 1 for throughput, 3 for low latency."""
    return 1 if profile == "throughput" else 3


TARGET_LEN = 32768  # a layout is good enough once one sequence of this length fits (or the model's maximum)


def plan_datacenter(model: str, gpus: str | GpuSet, *, profile: str = "throughput", kv_dtype: str = "fp8",
                    mtp: bool = True, gpu_memory_utilization: float = 0.90, max_num_tokens: int = 8192,
                    max_len: int | None = None, max_num_seqs: int | None = None,
                    draft_tokens: int | None = None, other_profile: bool = True) -> DcPlan:
    """Parallel layout and the largest context that fits, from the planner's per-part sizes.

    V4 (one KV head, MoE): routed experts are split by expert parallelism over every GPU. With attention-DP
    (``profile=throughput``, when it fits) each rank keeps the attention/dense weights whole and only its own
    sequences' KV; with TP attention (``latency``, or when attention-DP does not fit) the single KV head is
    replicated on every rank, so KV capacity does not grow with TP. Dense models: the smallest TP (dividing
    the KV heads) at which a TARGET_LEN sequence fits; the other GPUs serve as data-parallel replicas. TP × PP
    (pipeline stages) when no TP alone fits, or (throughput) when it runs as many replicas on GPUs TP leaves idle.
    V4 is never pipelined: vLLM cannot run MTP drafting under PP (vllm-project/vllm#14089, #52069).
    Each GPU keeps one step's memory as the engines size it (lineside.deploy.step_memory): activations at
    ``max_num_tokens``, logits for ``max_num_seqs`` rows (× 1 + ``draft_tokens`` with MTP), by profile if unset.
    A note that names the other profile's layout takes it from this planner run with that profile and the same
    arguments (``other_profile`` False: that run itself, which names none).
    """
    gs = parse_gpus(gpus) if isinstance(gpus, str) else gpus
    if profile not in ("throughput", "latency"):
        raise LinesideError(f"--profile {profile!r}: choose throughput (attention-DP, batch pools) or latency")
    if kv_dtype not in EXTERNAL_KV_DTYPES:
        raise LinesideError(f"--kv-dtype {kv_dtype!r}: choose one of {', '.join(EXTERNAL_KV_DTYPES)}")
    if not 0.5 <= gpu_memory_utilization <= 0.98:
        raise LinesideError(f"--gpu-memory-utilization {gpu_memory_utilization}: give a share between 0.5 and 0.98")
    spec = load_model(model)
    raw = raw_config(model)
    shape = Shape.of(raw)
    w, fmt, mtp_layers = official_weights(model)
    mtp_layers = mtp_layers if mtp else 0
    n = gs.count
    v4 = spec.architecture == "deepseek_v4"
    seqs = max_num_seqs if max_num_seqs is not None else default_max_num_seqs(profile)
    drafts = (draft_tokens if draft_tokens is not None else default_draft_tokens(profile)) if v4 and mtp else 0
    ctx = _Ctx(spec, w, gs, check_kv_dtype(kv_dtype, external=True), gpu_memory_utilization, max_num_tokens,
               min(spec.max_positions, max_len or spec.max_positions), shape, raw, seqs, drafts)
    if v4:
        layers = int(raw.get("num_hidden_layers", 1))
        extra = w.total // max(layers, 1) * mtp_layers  # one more decoder layer per MTP module
        options, refused = _v4_options(ctx, shape, n, profile, extra)
    else:
        mtp_layers = 0
        options, refused = _dense_options(ctx, shape, n)
    def other(name: str) -> DcPlan:  # what `--profile NAME` plans with everything else the same
        return plan_datacenter(model, gs, profile=name, kv_dtype=kv_dtype, mtp=mtp,
                               gpu_memory_utilization=gpu_memory_utilization, max_num_tokens=max_num_tokens,
                               max_len=max_len, max_num_seqs=max_num_seqs, draft_tokens=draft_tokens,
                               other_profile=False)

    fitting = [o for o in options if o.lay["fits"]]
    pp_reason = "the widest split tried"
    if not fitting:  # the most GPUs one replica may span, TP alone where it can
        best = max(options, key=lambda o: (o.place.group, -o.lay["pp"]))
    elif v4:
        # throughput: use as many GPUs as whole replicas can, then the widest replica (one EP group if it can);
        # latency: the widest replica (fastest tokens), even if GPUs are left over
        key = ((lambda o: (o.place.idle, -o.place.group)) if profile == "throughput"
               else (lambda o: (-o.place.group, o.place.idle)))
        best = min(fitting, key=key)
    else:
        best, pp_reason = _dense_choice(fitting, profile, min(TARGET_LEN, ctx.cap))
        if other_profile and profile == "throughput" and best.lay["pp"] > 1 and any(o.lay["pp"] == 1 for o in fitting):
            lat = other("latency")  # pipelined to take GPUs TP alone leaves idle: latency keeps TP alone
            if lat.fits:
                pp_reason += f"; --profile latency runs {lat.layout_words()}"
    lay, place = best.lay, best.place
    notes = list(best.notes)
    if v4:
        if place.replicas > 1:
            notes.append(f"{place.replicas} engine servers of {place.group} GPUs (EP {place.group} each), "
                         "all behind the gateway")
    elif lay["pp"] > 1:
        notes.append(f"pipeline parallel: TP {lay['tp']} x PP {lay['pp']} per replica ({pp_reason}), "
                     f"{place.replicas} replica(s), one engine server each; up to "
                     f"{shape.stage_layers(lay['pp'])} of {shape.layers} layers per stage")
    else:
        notes.append(f"dense: TP {lay['tp']} per replica, {lay['dp']} replica(s) (engine data parallelism)")
    idle = _idle_note(best, refused, options, profile, min(TARGET_LEN, ctx.cap),
                      lambda: other("throughput") if other_profile else None)
    if idle:
        notes.append(idle)
    if not lay["fits"]:
        notes.append(f"does not fit: {lay['per_gpu'] / GIB:.1f} GiB of weights per GPU + "
                     f"{lay['overhead'] / GIB:.1f} GiB overhead vs {ctx.usable / GIB:.1f} GiB usable per GPU")
    return DcPlan(
        model=spec.name, architecture=spec.architecture, gpus=gs.label, gpu_memory_bytes=gs.gpu.memory_bytes,
        weight_format=fmt, weights_total_bytes=lay["total"], weights_per_gpu_bytes=lay["per_gpu"],
        tp=lay["tp"], dp=lay["dp"], ep=lay["ep"], attention_dp=lay["attention_dp"], mtp_layers=mtp_layers,
        kv_dtype=kv_dtype, gpu_memory_utilization=gpu_memory_utilization, overhead_per_gpu_bytes=lay["overhead"],
        kv_budget_per_gpu_bytes=lay["budget"], max_model_len=lay["max_len"], model_max_context=spec.max_positions,
        seqs_at_max_len=lay["seqs"] * (place.replicas if v4 else 1), fits=lay["fits"],
        servers=place.replicas if v4 or lay["pp"] > 1 else 1,
        gpus_per_server=place.group if v4 or lay["pp"] > 1 else place.used,
        idle_gpus=place.idle, pp=lay["pp"], breakdown=w.breakdown, notes=notes,
    )


@dataclass
class _Option:
    """One way to place the model: replicas of ``place.group`` GPUs, and that group's layout."""

    place: Placement
    lay: dict[str, Any]
    notes: list[str]


def _v4_options(ctx: _Ctx, shape: Shape, n: int, profile: str,
                extra: int) -> tuple[list[_Option], dict[int, str]]:
    """DeepSeek-V4 on groups of g GPUs (EP g, attention-DP or TP g), for every g the experts split evenly over."""
    options, refused = [], {}
    for g in range(1, n + 1):
        why_ep = shape.ep_problem(g)
        if why_ep:
            refused[g] = why_ep
            continue
        dp_lay = ctx.layout(tp=1, dp=g, ep=g, attention_dp=True, extra=extra) if g > 1 else None
        why_tp = shape.tp_problem(g)
        tp_lay = None if why_tp else ctx.layout(tp=g, dp=1, ep=g, attention_dp=False, extra=extra)
        notes = []
        if profile == "throughput" and dp_lay is not None and (dp_lay["fits"] or tp_lay is None):
            lay = dp_lay
            notes.append("attention-DP: each rank holds the attention/dense weights and its own sequences' KV "
                         "(one KV head: TP would replicate it on every rank)")
        elif tp_lay is not None:
            lay = tp_lay
            if profile == "throughput" and dp_lay is not None:
                notes.append(f"attention-DP does not fit ({dp_lay['per_gpu'] / GIB:.1f} GiB of weights per "
                             "GPU with attention replicated): TP attention instead")
            notes.append("TP attention: the single KV head is replicated on every rank")
        else:
            refused[g] = str(why_tp)  # latency wants TP attention, which this g cannot split
            continue
        options.append(_Option(Placement(n, g), lay, notes))
    return options, refused


def _dense_options(ctx: _Ctx, shape: Shape, n: int) -> tuple[list[_Option], dict[int, str]]:
    """A dense model at every TP its heads, KV heads and MLP split evenly over, each also as 2.. pipeline
    stages (no more stages than layers) where TP × PP GPUs are there; the rest as replicas."""
    options, refused = [], {}
    for tp in range(1, n + 1):
        why = shape.tp_problem(tp)
        if why:
            refused[tp] = why
            continue
        for pp in range(1, min(n // tp, shape.layers) + 1):
            place = Placement(n, tp * pp)
            options.append(_Option(place, ctx.layout(tp=tp, dp=place.replicas, ep=1, attention_dp=False, extra=0,
                                                     pp=pp), []))
    return options, refused


def _dense_choice(fitting: list[_Option], profile: str, target: int) -> tuple[_Option, str]:
    """TP alone when it fits: all GPUs busy, then the narrowest TP. Pipeline stages when no TP alone fits, or,
    for throughput, when a TP × PP split runs as many replicas on GPUs the TP choice leaves idle. The second
    value says why PP was taken ("" when it was not)."""
    def pick(opts: list[_Option]) -> _Option:
        good = [o for o in opts if o.lay["max_len"] >= target] or opts
        return min(good, key=lambda o: (o.place.idle, o.place.group, o.lay["pp"]))  # fewest stages per group

    tp_only = [o for o in fitting if o.lay["pp"] == 1]
    if not tp_only:
        return pick(fitting), "the model fits no tensor-parallel split of these GPUs alone"
    best = pick(tp_only)
    if profile != "throughput" or not best.place.idle:
        return best, ""
    busier = [o for o in fitting if o.lay["pp"] > 1 and o.place.idle < best.place.idle
              and o.place.replicas >= best.place.replicas and o.lay["max_len"] >= min(target, best.lay["max_len"])]
    if not busier:
        return best, ""
    return pick(busier), f"uses the {best.place.idle} GPU(s) TP {best.lay['tp']} alone leaves idle"


def _idle_note(best: _Option, refused: dict[int, str], options: list[_Option], profile: str, target: int,
               throughput: Callable[[], DcPlan | None]) -> str | None:
    """One line for GPUs the plan leaves unused: which, and why no other split takes them (``target``: the context
    a dense split must hold to be taken); for latency, what ``throughput()`` (the throughput profile's own plan of
    the same GPUs, None when not asked) runs on them."""
    place, lay = best.place, best.lay
    if not place.idle:
        return None
    ids = f"GPU {place.used}" if place.idle == 1 else f"GPUs {place.used}-{place.gpus - 1}"
    by_reason: dict[str, list[int]] = {}
    for g, r in sorted(refused.items()):
        if g > place.group:
            by_reason.setdefault(r, []).append(g)
    why = [f"{r} do not split evenly over {_or(gs)} GPUs" for r, gs in by_reason.items()]
    too_small = sorted({o.place.group for o in options if o.place.group > place.group and not o.lay["fits"]})
    if too_small:
        why.append(f"the model does not fit replicas of {_or(too_small)} GPUs")
    busier = [o for o in options if o.lay["fits"] and o.place.idle < place.idle]
    if busier and profile == "latency":  # it chose the widest replica, or TP alone, over using every GPU
        o = min(busier, key=lambda o: (o.place.idle, o.lay["pp"]))
        why.append("the latency profile keeps TP alone" if o.lay["pp"] > 1
                   else "the latency profile takes the widest replica")
    elif busier:  # throughput keeps the most replicas at the target context: a busier split has fewer, or less
        o = min(busier, key=lambda o: (o.place.idle, o.lay["pp"]))
        split = f"TP {o.lay['tp']}" + (f" x PP {o.lay['pp']}" if o.lay["pp"] > 1 else " alone")
        if o.place.replicas < place.replicas:
            why.append(f"{split} would use them but runs {o.place.replicas} replica(s), not {place.replicas}")
        else:  # as many replicas, each short of the context this one holds (_dense_choice's target)
            why.append(f"{split} would use them but holds {o.lay['max_len']} tokens a sequence, not "
                       f"{min(target, lay['max_len'])}")
    if profile == "latency":
        thr = throughput()
        if thr is not None and thr.fits and thr.idle_gpus < place.idle:
            why.append(f"--profile throughput runs {thr.layout_words()}")
    return (f"{ids} idle: {place.replicas} replica(s) of {place.group} GPU(s) use {place.used} of {place.gpus}"
            + (f" ({'; '.join(why)})" if why else ""))


def _or(values: list[int]) -> str:
    """'3', '3 or 6', '3, 6 or 7'."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@dataclass
class _Ctx:
    spec: Any
    w: WeightSizes
    gs: GpuSet
    kvb: KvStorage
    util: float
    max_num_tokens: int
    cap: int
    shape: Shape
    raw: dict[str, Any]
    max_num_seqs: int  # per engine rank: one logits row each (and one per draft token)
    draft_tokens: int

    @property
    def usable(self) -> int:
        return int(self.gs.gpu.memory_bytes * self.util)

    def layout(self, *, tp: int, dp: int, ep: int, attention_dp: bool, extra: int, pp: int = 1) -> dict[str, Any]:
        """Per-GPU weights, KV budget and the longest sequence for one parallel layout; with ``pp`` stages a GPU
        holds its stage's layers (the fullest stage's) and the first's embedding or the last's lm_head."""
        experts = self.w.breakdown.get("routed_experts (MXFP4)", 0)
        rest = self.w.total - experts + extra
        per_gpu = experts // ep + (rest if attention_dp else rest // tp)
        layers, stage = self.shape.layers, self.shape.stage_layers(pp)
        if pp > 1:
            ends = self.w.breakdown.get("embedding", 0) + self.w.breakdown.get("lm_head", 0)
            end = max(self.w.breakdown.get("embedding", 0), self.w.breakdown.get("lm_head", 0))
            per_gpu = ((rest - ends) * stage // layers + end) // tp
        step = step_memory(self.raw, tokens=self.max_num_tokens, max_num_seqs=self.max_num_seqs,
                           draft_tokens=self.draft_tokens, tp=1 if attention_dp else tp)
        overhead = RUNTIME_BYTES + step.total  # one step's activations + logits besides
        budget = self.usable - per_gpu - overhead
        kv_shard = self.shape.kv_shard(tp)  # by KV head, never finer: MQA's one head is whole on every rank
        def kv(c: int) -> int:  # one sequence's KV on one GPU: its KV-head shard of its stage's layers
            return -(-self.spec.kv(c, 1, self.kvb).total * stage // layers) // kv_shard

        max_len = _largest(lambda c: kv(c) <= budget, self.cap) if budget > 0 else 0
        per_seq = kv(max_len) if max_len else 0
        return {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "attention_dp": attention_dp, "total": self.w.total + extra,
                "per_gpu": per_gpu, "overhead": overhead, "budget": budget, "max_len": max_len,
                "seqs": (budget // per_seq) * dp if per_seq else 0,
                "fits": budget > 0 and max_len >= min(4096, self.cap)}


def raw_config(model: str) -> dict[str, Any]:
    """The Hugging Face config.json of MODEL (a shipped config name or a path), as a dict."""
    from pathlib import Path

    from lineside.config import load_hf_config
    from lineside.jetson.planner import CONFIGS_DIR, shipped_configs

    p = Path(model)
    if not p.exists():
        names = {n.lower(): n for n in shipped_configs()}
        key = model.strip().lower().removeprefix("deepseek-ai/")
        if key not in names:
            raise LinesideError(f"{model}: not a shipped config ({', '.join(shipped_configs())}) nor a path")
        p = CONFIGS_DIR / names[key]
    return load_hf_config(p / "config.json" if p.is_dir() else p)
