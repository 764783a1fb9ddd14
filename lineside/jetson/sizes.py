"""Memory sizes of a dense (Llama / Qwen2) model: weights per scheme, KV cache, activations.

Plain arithmetic on the config, so the numbers can be checked by hand:
- Linear layers (q/k/v/o, gate/up/down) are stored per scheme: W4A16 = 4 bits per weight plus one
  fp16 scale per group of ``group_size`` input rows (symmetric, zero point 0); W8A16 = 8 bits plus
  the same scales; fp16 / fp32 = 2 / 4 bytes.
- The token embedding, norms and biases stay in fp16 (TensorRT 10.3 cannot Gather INT8). The LM head
  is fp16 (none when tied) in fp16 builds and INT8 per output channel (+ one fp16 scale each) in
  W4A16/W8A16 builds — then also when tied, since the fp16 embedding can't serve as the 8-bit head.
- KV cache = 2 (K and V) × layers × kv_heads × (head_dim × bytes + scales) × context × batch; int8 keeps one
  fp16 scale per (token, head) next to the values, int4 two values per byte and an fp16 scale + fp16 minimum per 16,
  as the builder's trt graph does (lineside/kv_layout.py, tied to the builder's KV formats by the tests).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lineside.config import ModelConfig
from lineside.errors import LinesideError
from lineside.kv_layout import KV_LAYOUTS

QUANT_BITS = {"w4a16": 4, "w8a16": 8, "fp16": 16, "fp32": 32}
KV_DTYPES = tuple(KV_LAYOUTS)  # what lineside's own graphs may store
EXTERNAL_KV_DTYPES = ("fp16", "int8", "fp8")  # what a datacenter engine's own cache takes (deploy datacenter)
FP16 = 2


@dataclass(frozen=True)
class Grid:
    """How 4/8-bit linear weights are blocked: weights per block along K and the fp16 values each block stores
    (1: a scale, symmetric; 2: scale + minimum, GGUF Q4_1). ``source`` says where it was read from."""

    group_size: int = 128
    fp16_per_group: int = 1
    source: str = ""

    def describe(self) -> str:
        what = "fp16 scale" + (" + fp16 minimum" if self.fp16_per_group == 2 else "")
        return f"{what} per {self.group_size} weights" + (f", {self.source}" if self.source else "")


def as_grid(grid: Grid | int) -> Grid:
    return grid if isinstance(grid, Grid) else Grid(int(grid))


@dataclass(frozen=True)
class KvStorage:
    """How the builder stores one cached head vector: packed values plus a per-vector scale (kv_layout.py)."""

    name: str
    value_bits: int
    scale_bytes: int  # of one scale
    external: bool = False  # the cache of another engine (vLLM, SGLang, TensorRT-LLM), not of lineside's graphs

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0

    def vector_bytes(self, n: int) -> int:
        return KV_LAYOUTS[self.name].vector_bytes(n)


@dataclass
class WeightSizes:
    """Weight bytes and how they split (quantized linears vs what stays in higher precision)."""

    total: int
    breakdown: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class KVSizes:
    """KV-cache (decode state) bytes for ``batch`` sequences of ``ctx`` tokens."""

    total: int
    breakdown: dict[str, int] = field(default_factory=dict)


def check_quant(quant: str) -> str:
    q = quant.strip().lower()
    if q not in QUANT_BITS:
        raise LinesideError(f"unknown quantization {quant!r}; choose one of: {', '.join(QUANT_BITS)}")
    return q


def check_kv_dtype(kv_dtype: str, *, external: bool = False) -> KvStorage:
    """``external``: sizing a datacenter engine's own cache (deploy datacenter), which stores every entry in
    the KV dtype — fp8 included — instead of the layout lineside's graphs emit."""
    k = kv_dtype.strip().lower()
    known = EXTERNAL_KV_DTYPES if external else KV_DTYPES
    if k not in known:
        raise LinesideError(f"unknown KV dtype {kv_dtype!r}; choose one of: {', '.join(known)}")
    lay = KV_LAYOUTS[k]
    return KvStorage(k, lay.value_bits, lay.scale_bytes, external)


def linear_bytes(k: int, n: int, quant: str, group_size: Grid | int = 128) -> int:
    """Bytes of one [K in, N out] linear weight in ``quant`` (per group of K rows: an fp16 scale, and an fp16
    minimum too for a Q4_1 grid)."""
    bits = QUANT_BITS[quant]
    if bits >= 16:
        return k * n * bits // 8
    g = as_grid(group_size)
    return math.ceil(k * n * bits / 8) + math.ceil(k / g.group_size) * n * FP16 * g.fp16_per_group


