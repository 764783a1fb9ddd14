"""Launch commands and config files for vLLM, SGLang and TensorRT-LLM, from a datacenter plan.

Each engine's config uses that engine's own option names (held to schemas taken from its source in
tests/fleet/fixtures by scripts/engine_schemas.py): vLLM and SGLang read a YAML of `--option` names without
the dashes (`vllm serve --config`, `sglang.launch_server --config`); trtllm-serve reads a YAML of
``TorchLlmArgs`` fields (`--config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lineside.bundle import MANIFEST
from lineside.deploy.kv_fractions import sglang_mem_fraction_static, trtllm_free_gpu_memory_fraction
from lineside.deploy.parallel import MAX_GPUS
from lineside.deploy.sizing import (
    GPUS,
    DcPlan,
    Gpu,
    GpuSet,
    default_draft_tokens,
    default_max_num_seqs,
    parse_gpus,
    plan_datacenter,
)
from lineside.errors import LinesideError
from lineside.jetson.planner import load_model
from lineside.strenum import StrEnum

GIB = 1 << 30
PORT = 8000
MAX_NUM_TOKENS = 8192


class EngineName(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


# Images whose engine versions are the ones the schema fixtures were taken from.
IMAGES = {
    EngineName.VLLM: "vllm/vllm-openai:v0.33.0",
    EngineName.SGLANG: "lmsysorg/sglang:v0.5.23",
    EngineName.TRTLLM: "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc0",
}
CONFIG_FILES = {EngineName.VLLM: "vllm.yaml", EngineName.SGLANG: "sglang.yaml", EngineName.TRTLLM: "trtllm.yaml"}


@dataclass
class Replica:
    """One engine server process: its GPUs and command line."""

    name: str
    gpu_ids: list[int]
    command: list[str]


@dataclass
class Deployment:
    engine: EngineName
    model: str
    hf_id: str
    served_name: str
    gpus: str
    plan: DcPlan
    config_file: str
    config: dict[str, Any]
    replicas: list[Replica]
    image: str
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Checkpoint:
    """Where the engine finds the weights: the directory's name under --model-dir, and what it serves them as."""

    hf_id: str  # Hugging Face id of a shipped config, or the local directory's name
    dir_name: str  # the checkpoint directory's name under --model-dir (the engine's model path)
    served_name: str


def checkpoint(model: str) -> Checkpoint:
    """A shipped config name (deepseek-v4-flash, deepseek-ai/DeepSeek-V4-Flash) or a Hugging Face checkpoint
    directory / its config.json; an engine cannot load a lineside bundle or a GGUF, so those are refused."""
    p = Path(model)
    if not p.exists():
        spec = load_model(model)  # a shipped name, or its one-line error
        return Checkpoint(f"deepseek-ai/{spec.name}", spec.name, spec.name.lower())
    if p.is_file() and p.name == MANIFEST:
        p = p.parent
    if p.is_dir() and (p / MANIFEST).is_file():
        raise LinesideError(f"{model}: a lineside bundle (lineside serves it itself); vLLM, SGLang and TensorRT-LLM "
                            "load the Hugging Face checkpoint: pass its directory or a shipped config name")
    if p.suffix == ".gguf":
        raise LinesideError(f"{model}: a GGUF file; vLLM, SGLang and TensorRT-LLM load the Hugging Face checkpoint "
                            "here: pass its directory or a shipped config name")
    d = p if p.is_dir() else p.resolve().parent  # a config.json names its checkpoint directory
    return Checkpoint(d.name, d.name, d.name.lower())


