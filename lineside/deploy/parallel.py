"""Which GPU counts a model's shapes let one engine replica span, and how N GPUs split into replicas.

vLLM, SGLang and TensorRT-LLM shard attention heads, KV heads and MLP columns evenly over the tensor-parallel
ranks (vLLM: "Total number of attention heads (28) must be divisible by tensor parallel size (3)"); a TP wider
than the KV heads replicates them, which needs TP to be a multiple of the KV heads. Routed experts are split
evenly over the expert-parallel ranks. Pipeline parallelism splits the decoder layers
into stages (at most one layer a stage). GPUs left over once whole replicas are placed stay idle, and the plan
says so in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_GPUS = 8  # one node: what `deploy datacenter` plans (the engines' multi-node modes are out of scope)


@dataclass(frozen=True)
class Shape:
    """The dimensions the engines divide among ranks (0 where the model has no such part)."""

    heads: int
    kv_heads: int
    intermediate: int  # dense MLP columns (0 for a MoE-only FFN)
    experts: int  # routed experts (0 for a dense model)
    o_groups: int  # DeepSeek-V4's grouped output projection (0 otherwise)
    layers: int = 1  # decoder layers: what pipeline parallelism splits into stages

    @classmethod
    def of(cls, raw: dict[str, Any]) -> Shape:
        heads = int(raw.get("num_attention_heads") or 1)
        return cls(heads=heads, kv_heads=int(raw.get("num_key_value_heads") or heads),
                   intermediate=int(raw.get("intermediate_size") or 0) if not raw.get("n_routed_experts") else 0,
                   experts=int(raw.get("n_routed_experts") or 0), o_groups=int(raw.get("o_groups") or 0),
                   layers=max(1, int(raw.get("num_hidden_layers") or 1)))

    def tp_problem(self, tp: int) -> str | None:
        """Why tensor parallelism of ``tp`` cannot split this model, or None when it can."""
        if self.heads % tp:
            return f"{self.heads} attention heads"
        if self.kv_heads % tp and tp % self.kv_heads:
            return f"{self.kv_heads} KV heads"  # TP must divide them, or be a multiple to replicate each
        if self.intermediate and self.intermediate % tp:
            return f"MLP width {self.intermediate}"
        if self.o_groups and self.o_groups % tp:
            return f"{self.o_groups} output-projection groups"
        return None

    def ep_problem(self, ep: int) -> str | None:
        """Why expert parallelism of ``ep`` cannot split the routed experts evenly, or None when it can."""
        if self.experts and self.experts % ep:
            return f"{self.experts} routed experts"
        return None

    def stage_layers(self, pp: int) -> int:
        """Decoder layers on the fullest of ``pp`` pipeline stages (the engines give the remainder to some)."""
        return -(-self.layers // pp)

    def kv_shard(self, tp: int) -> int:
        """How many ways TP splits the KV cache: by KV head, never finer (a replicated head is whole on each rank)."""
        return max(1, min(tp, self.kv_heads))


@dataclass(frozen=True)
class Placement:
    """``replicas`` copies of the model, ``group`` GPUs each, on the first group × replicas of ``gpus``."""

    gpus: int
    group: int

    @property
    def replicas(self) -> int:
        return self.gpus // self.group

    @property
    def used(self) -> int:
        return self.group * self.replicas

    @property
    def idle(self) -> int:
        return self.gpus - self.used