def dense_linears(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of every linear weight in one decoder layer."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


# The checkpoint names of dense_linears' weights, in its order (what a manifest's carried_from_source lists).
DENSE_LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def dense_weights(cfg: ModelConfig, quant: str, group_size: Grid | int = 128,
                  carried: Mapping[str, tuple[str, Grid]] | None = None) -> WeightSizes:
    """Weight bytes of a dense decoder (Llama / Qwen2) stored in ``quant``; ``carried``: linears (by checkpoint
    name) a bundle holds in another scheme and grid (GGUF blocks carried as they are)."""
    quant = check_quant(quant)
    h, layers = cfg.hidden_size, cfg.num_layers
    shapes = list(zip(DENSE_LINEAR_NAMES, dense_linears(cfg), strict=True))
    linears = 0
    for layer in range(layers):
        for name, (k, n) in shapes:
            q, g = (carried or {}).get(f"model.layers.{layer}.{name}.weight", (quant, group_size))
            linears += linear_bytes(k, n, q, g)
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    biases = ((q + 2 * kv) * cfg.attention_bias + h * cfg.o_proj_bias
              + (2 * cfg.intermediate_size + h) * cfg.mlp_bias) * FP16 * layers
    norms = (2 * h * layers + h) * FP16
    embed = cfg.vocab_size * h * FP16
    if QUANT_BITS[quant] < 16:  # the builder keeps an 8-bit head (manifest: kept_high_precision)
        head = cfg.vocab_size * h + cfg.vocab_size * FP16
    else:
        head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h * FP16
    small = biases + norms
    return WeightSizes(
        total=linears + embed + head + small,
        breakdown={"linear": linears, "embedding": embed, "lm_head": head, "norms_biases": small},
        notes=[
            f"linears in {quant}"
            + (f" (+ {as_grid(group_size).describe()})" if QUANT_BITS[quant] < 16 else "")
            + "".join(f"; {c} of {layers * len(shapes)} in {q} ({g.describe()})" for (q, g), c in
                      _counts((carried or {}).values()).items() if not _same(q, g, quant, as_grid(group_size))),
            "token embedding, norms and biases stay fp16"
            + ("; LM head INT8 per channel" if QUANT_BITS[quant] < 16 else ""),
        ],
    )


def _same(q: str, g: Grid, quant: str, grid: Grid) -> bool:
    return (q, g.group_size, g.fp16_per_group) == (quant, grid.group_size, grid.fp16_per_group)


def _counts(items: Iterable[tuple[str, Grid]]) -> dict[tuple[str, Grid], int]:
    out: dict[tuple[str, Grid], int] = {}
    for it in items:
        out[it] = out.get(it, 0) + 1
    return out


def dense_kv(cfg: ModelConfig, ctx: int, batch: int, kv: KvStorage) -> KVSizes:
    """2 × layers × kv_heads × ((head_dim × bytes + scale bytes) × ctx + int4's 4 fp16 first entries) × batch
    (grouped-query attention)."""
    heads = 2 * cfg.num_layers * cfg.num_kv_heads * batch
    entries = heads * kv.vector_bytes(cfg.head_dim) * ctx
    sink = 0 if kv.external else heads * KV_LAYOUTS[kv.name].sink_bytes(cfg.head_dim)
    return KVSizes(total=entries + sink, breakdown={"kv": entries, **({"sink": sink} if sink else {})})


def step_tokens(ctx: int, batch: int, prefill_chunk: int) -> int:
    """Tokens one engine step processes at most: a prefill chunk of one sequence, or one per sequence."""
    return max(batch, min(ctx, prefill_chunk))


def logits_buffer(batch: int, prefill_chunk: int, vocab: int) -> int:
    """The float32 logits buffer the TensorRT backend allocates: [slots, max_logits, vocab], max_logits as
    ``lineside engine`` derives it (at most the prefill chunk, kept under 256 MB). The graph gathers the asked
    positions before the LM head, so no step produces logits for every token of its chunk."""
    from lineside.build.tensorrt.profiles import derive_limits

    lim = derive_limits(max(1, prefill_chunk), vocab, batch, prefill_chunk)
    return batch * lim.max_logits * vocab * 4


def step_logits(batch: int, ctx: int, prefill_chunk: int, *, vocab: int) -> int:
    """lineside's TensorRT logits buffer for a step (the datacenter engines' is lineside.deploy.step_memory)."""
    return logits_buffer(batch, min(ctx, prefill_chunk), vocab)


def dense_activations(cfg: ModelConfig, ctx: int, batch: int, prefill_chunk: int = 512) -> int:
    """Peak live intermediate tensors for one step (TensorRT reuses them across layers) + the logits buffer.

    Attention is written from MatMul/Softmax (no fused kernel): fp32 scores + probabilities at 4 + 2 bytes for
    every head over the whole context (the trt graph keeps both in float32; fp16 probabilities is the best
    TensorRT's fp16 tactics give), so the prefill chunk bounds it: plan() picks the chunk when not pinned.
    """
    t = step_tokens(ctx, batch, prefill_chunk)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    attn = t * (2 * h + 2 * q + 2 * kv) * FP16 + cfg.num_heads * t * ctx * (4 + 2)
    mlp = t * (2 * h + 3 * i) * FP16
    return max(attn, mlp) + step_logits(batch, ctx, prefill_chunk, vocab=cfg.vocab_size)
