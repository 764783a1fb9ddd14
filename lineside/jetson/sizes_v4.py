"""Memory sizes of a DeepSeek-V4 model, parsed from its raw Hugging Face config.

Field names and defaults follow transformers' ``configuration_deepseek_v4.py``; the tensors
counted follow ``modeling_deepseek_v4.py`` (one list per module below).
- Quantized per scheme: every linear (attention q_a/q_b/kv/o_a/o_b, compressors, indexer, routed
  and shared experts). Kept in higher precision: embedding (fp16), LM head (INT8 per output channel in
  quantized builds, fp16 otherwise), router weights
  (fp16), the hash-routing table tid2eid (int32), and in fp32 as transformers keeps them: norms,
  attention sinks, compressor position biases, hyper-connection (mHC) mixers. The MTP layers
  (``num_nextn_predict_layers``) are not loaded and not counted.
- Decode state per layer, as the graph stores it (one KV head, K = V shared): a sliding window of
  ``sliding_window`` entries; CSA layers add ctx/4 + 1 compressed entries and as many indexer keys; HCA
  layers add ctx/128 + 1 compressed entries; both keep their compressor's window buffers. All float32;
  with ``--kv-dtype int8`` window and compressed entries are int8 + one fp16 scale per entry (``int4``: two
  values per byte + an fp16 scale and an fp16 minimum per 16 values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lineside.errors import LinesideError
from lineside.jetson.sizes import (
    FP16,
    QUANT_BITS,
    KVSizes,
    KvStorage,
    WeightSizes,
    check_quant,
    linear_bytes,
    step_logits,
    step_tokens,
)

FP32 = 4
INT32 = 4
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# the keys parse_config requires, at V4-Flash's values (the rest have the same defaults there)
_FLASH_REQUIRED = {"vocab_size": 129280, "hidden_size": 4096, "num_attention_heads": 64, "num_hidden_layers": 43}


@dataclass
class V4Shape:
    """The DeepSeek-V4 hyper-parameters the sizes depend on."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    head_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    moe_inter: int
    experts: int
    shared: int
    top_k: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc: int
    window: int
    layer_types: list[str]
    mlp_types: list[str]
    rates: dict[str, int]
    max_positions: int
    tie: bool

    @classmethod
    def from_raw(cls, d: dict[str, Any]) -> V4Shape:
        """The builder's own config parser (legacy compress_ratios / num_hash_layers too); keys a partial
        config leaves out take V4-Flash's values."""
        from lineside.build.models.deepseek_v4.config import parse_config

        c = parse_config({**_FLASH_REQUIRED, **d})
        return cls(
            vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_layers, heads=c.num_heads, head_dim=c.head_dim,
            q_lora=c.q_lora_rank, o_groups=c.o_groups, o_lora=c.o_lora_rank, moe_inter=c.moe_intermediate_size,
            experts=c.n_routed_experts, shared=1, top_k=c.num_experts_per_tok, index_heads=c.index_n_heads,
            index_head_dim=c.index_head_dim, index_topk=c.index_topk, hc=c.hc_mult, window=c.sliding_window,
            layer_types=c.layer_types, mlp_types=c.mlp_layer_types, rates=dict(c.compress_rates),
            max_positions=c.max_position_embeddings, tie=c.tie_word_embeddings,
        )


