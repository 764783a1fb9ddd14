"""The memory share each engine is given so that its KV cache comes out at the plan's KV budget.

The plan sizes a GPU as vLLM does: ``gpu_memory_utilization`` of the whole GPU holds the weights, one step's
memory and the KV cache, so vLLM takes the share as is. The other two engines measure another whole:

- SGLang: ``mem-fraction-static`` is the share of the memory free before the weights load (the GPU less its CUDA
  context and NCCL buffers, which the plan counts in RUNTIME_BYTES) for weights + KV; activations and CUDA graphs
  live in the rest (python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py ``profile_max_num_token``:
  KV = free after loading - free before × (1 - f)).
- TensorRT-LLM (PyTorch backend): ``kv_cache_config.free_gpu_memory_fraction`` is the share of the memory left
  after the weights and a profiling forward at ``max_num_tokens`` (tensorrt_llm/_torch/pyexecutor/_util.py
  ``KvCacheCreator._cal_max_memory``: KV = (total - peak) × f, default 0.9).

Each share is rounded up in the fourth decimal, so the engine's KV is never below the budget the plan's
max context came from (at most 1/10000 of the GPU over it).
"""

from __future__ import annotations

import math

from lineside.deploy.sizing import RUNTIME_BYTES, DcPlan


def _up(share: float) -> float:
    return min(1.0, math.ceil(share * 10_000 - 1e-6) / 10_000)


def sglang_mem_fraction_static(p: DcPlan) -> float:
    """The share of the memory free before loading for weights + the plan's KV budget (SGLang keeps the rest for a
    step and CUDA graphs); taken as the GPU less all of RUNTIME_BYTES, so a smaller context only adds KV."""
    free_before = p.gpu_memory_bytes - RUNTIME_BYTES
    return _up((p.weights_per_gpu_bytes + p.kv_budget_per_gpu_bytes) / free_before)


def trtllm_free_gpu_memory_fraction(p: DcPlan) -> float:
    """The share of what the weights and one step leave free that is the plan's KV budget."""
    free = p.gpu_memory_bytes - p.weights_per_gpu_bytes - p.overhead_per_gpu_bytes
    return _up(p.kv_budget_per_gpu_bytes / free)
