"""The model config: one plain type that build, runtime and the Jetson planner share.

Dense models (Llama, Qwen2) are described completely by the common fields; other
architectures (DeepSeek-V4) keep their whole Hugging Face config in ``raw`` and parse
what they need from it in their own module.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trtedge.errors import ConfigError

# HF `architectures[0]` / `model_type` → our family name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "deepseek_v4": "deepseek_v4"}
DENSE_FAMILIES = ("llama", "qwen2")


@dataclass
class ModelConfig:
    """Architecture hyper-parameters needed to emit graphs, size caches and plan memory."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rotary_dim: int | None = None  # None: the whole head_dim is rotated
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers in fp16 (dense GQA)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict; raises ConfigError with the field at fault."""
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        arch = family_of(d)
        if arch not in DENSE_FAMILIES:
            # Other families parse their own fields; keep the common ones that exist.
            return cls(
                architecture=arch,
                vocab_size=_int(d, "vocab_size"),
                hidden_size=_int(d, "hidden_size"),
                intermediate_size=int(d.get("intermediate_size") or d.get("moe_intermediate_size") or 0),
                num_layers=_int(d, "num_hidden_layers"),
                num_heads=_int(d, "num_attention_heads"),
                num_kv_heads=int(d.get("num_key_value_heads") or 1),
                head_dim=int(d.get("head_dim") or _int(d, "hidden_size") // _int(d, "num_attention_heads")),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(d)),
                rope_scaling=_rope_scaling(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_eos_list(d.get("eos_token_id")),
                name=name,
                raw=d,
            )
        hidden = _int(d, "hidden_size")
        heads = _int(d, "num_attention_heads")
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        sliding = None
        if arch == "qwen2" and d.get("use_sliding_window"):
            sliding = int(d.get("sliding_window") or 0) or None
        partial = float(d.get("partial_rotary_factor", 1.0) or 1.0)
        cfg = cls(
            architecture=arch,
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size"),
            num_layers=_int(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(d)),
            rope_scaling=_rope_scaling(d),
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            sliding_window=sliding,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_list(d.get("eos_token_id")),
            name=name,
            raw=d,
        )
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"config.json: hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
        return cfg


def family_of(d: dict[str, Any]) -> str:
    """Map a HF config dict to a supported family name, or raise a ConfigError naming it."""
    archs = d.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    mt = d.get("model_type")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    named = ", ".join(archs) if archs else repr(mt)
    supported = ", ".join(sorted(ARCHITECTURES))
    raise ConfigError(f"unsupported architecture {named}; supported: {supported}")


def load_hf_config(path: Path) -> dict[str, Any]:
    """Read config.json with a one-line error for missing or malformed files."""
    if not path.is_file():
        raise ConfigError(f"{path}: config.json not found; a Hugging Face checkpoint directory needs one")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: malformed JSON ({e}); re-download or fix the file") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return d


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config.json: field {key!r} must be a positive integer, got {v!r}")
    return v


def _rope_theta(d: dict[str, Any]) -> float:
    rp = d.get("rope_parameters") or {}
    return float(d.get("rope_theta") or rp.get("rope_theta") or 10000.0)


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5 moved rope scaling into ``rope_parameters``; accept both spellings."""
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    rs = dict(rs)
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    rs["rope_type"] = kind
    return rs


def _eos_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]