def _layer_linears(s: V4Shape, kind: str) -> list[tuple[int, int, int]]:
    """(count, K, N) of the linears in one layer's attention block of ``kind``."""
    h, hd, ihd = s.hidden, s.head_dim, s.index_head_dim
    out = [
        (1, h, s.q_lora),  # q_a_proj
        (1, s.q_lora, s.heads * hd),  # q_b_proj
        (1, h, hd),  # kv_proj
        (s.o_groups, s.heads * hd // s.o_groups, s.o_lora),  # o_a_proj: one block per group
        (1, s.o_groups * s.o_lora, h),  # o_b_proj
    ]
    if kind == CSA:  # compressor (two overlapping series) + lightning indexer
        out += [(2, h, 2 * hd), (2, h, 2 * ihd), (1, s.q_lora, s.index_heads * ihd), (1, h, s.index_heads)]
    elif kind == HCA:
        out += [(2, h, hd)]
    return out


def _layer_fp32_params(s: V4Shape, kind: str, mlp: str) -> int:
    h, hd, ihd, hc = s.hidden, s.head_dim, s.index_head_dim, s.hc
    n = s.q_lora + hd + s.heads + 2 * h  # q_a_norm, kv_norm, sinks, input/post-attention norms
    n += 2 * ((2 + hc) * hc * hc * h + (2 + hc) * hc + 3)  # attn_hc + ffn_hc: fn, base, scale
    if kind == CSA:
        r = s.rates[CSA]
        n += r * 2 * hd + hd + r * 2 * ihd + ihd  # position biases and kv norms (compressor, indexer)
    elif kind == HCA:
        n += s.rates[HCA] * hd + hd
    if mlp == "moe":
        n += s.experts  # e_score_correction_bias
    return n


def v4_weights(s: V4Shape, quant: str, group_size: int = 128) -> WeightSizes:
    """Weight bytes of a DeepSeek-V4 model stored in ``quant``."""
    quant = check_quant(quant)
    h = s.hidden
    attn = experts = shared = router = fp32 = hash_tables = 0
    expert_bytes = linear_bytes(h, 2 * s.moe_inter, quant, group_size) + linear_bytes(
        s.moe_inter, h, quant, group_size
    )
    for kind, mlp in zip(s.layer_types, s.mlp_types, strict=True):
        attn += sum(c * linear_bytes(k, n, quant, group_size) for c, k, n in _layer_linears(s, kind))
        experts += s.experts * expert_bytes
        shared += s.shared * (2 * linear_bytes(h, s.moe_inter, quant, group_size)
                              + linear_bytes(s.moe_inter, h, quant, group_size))
        router += s.experts * h * FP16
        fp32 += _layer_fp32_params(s, kind, mlp) * FP32
        if mlp == "hash_moe":
            hash_tables += s.vocab * s.top_k * INT32
    fp32 += (h + s.hc * s.hc * h + s.hc + 1) * FP32  # final norm + hyper head
    embed = s.vocab * h * FP16
    if QUANT_BITS[quant] < 16:  # the builder keeps an 8-bit head (per output channel), also when tied
        head = s.vocab * h + s.vocab * FP16
    else:
        head = 0 if s.tie else s.vocab * h * FP16
    parts = {
        "routed_experts": experts,
        "shared_experts": shared,
        "attention": attn,
        "embedding": embed,
        "lm_head": head,
        "router": router,
        "hash_tables": hash_tables,
        "fp32_small": fp32,
    }
    return WeightSizes(
        total=sum(parts.values()),
        breakdown=parts,
        notes=[
            f"linears (attention, compressors, indexer, experts) in {quant}",
            "embedding and router weights stay fp16, the LM head INT8 per channel when quantized; tid2eid int32; norms, sinks, "
            "position biases and mHC mixers fp32; MTP layers not loaded",
        ],
    )


F32 = 4  # the V4 graphs keep their decode state in float32 (build/models/deepseek_v4/state.py)


def v4_kv(s: V4Shape, ctx: int, batch: int, kv: KvStorage) -> KVSizes:
    """Decode state as the V4 graph stores it: window + compressed entries (float32, or int8 / int4 + their fp16
    scales with --kv-dtype int8 / int4) + indexer keys and compressor buffers (always float32), per batch."""
    if kv.name == "fp8" and not kv.external:
        raise LinesideError("--kv-dtype fp8: the DeepSeek-V4 graphs store no fp8 state; use --kv-dtype int8")
    hd, ihd = s.head_dim, s.index_head_dim
    # an external engine stores window and compressed entries in its KV dtype (the indexer and compressor
    # state are counted as lineside's graphs keep them: float32, an upper bound)
    entry = kv.vector_bytes(hd) if kv.quantized or kv.external else hd * F32
    window = compressed = indexer = state = 0
    for kind in s.layer_types:
        window += s.window * entry  # the graph keeps the whole window from the first token
        if kind == CSA:
            r = s.rates[CSA]
            n = ctx // r + 1  # every window that can complete, plus the open one
            compressed += n * entry
            indexer += n * ihd * F32
            # kv + gate buffers of two windows (the open one and the previous one's overlap half), 2·d wide
            state += 2 * (2 * r) * (2 * hd + 2 * ihd) * F32
        elif kind == HCA:
            r = s.rates[HCA]
            compressed += (ctx // r + 1) * entry
            state += 2 * r * hd * F32
    parts = {"window": window, "compressed": compressed, "indexer_keys": indexer, "compressor_state": state}
    parts = {k: v * batch for k, v in parts.items()}
    return KVSizes(total=sum(parts.values()), breakdown=parts)


def v4_activations(s: V4Shape, ctx: int, batch: int, prefill_chunk: int = 512) -> int:
    """Peak live intermediates for one step (same upper-bound rules as the dense estimate)."""
    t = step_tokens(ctx, batch, prefill_chunk)
    h, hd = s.hidden, s.head_dim
    streams = s.hc * h * 2  # residual streams in and out of a block
    attn_len = 0
    for kind in set(s.layer_types):
        n = min(ctx, s.window) + t
        if kind == CSA:
            n += min(s.index_topk, ctx // s.rates[CSA])
        elif kind == HCA:
            n += ctx // s.rates[HCA]
        attn_len = max(attn_len, n)
    indexer = s.index_heads * t * (ctx // s.rates[CSA]) * FP32 if CSA in s.layer_types else 0
    attn = t * (streams + h + s.q_lora + 2 * s.heads * hd + s.o_groups * s.o_lora) * FP16
    attn += s.heads * t * attn_len * (4 + 2) + indexer
    mlp = t * (streams + h + (s.top_k + s.shared) * 3 * s.moe_inter) * FP16 + t * s.experts * FP32
    return max(attn, mlp) + step_logits(batch, ctx, prefill_chunk, vocab=s.vocab)