def graph_sizes(max_batch: int) -> list[int]:
    """CUDA-graph batch sizes: powers of two up to max_batch, and max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def refuse_unsupported(engine: EngineName, arch: str, gs: GpuSet) -> None:
    """Combinations the engine does not run, with the reason and what to use instead."""
    if engine == EngineName.TRTLLM and arch == "deepseek_v4" and gs.gpu.sm < 100:
        raise LinesideError(
            f"TensorRT-LLM runs DeepSeek-V4 on Blackwell (SM100+) only (its examples/models/core/deepseek_v4/"
            f"README.md); {gs.label} is SM{gs.gpu.sm}: use --engine vllm or --engine sglang on {gs.label}, "
            f"or --gpus {gs.count}xB200 for TensorRT-LLM")


def build_deployment(model: str, gpus: str, engine: str, *, profile: str = "throughput", port: int = PORT,
                     model_dir: str = "/models", mtp_tokens: int | None = None,
                     gpu_memory_utilization: float = 0.90) -> Deployment:
    """Plan the model on the GPUs and write the engine's config; one-line errors for what cannot run."""
    try:
        eng = EngineName(engine)
    except ValueError:
        raise LinesideError(f"--engine {engine!r}: choose vllm, sglang or trtllm") from None
    auto = gpus.strip().lower() == "auto"
    if auto:  # this host's GPUs, as nvidia-smi lists them
        from lineside.deploy.detect import detect_gpus

        gpus = detect_gpus()
    gs = parse_gpus(gpus)
    ckpt = checkpoint(model)
    spec = load_model(model)
    refuse_unsupported(eng, spec.architecture, gs)
    max_batch = default_max_num_seqs(profile)
    # max_num_seqs is the profile's default (max_batch), left to the planner so that a note naming the other
    # profile plans it with that profile's own batch, as `--profile OTHER` would
    plan = plan_datacenter(model, gs, profile=profile, gpu_memory_utilization=gpu_memory_utilization,
                           max_num_tokens=MAX_NUM_TOKENS, draft_tokens=mtp_tokens)
    if not plan.fits:
        why = plan.notes[-1].removeprefix("does not fit: ")  # the planner's note starts with the same words
        raise LinesideError(f"{spec.name} does not fit {gs.label}: {why}; "
                            + fits_instead(model, gs, profile, gpu_memory_utilization, draft_tokens=mtp_tokens))
    hf, served = ckpt.hf_id, ckpt.served_name
    path = f"{model_dir.rstrip('/')}/{ckpt.dir_name}"
    v4 = spec.architecture == "deepseek_v4"
    k = (mtp_tokens if mtp_tokens is not None else default_draft_tokens(profile)) if plan.mtp_layers else 0
    if mtp_tokens and not plan.mtp_layers:
        raise LinesideError(f"--mtp-tokens: {spec.name} has no MTP layers (only DeepSeek-V4 checkpoints do)")
    builder = {EngineName.VLLM: _vllm, EngineName.SGLANG: _sglang, EngineName.TRTLLM: _trtllm}[eng]
    config, replicas, notes = builder(plan, path=path, served=served, port=port, v4=v4, mtp=k, max_batch=max_batch,
                                      n=plan.gpus_per_server)
    notes = [*([f"--gpus auto: nvidia-smi lists {gs.label}"] if auto else []), *plan.notes, *notes]
    if k:
        notes.append(f"MTP: {k} draft token(s) per step ({'throughput' if profile == 'throughput' else 'latency'} "
                     "setting; 1 for throughput, 3 for low latency)")
    return Deployment(eng, spec.name, hf, served, gs.label, plan, CONFIG_FILES[eng], config, replicas, IMAGES[eng],
                      notes)


def smallest_fit(model: str, gs: GpuSet, profile: str = "throughput",
                 gpu_memory_utilization: float = 0.90, *, draft_tokens: int | None = None) -> GpuSet | None:
    """The fewest GPUs of this kind that hold the model, else the smallest node of a larger kind, else None;
    fewer GPUs never help (every split of fewer is among the ones already tried)."""
    for gpu in larger_kinds(gs):
        for count in range(gs.count + 1 if gpu == gs.gpu else 1, MAX_GPUS + 1):
            if plan_datacenter(model, GpuSet(count, gpu), profile=profile,
                               gpu_memory_utilization=gpu_memory_utilization, max_num_tokens=MAX_NUM_TOKENS,
                               draft_tokens=draft_tokens, other_profile=False).fits:
                return GpuSet(count, gpu)
    return None


