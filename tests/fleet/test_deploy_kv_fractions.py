"""Each engine's memory setting gives the KV cache the plan's budget, by that engine's own rule: SGLang's
mem-fraction-static is a share of the memory free before loading for weights + KV (KV = f × (GPU - CUDA context and
NCCL) - weights), TensorRT-LLM's
free_gpu_memory_fraction a share of what the weights and a profiling step leave (KV = f × (GPU - weights - step)),
vLLM's gpu-memory-utilization the plan's own share. `util - 0.05` for both gave TensorRT-LLM less KV than the
plan's max context needs on a small model, and more than the GPU share allowed on a large one."""

from __future__ import annotations

import pytest

from lineside.deploy.engines import build_deployment
from lineside.deploy.sizing import GPUS, RUNTIME_BYTES
from lineside.errors import LinesideError
from lineside.jetson.planner import shipped_configs
from tests.fleet.test_deploy_datacenter import CHECK

SLACK = 1e-4  # the share is rounded up in its fourth decimal


def kv_and_use(engine: str, config: dict, gpu: int, weights: int, step: int,
               context: int = RUNTIME_BYTES) -> tuple[float, float]:
    """(KV bytes the engine allocates, bytes it uses in all) by the engine's rule, from its config; ``context``:
    what the CUDA context and NCCL hold before SGLang loads the weights (the plan counts RUNTIME_BYTES)."""
    if engine == "sglang":
        f = config["mem-fraction-static"]
        kv = f * (gpu - context) - weights
    elif engine == "trtllm":
        f = config["kv_cache_config"]["free_gpu_memory_fraction"]
        kv = f * (gpu - weights - step)
    else:
        kv = config["gpu-memory-utilization"] * gpu - weights - step
    return kv, weights + step + kv


def plans():
    for model in shipped_configs():
        for gpu in GPUS:
            for n in (1, 2, 3, 4, 6, 8):
                for profile in ("throughput", "latency"):
                    for util in (0.9, 0.8):
                        yield model, f"{n}x{gpu}", profile, util


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_each_engine_allocates_the_kv_budget_the_plan_promised(engine):
    checked = 0
    for model, gpus, profile, util in plans():
        try:
            d = build_deployment(model, gpus, engine, profile=profile, gpu_memory_utilization=util)
        except LinesideError:  # does not fit, or TensorRT-LLM's V4 on Hopper
            continue
        p, where = d.plan, f"{model} {gpus} {engine} {profile} {util}"
        kv, use = kv_and_use(engine, d.config, p.gpu_memory_bytes, p.weights_per_gpu_bytes,
                             p.overhead_per_gpu_bytes)
        assert p.kv_budget_per_gpu_bytes <= kv <= p.kv_budget_per_gpu_bytes + SLACK * p.gpu_memory_bytes, where
        assert use <= (util + SLACK) * p.gpu_memory_bytes, where  # no more of the GPU than the share given
        if engine == "sglang":  # a lighter context before loading only adds KV
            light, _ = kv_and_use(engine, d.config, p.gpu_memory_bytes, p.weights_per_gpu_bytes,
                                  p.overhead_per_gpu_bytes, context=RUNTIME_BYTES // 4)
            assert light >= kv, where
        assert CHECK[engine](d.config) == [], where
        checked += 1
    assert checked > 100


def test_sglang_keeps_a_step_and_the_headroom_outside_its_static_share():
    d = build_deployment("deepseek-r1-distill-llama-8b", "1xH100", "sglang")
    p = d.plan
    rest = (1 - d.config["mem-fraction-static"]) * (p.gpu_memory_bytes - RUNTIME_BYTES)  # for a step and graphs
    step = p.overhead_per_gpu_bytes - RUNTIME_BYTES
    assert rest >= step + (1 - p.gpu_memory_utilization - SLACK) * p.gpu_memory_bytes


@pytest.mark.parametrize(("model", "gpus", "kv_gib"), [
    ("deepseek-r1-distill-qwen-1.5b", "1xH100", 64.15),  # 0.85 of what is free was 61.3 GiB: 2.9 GiB short
    ("deepseek-r1-distill-qwen-32b", "1xH100", 5.34),  # 0.85 was 11.3 GiB: 6 GiB over the 0.9 share of the GPU
    ("deepseek-v4-pro", "8xB200", 17.87),  # 0.85 was 30.4 GiB: 12.5 GiB over
])
def test_trtllm_kv_is_the_plan_s_budget_on_small_and_large_weights(model, gpus, kv_gib):
    d = build_deployment(model, gpus, "trtllm")
    p = d.plan
    f = d.config["kv_cache_config"]["free_gpu_memory_fraction"]
    kv = f * (p.gpu_memory_bytes - p.weights_per_gpu_bytes - p.overhead_per_gpu_bytes)
    assert p.kv_budget_per_gpu_bytes <= kv < p.kv_budget_per_gpu_bytes + 0.01 * (1 << 30)
    assert kv / (1 << 30) == pytest.approx(kv_gib, abs=0.01)
