"""DeepSeek-V4 config: every field the graph needs, legacy spellings folded in, inconsistencies refused.

Mirrors ``DeepseekV4Config.__post_init__`` of transformers 5.x (the reference), so a config.json
written by transformers or shipped by DeepSeek (``compress_ratios``, ``num_hash_layers``,
``compress_rate_*``, flat ``rope_scaling``) parses to the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lineside.errors import ConfigError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn", "linear")
DEFAULT_RATES = {CSA: 4, HCA: 128}


@dataclass
class V4Config:
    """Parsed DeepSeek-V4 hyper-parameters (names follow transformers' DeepseekV4Config)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)  # "main" / "compress" → rope params
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    mtp_layers: int = 1  # num_nextn_predict_layers: multi-token-prediction blocks the checkpoint may carry (mtp.*)

    def rate(self, layer: int) -> int:
        """Compression rate of a layer (0 for sliding-only layers)."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else self.compress_rates[t]


def _pos_int(d: dict[str, Any], key: str, default: Any = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config.json: DeepSeek-V4 field {key!r} must be a positive integer, got {v!r}")
    return v


def _pos_num(d: dict[str, Any], key: str, default: float) -> float:
    """A positive number field (absent or null: ``default``)."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise ConfigError(f"config.json: DeepSeek-V4 field {key!r} must be a positive number, got {v!r}")
    return float(v)


def _flag(d: dict[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if v is not None and not isinstance(v, bool):
        raise ConfigError(f"config.json: DeepSeek-V4 field {key!r} must be true or false, got {v!r}")
    return bool(v)


def _mtp_extra(d: dict[str, Any]) -> int:
    """num_nextn_predict_layers (transformers' default 1 when absent): the MTP layers, whose per-layer entries a
    config may carry after the main layers' (DeepSeek's compress_ratios does)."""
    v = d.get("num_nextn_predict_layers")
    if v is None:
        return 1
    return 0 if v == 0 and not isinstance(v, bool) else _pos_int(d, "num_nextn_predict_layers")


def _sinkhorn_iters(d: dict[str, Any]) -> int:
    """hc_sinkhorn_iters: 0 runs like 1 (transformers and DeepSeek's reference normalise once, then iters - 1 more)."""
    if d.get("hc_sinkhorn_iters") == 0 and not isinstance(d["hc_sinkhorn_iters"], bool):
        return 1
    return _pos_int(d, "hc_sinkhorn_iters", 20)


def _layer_types(d: dict[str, Any], n: int, rates: dict[str, int]) -> list[str]:
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        ratios = d["compress_ratios"]
        extra = _mtp_extra(d)
        if not isinstance(ratios, list) or len(ratios) not in (n, n + extra):
            raise ConfigError(
                f"config.json: compress_ratios has {len(ratios) if isinstance(ratios, list) else ratios!r} entries "
                f"but num_hidden_layers is {n}; give one ratio (0, {rates[CSA]} or {rates[HCA]}) per layer"
            )
        if rates[CSA] == rates[HCA]:
            raise ConfigError(
                f"config.json: compress_ratios cannot tell compressed_sparse_attention from heavily_compressed_attention "
                f"when both compress rates are {rates[CSA]}; give layer_types instead"
            )
        by_rate = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
        bad = [r for r in ratios if not isinstance(r, (int, float)) or r not in by_rate]  # a list is unhashable
        if bad:
            raise ConfigError(
                f"config.json: compress_ratios value {bad[0]!r} is not 0, {rates[CSA]} or {rates[HCA]} (the compress "
                f"rates); set compress_rate_csa (its layers have an indexer) or compress_rate_hca to the rate it uses"
            )
        return [by_rate[r] for r in ratios[:n]]
    if types is None:
        rest = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        return [HCA] * min(n, 2) + rest
    return _per_layer(types, n, "layer_types", LAYER_TYPES, _mtp_extra(d))


def _mlp_types(d: dict[str, Any], n: int) -> list[str]:
    types = d.get("mlp_layer_types")
    if types is None:
        n_hash = d.get("num_hash_layers")
        n_hash = 3 if n_hash is None else n_hash
        if isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0:
            raise ConfigError(f"config.json: num_hash_layers must be a non-negative integer, got {n_hash!r}")
        return ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    return _per_layer(types, n, "mlp_layer_types", MLP_TYPES, _mtp_extra(d))


def _per_layer(types: Any, n: int, key: str, allowed: tuple[str, ...], extra: int = 0) -> list[str]:
    """A config list with one entry per layer, each one of ``allowed`` (``extra`` trailing MTP entries dropped, as
    transformers keeps the first num_hidden_layers)."""
    if not isinstance(types, list) or len(types) not in (n, n + extra):
        got = len(types) if isinstance(types, list) else types
        raise ConfigError(f"config.json: {key} has {got!r} entries but num_hidden_layers is {n}; make them agree")
    bad = [t for t in types if t not in allowed]
    if bad:
        raise ConfigError(f"config.json: {key} entry {bad[0]!r} is not one of {', '.join(allowed)}")
    return list(types[:n])


def _rope(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"config.json: rope_parameters must be an object, got {rp!r}")
    theta = _pos_num(d, "rope_theta", 10000.0)
    ctheta = _pos_num(d, "compress_rope_theta", 160000.0)
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        out = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
        out["main"].setdefault("rope_theta", theta)
        out["compress"].setdefault("rope_theta", ctheta)
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if "type" in flat and "rope_type" not in flat:
            flat["rope_type"] = flat.pop("type")
        flat.pop("rope_theta", None)
        flat.pop("partial_rotary_factor", None)
        out = {"main": {"rope_type": "default", "rope_theta": theta}, "compress": {**flat, "rope_theta": ctheta}}
        out["compress"].setdefault("rope_type", "default")
        if out["compress"]["rope_type"] == "yarn":
            out["compress"].setdefault("attention_factor", 1.0)
    for label, p in out.items():
        p.setdefault("rope_type", p.pop("type", "default"))
        # YaRN always floors / ceils its correction range here: DeepSeek's reference does, and transformers reads
        # ``truncate`` from the top level of rope_parameters, which V4 nests, so a ``truncate`` given is never used.
        p.pop("truncate", None)
        for key in ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                    "attention_factor"):
            if p.get(key) is not None:
                _pos_num(p, key, 0.0)
        if p["rope_type"] not in ROPE_TYPES:
            raise ConfigError(
                f"config.json: {label} rope type {p['rope_type']!r} is not supported (use one of {', '.join(ROPE_TYPES)})"
            )
        if p["rope_type"] == "yarn" and not p.get("original_max_position_embeddings"):
            raise ConfigError(f"config.json: {label} yarn rope needs 'original_max_position_embeddings'")
    return out


def parse_config(d: dict[str, Any]) -> V4Config:
    """Parse a DeepSeek-V4 config.json dict; raises ConfigError (one line) for inconsistent configs."""
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    n = _pos_int(d, "num_hidden_layers")
    hidden, heads = _pos_int(d, "hidden_size"), _pos_int(d, "num_attention_heads")
    head_dim = _pos_int(d, "head_dim", 512)
    rates = dict(DEFAULT_RATES)
    if isinstance(d.get("compress_rates"), dict):
        rates.update(d["compress_rates"])
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = d["compress_rate_csa"]
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = d["compress_rate_hca"]
    for k in (CSA, HCA):
        _pos_int(rates, k)
    prf = d.get("partial_rotary_factor")
    if prf is None:
        qk = _pos_int(d, "qk_rope_head_dim") if d.get("qk_rope_head_dim") is not None else None
        prf = qk / head_dim if qk is not None else 64 / 512
    rope_dim = int(head_dim * _pos_num({"partial_rotary_factor": prf}, "partial_rotary_factor", 1.0))
    if (d.get("num_key_value_heads") or 1) != 1:
        raise ConfigError(f"config.json: DeepSeek-V4 uses one shared KV head; num_key_value_heads is {d['num_key_value_heads']}")
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"config.json: hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
    if _flag(d, "attention_bias") or _flag(d, "mlp_bias"):
        raise ConfigError("config.json: attention_bias / mlp_bias are not used by DeepSeek-V4; set them to false")
    if d.get("n_shared_experts", 1) != 1:
        raise ConfigError(f"config.json: n_shared_experts is {d.get('n_shared_experts')!r}; DeepSeek-V4 has exactly 1 "
                          "(of moe_intermediate_size), as transformers builds it; this checkpoint is not one lineside can build")
    cfg = V4Config(
        vocab_size=_pos_int(d, "vocab_size"),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=_pos_int(d, "q_lora_rank", 1024),
        o_groups=_pos_int(d, "o_groups", 8),
        o_lora_rank=_pos_int(d, "o_lora_rank", 1024),
        sliding_window=_pos_int(d, "sliding_window", 128),
        layer_types=_layer_types(d, n, rates),
        mlp_layer_types=_mlp_types(d, n),
        compress_rates={CSA: rates[CSA], HCA: rates[HCA]},
        index_n_heads=_pos_int(d, "index_n_heads", 64),
        index_head_dim=_pos_int(d, "index_head_dim", 128),
        index_topk=_pos_int(d, "index_topk", 512),
        hc_mult=_pos_int(d, "hc_mult", 4),
        hc_sinkhorn_iters=_sinkhorn_iters(d),
        hc_eps=_pos_num(d, "hc_eps", 1e-6),
        n_routed_experts=_pos_int(d, "n_routed_experts", 256),
        num_experts_per_tok=_pos_int(d, "num_experts_per_tok", 6),
        moe_intermediate_size=_pos_int(d, "moe_intermediate_size", 2048),
        scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
        routed_scaling_factor=_pos_num(d, "routed_scaling_factor", 1.5),
        swiglu_limit=_pos_num(d, "swiglu_limit", 10.0),
        rms_norm_eps=_pos_num(d, "rms_norm_eps", 1e-6),
        rope=_rope(d),
        max_position_embeddings=_pos_int(d, "max_position_embeddings", 1048576),
        tie_word_embeddings=_flag(d, "tie_word_embeddings"),
        mtp_layers=_mtp_extra(d),
    )
    _check(cfg)
    return cfg


def _check(c: V4Config) -> None:
    if c.rope_dim <= 0 or c.rope_dim % 2 or c.rope_dim > c.head_dim:
        raise ConfigError(f"config.json: rope dim {c.rope_dim} (head_dim × partial_rotary_factor) must be even and ≤ head_dim {c.head_dim}")
    if c.index_head_dim < c.rope_dim and CSA in c.layer_types:
        raise ConfigError(f"config.json: index_head_dim {c.index_head_dim} is smaller than the rope dim {c.rope_dim}")
    if (c.num_heads * c.head_dim) % c.o_groups:
        raise ConfigError(
            f"config.json: o_groups {c.o_groups} does not divide num_attention_heads × head_dim ({c.num_heads * c.head_dim})"
        )
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(
            f"config.json: num_experts_per_tok {c.num_experts_per_tok} exceeds n_routed_experts {c.n_routed_experts}"
        )
    if c.scoring_func not in SCORING:
        raise ConfigError(f"config.json: scoring_func {c.scoring_func!r} is not one of {', '.join(SCORING)}")