def larger_kinds(gs: GpuSet) -> list[Gpu]:
    """The set's GPU kind, then every kind with more memory, smallest first: where a model too big may go."""
    return [gs.gpu, *sorted((g for g in GPUS.values() if g.memory_bytes > gs.gpu.memory_bytes),
                            key=lambda g: g.memory_bytes)]


def fits_instead(model: str, gs: GpuSet, profile: str, gpu_memory_utilization: float, *,
                 draft_tokens: int | None = None) -> str:
    """What to ask for instead: ``use --gpus`` with :func:`smallest_fit`'s set, or why no node of one holds it."""
    fit = smallest_fit(model, gs, profile, gpu_memory_utilization, draft_tokens=draft_tokens)
    if fit is not None:
        return f"use --gpus {fit.label}"
    return (f"no node of up to {MAX_GPUS} {', '.join(g.key.upper() for g in larger_kinds(gs))} GPUs holds it at "
            f"--gpu-memory-utilization {gpu_memory_utilization}")


def _vllm(p: DcPlan, *, path: str, served: str, port: int, v4: bool, mtp: int, max_batch: int,
          n: int) -> tuple[dict[str, Any], list[Replica], list[str]]:
    c: dict[str, Any] = {
        "model": path,
        "served-model-name": served,
        "host": "0.0.0.0",
        "port": port,
        "tensor-parallel-size": p.tp,
    }
    if p.pp > 1:  # each replica its own server (the plan's servers), so no data parallelism inside one
        c["pipeline-parallel-size"] = p.pp
    elif p.dp > 1:
        c["data-parallel-size"] = p.dp
    if v4:
        c["enable-expert-parallel"] = True
    c.update({
        "kv-cache-dtype": "fp8",
        "max-model-len": p.max_model_len,
        "max-num-seqs": max_batch,
        "max-num-batched-tokens": MAX_NUM_TOKENS,
        "gpu-memory-utilization": p.gpu_memory_utilization,
        "cudagraph-capture-sizes": graph_sizes(max_batch * (1 + mtp)),
        "scheduling-policy": "priority",  # the gateway writes X-Priority / X-Mode into the body's `priority`
    })
    if mtp:
        c["speculative-config"] = {"method": "mtp", "num_speculative_tokens": mtp}
    cmd = ["vllm", "serve", "--config", "/config/vllm.yaml"]
    return c, servers(p, cmd), ["vLLM: data parallel ranks share one API server"] if p.dp > 1 and p.pp == 1 else []


def _sglang(p: DcPlan, *, path: str, served: str, port: int, v4: bool, mtp: int, max_batch: int,
            n: int) -> tuple[dict[str, Any], list[Replica], list[str]]:
    c: dict[str, Any] = {"model-path": path, "served-model-name": served, "host": "0.0.0.0", "port": port}
    if v4:
        # SGLang keeps the FFN (experts) across the whole TP group; attention-DP splits attention inside it.
        c["tp-size"] = n
        c["ep-size"] = n
        if p.attention_dp:
            c["attn-dp-size"] = p.dp
    else:
        c["tp-size"] = p.tp
        if p.pp > 1:  # one server per replica, as for vLLM
            c["pp-size"] = p.pp
        elif p.dp > 1:
            c["dp-size"] = p.dp
    c.update({
        "kv-cache-dtype": "fp8_e4m3",
        "context-length": p.max_model_len,
        "mem-fraction-static": sglang_mem_fraction_static(p),  # of the GPU, for weights + KV
        "max-running-requests": max_batch * (max(p.dp, 1) if p.pp == 1 else 1),  # PP: a server per replica
        "chunked-prefill-size": MAX_NUM_TOKENS,
        "cuda-graph-max-bs-decode": max_batch,
        "enable-priority-scheduling": True,
        "schedule-low-priority-values-first": True,  # vLLM's order: the gateway writes lower = sooner
    })
    if mtp:  # DeepSeek MTP runs through SGLang's EAGLE path (top-k 1 for DeepSeek-V4)
        c.update({"speculative-algorithm": "EAGLE", "speculative-num-steps": mtp, "speculative-eagle-topk": 1,
                  "speculative-num-draft-tokens": mtp + 1})
    cmd = ["python3", "-m", "sglang.launch_server", "--config", "/config/sglang.yaml"]
    return c, servers(p, cmd), []


