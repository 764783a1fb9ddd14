"""Per-GPU memory a datacenter engine (vLLM, SGLang, TensorRT-LLM) keeps for one step beyond weights and KV.

Not lineside's own TensorRT graph (lineside.jetson.sizes prices that: unfused attention scores, a logits
buffer per prefill position). What the engines really reserve, read from their source:

- Forward activations at ``max_num_batched_tokens`` tokens. vLLM sizes its KV cache after a profiling forward
  of that many tokens (vllm/v1/worker/gpu_model_runner.py ``profile_run`` → ``_dummy_run``), TensorRT-LLM
  after one at ``max_num_tokens`` (docs/source/reference/memory.md), SGLang leaves ``1 - mem_fraction_static``
  for it. All three run fused attention (FlashAttention / FlashInfer / FlashMLA, DeepSeek's indexer through
  DeepGEMM's ``fp8_mqa_logits``, whose heads are summed in the kernel): no per-head score matrix exists.
- Logits for one row per running sequence (its last scheduled token) and each MTP draft token, never for every
  prompt token: vLLM's ``_dummy_run`` returns ``hidden_states[cumsum(num_scheduled_tokens) - 1]`` and
  ``_dummy_sampler_run`` computes logits for those rows only; SGLang's LogitsProcessor keeps the last index of
  each extend (python/sglang/srt/layers/logits_processor.py); TensorRT-LLM gathers context logits only with
  ``gather_context_logits`` (off). The rows are min(max_num_seqs × (1 + draft tokens), batched tokens).
- The sampler's temporaries over those rows: vLLM's PyTorch top-k/top-p path (vllm/v1/sample/ops/topk_topp_sampler.py)
  upcasts to fp32, sorts (fp32 values + int64 indices), takes softmax and a cumulative sum, then probabilities and
  exponential noise; logprobs add a log-softmax. SGLang's FlashInfer sampling needs less; this counts vLLM's.

Where unsure it errs high, and says so next to the number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lineside.config import ModelConfig, family_of
from lineside.jetson.sizes_v4 import CSA, V4Shape

BF16 = 2
FP32 = 4
# bytes per logit element: the bf16 logits + vLLM's sampler temporaries, each counted as if all were live at
# once (they are not): fp32 copy 4, sorted values 4, int64 sort indices 8, softmax 4, cumsum 4, top-p mask 1,
# probabilities 4, exponential noise 4, log-softmax for logprobs 4
LOGIT_BYTES = BF16 + 4 + 4 + 8 + 4 + 4 + 1 + 4 + 4 + 4


@dataclass(frozen=True)
class StepMemory:
    """One step's memory on one GPU, by part, so a plan can say what it counted."""

    forward: int  # peak live activations of a forward over the batched tokens
    logits: int  # logits rows × vocabulary and the sampler's temporaries over them

    @property
    def total(self) -> int:
        return self.forward + self.logits


def logit_rows(max_num_seqs: int, draft_tokens: int, tokens: int) -> int:
    """Rows the engines compute logits for in one step: each sequence's next token and its drafts to verify."""
    return max(1, min(max_num_seqs * (1 + draft_tokens), tokens))


def logits_memory(vocab: int, rows: int) -> int:
    """The full vocabulary on each rank (TP gathers the LM head's shards before sampling), every row."""
    return rows * vocab * LOGIT_BYTES


def dense_forward(cfg: ModelConfig, tokens: int, tp: int) -> int:
    """Llama/Qwen2 layer at ``tokens`` tokens on one of ``tp`` ranks: the residual stream and normed input
    (full width on every rank), plus the attention block's q/k/v and output and the MLP's gate-up and activated
    halves (sharded). Both blocks' intermediates are counted as live together, erring high by the smaller."""
    q = cfg.num_heads * cfg.head_dim // tp
    kv = -(-cfg.num_kv_heads // tp) * cfg.head_dim  # a KV head is replicated, never split, when TP exceeds them
    attn = 2 * q + 2 * kv  # q, k, v in; the attention output
    mlp = 3 * cfg.intermediate_size // tp  # gate and up, then the activated product
    return tokens * (2 * cfg.hidden_size + attn + mlp) * BF16


def v4_forward(s: V4Shape, tokens: int, tp: int) -> int:
    """DeepSeek-V4 layer at ``tokens`` tokens on one rank (TP ``tp`` over heads and output groups; 1 with
    attention-DP): the mHC residual streams, the attention projections, the indexer's [tokens, compressed keys]
    fp32 scores (one sequence of ``tokens``, the longest a profiling step holds), and the MoE's routed pairs.
    Every token's top-k experts are counted on this rank, as if routing sent all of them here (expert
    parallelism spreads them, on average 1/EP of a TP-attention step's), plus the shared expert and the router."""
    streams = 2 * s.hc * s.hidden
    attn = (s.hidden + s.q_lora + 2 * s.heads * s.head_dim // tp + s.o_groups * s.o_lora // tp) * BF16
    indexer = tokens // s.rates[CSA] * FP32 if CSA in s.layer_types else 0
    moe = (s.top_k + s.shared) * 3 * s.moe_inter * BF16 + s.experts * FP32
    return tokens * (streams * BF16 + s.hidden * BF16 + attn + indexer + moe)


def step_memory(raw: dict[str, Any], *, tokens: int, max_num_seqs: int, draft_tokens: int, tp: int) -> StepMemory:
    """One GPU's step memory for a model (its Hugging Face config) at ``tokens`` batched tokens, TP ``tp``."""
    rows = logit_rows(max_num_seqs, draft_tokens, tokens)
    if family_of(raw) == "deepseek_v4":
        s = V4Shape.from_raw(raw)
        return StepMemory(forward=v4_forward(s, tokens, tp), logits=logits_memory(s.vocab, rows))
    cfg = ModelConfig.from_hf_dict(raw, name="")
    return StepMemory(forward=dense_forward(cfg, tokens, tp), logits=logits_memory(cfg.vocab_size, rows))