def _trtllm(p: DcPlan, *, path: str, served: str, port: int, v4: bool, mtp: int, max_batch: int,
            n: int) -> tuple[dict[str, Any], list[Replica], list[str]]:
    c: dict[str, Any] = {
        "tensor_parallel_size": p.tp if not v4 else n,
        **({"pipeline_parallel_size": p.pp} if p.pp > 1 else {}),
        "max_batch_size": max_batch,
        "max_num_tokens": MAX_NUM_TOKENS,
        "max_seq_len": p.max_model_len,
        # off by default in TorchLlmArgs, and then a prompt longer than max_num_tokens is refused
        "enable_chunked_prefill": p.max_model_len > MAX_NUM_TOKENS,
        "kv_cache_config": {"dtype": "fp8", "free_gpu_memory_fraction": trtllm_free_gpu_memory_fraction(p),
                            **({"tokens_per_block": 128} if v4 else {})},
        "cuda_graph_config": {"enable_padding": True, "batch_sizes": graph_sizes(max_batch)},
        "stream_interval": 10 if p.attention_dp else 1,
    }
    notes = []
    if v4:
        c["moe_expert_parallel_size"] = n
        c["moe_config"] = {"backend": "TRTLLM"}
        c["custom_tokenizer"] = "deepseek_v4"
        if p.attention_dp:
            c["enable_attention_dp"] = True
            c["attention_dp_config"] = {"batching_wait_iters": 0, "enable_balance": True, "timeout_iters": 60}
            notes.append("TensorRT-LLM attention-DP: max_batch_size is per rank")
        if mtp:  # num_nextn_predict_layers is read from the checkpoint ("do not set manually")
            c["speculative_config"] = {"decoding_type": "MTP", "max_draft_len": mtp}
        replicas = servers(p, _trt_cmd(path, served, port))
    else:  # trtllm-serve has no data parallelism for a dense model: one server per TP group
        replicas = servers(p, _trt_cmd(path, served, port), count=p.dp, group=p.tp * p.pp)
        if p.dp > 1:
            notes.append(f"TensorRT-LLM: {p.dp} servers of TP {p.tp}" + (f" x PP {p.pp}" if p.pp > 1 else "")
                         + ", one per GPU group, all behind the gateway")
    return c, replicas, notes


def servers(p: DcPlan, command: list[str], *, count: int | None = None, group: int | None = None) -> list[Replica]:
    """The engine servers on consecutive GPUs from 0 (``count`` of ``group`` GPUs; the plan's by default);
    GPUs the plan leaves idle are given to none, so compose reserves only the ones used."""
    count, group = count or p.servers, group or p.gpus_per_server
    return [Replica(f"engine-{i}" if count > 1 else "engine", list(range(i * group, (i + 1) * group)), command)
            for i in range(count)]


def _trt_cmd(path: str, served: str, port: int) -> list[str]:
    return ["trtllm-serve", path, "--backend", "pytorch", "--host", "0.0.0.0", "--port", str(port),
            "--config", "/config/trtllm.yaml"]


def format_deployment(d: Deployment) -> str:
    p = d.plan
    lines = [
        f"{d.model} on {d.gpus} with {d.engine}: {p.weight_format}",
        f"  weights {p.weights_total_bytes / GIB:.1f} GiB in all, {p.weights_per_gpu_bytes / GIB:.1f} GiB per GPU; "
        f"KV ({p.kv_dtype}) budget {p.kv_budget_per_gpu_bytes / GIB:.1f} GiB per GPU",
        f"  TP {p.tp}" + (f", PP {p.pp}" if p.pp > 1 else "") + f", DP {p.dp}, EP {p.ep}"
        + (", attention-DP" if p.attention_dp else "")
        + f"; max context {p.max_model_len} ({p.seqs_at_max_len} sequences of it fit)",
    ]
    lines += [f"  note: {n}" for n in d.notes]
    return "\n".join(lines)
