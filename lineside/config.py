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

from lineside.errors import ConfigError

# HF `architectures[0]` / `model_type` → our family name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "deepseek_v4": "deepseek_v4"}
DENSE_FAMILIES = ("llama", "qwen2")
# transformers' own default context for a config.json without max_position_embeddings (LlamaConfig, Qwen2Config)
DEFAULT_CONTEXT = {"llama": 2048, "qwen2": 32768}


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
    attention_bias: bool = False  # q/k/v projections have biases
    o_proj_bias: bool = False  # Llama's attention_bias also gives o_proj one (Qwen2's does not)
    mlp_bias: bool = False  # Llama's mlp_bias: gate/up/down biases
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"; None: all alike
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None: full attention)."""
        if self.layer_types is not None and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def context_limit(self) -> int:
        """Longest context the model is made for: max_position_embeddings, or what its RoPE scaling stretches the
        original length to (linear/yarn/llama3/longrope ``factor`` × original), whichever is larger. ``dynamic``
        stays at max_position_embeddings: past it transformers rescales by the running length (no fixed table)."""
        rs = self.rope_scaling or {}
        factor = rs.get("factor")
        if rs.get("rope_type") == "dynamic":
            return self.max_position_embeddings
        if rs.get("rope_type", "default") == "default" or not isinstance(factor, (int, float)) or factor <= 1:
            return self.max_position_embeddings
        original = rs.get("original_max_position_embeddings") or self.max_position_embeddings
        return max(self.max_position_embeddings, int(factor * original))

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
                intermediate_size=_opt_int(d, "intermediate_size") or _opt_int(d, "moe_intermediate_size") or 0,
                num_layers=_int(d, "num_hidden_layers"),
                num_heads=_int(d, "num_attention_heads"),
                num_kv_heads=_opt_int(d, "num_key_value_heads") or 1,
                head_dim=_opt_int(d, "head_dim") or _int(d, "hidden_size") // _int(d, "num_attention_heads"),
                rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
                rope_theta=_rope_theta(d),
                rope_scaling=_rope_scaling(d),
                max_position_embeddings=_opt_int(d, "max_position_embeddings") or 4096,
                tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
                bos_token_id=_token_id(d, "bos_token_id"),
                eos_token_ids=_eos_list(d.get("eos_token_id")),
                name=name,
                raw=d,
            )
        hidden = _int(d, "hidden_size")
        heads = _int(d, "num_attention_heads")
        kv_heads = _opt_int(d, "num_key_value_heads") or heads
        head_dim = _opt_int(d, "head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"config.json: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                                  f"({heads}) and there is no head_dim; fix the config")
            head_dim = hidden // heads
        if heads % kv_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        layers = _int(d, "num_hidden_layers")
        sliding, layer_types = _sliding(d, arch, layers)
        _check_whole_head_rotary(d)
        # transformers: Qwen2 always has q/k/v biases and never o_proj/MLP ones; Llama's flags cover o_proj too.
        attn_bias = True if arch == "qwen2" else _bool(d, "attention_bias", False)
        cfg = cls(
            architecture=arch,
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d),
            rope_scaling=_rope_scaling(d),
            max_position_embeddings=_opt_int(d, "max_position_embeddings") or DEFAULT_CONTEXT[arch],
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            attention_bias=attn_bias,
            o_proj_bias=attn_bias and arch == "llama",
            mlp_bias=arch == "llama" and _bool(d, "mlp_bias", False),
            sliding_window=sliding,
            layer_types=layer_types,
            bos_token_id=_token_id(d, "bos_token_id"),
            eos_token_ids=_eos_list(d.get("eos_token_id")),
            name=name,
            raw=d,
        )
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"config.json: hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
        return cfg


# `architectures` class names of heads that do not generate text (a classifier's `score`, a bare model): such a
# checkpoint has no LM head, so the build would only say lm_head.weight is missing
NOT_GENERATIVE = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
BARE_MODELS = {name.removesuffix("ForCausalLM") + "Model" for name in ARCHITECTURES}  # LlamaModel, Qwen2Model, ...


def family_of(d: dict[str, Any]) -> str:
    """Map a HF config dict to a supported family name, or raise a ConfigError naming it."""
    archs = _architectures(d.get("architectures"))
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    supported = ", ".join(sorted(ARCHITECTURES))
    headless = next((a for a in archs if a.endswith(NOT_GENERATIVE) or a in BARE_MODELS), None)
    if headless is not None:  # vLLM, too, goes by `architectures` (model_type would only pick the family)
        raise ConfigError(f"config.json: architectures {headless} has no LM head to generate text with; build from "
                          f"the model's causal-LM checkpoint ({supported})")
    mt = d.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise ConfigError(f"config.json: field 'model_type' must be a string such as \"llama\", got {mt!r}")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    if not archs and mt is None:
        raise ConfigError(f"config.json has no 'architectures' or 'model_type' field, so the model is unknown; add "
                          f"the one the model was saved with (supported: {supported})")
    named = ", ".join(archs) if archs else repr(mt)
    raise ConfigError(f"unsupported architecture {named}; supported: {supported}")


def _architectures(value: Any) -> list[str]:
    """config.json's `architectures`: a list of class names (a lone name is taken as one; absent or null: none)."""
    if value is None:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(a, str) for a in names):
        raise ConfigError(f"config.json: field 'architectures' must be a list of class names such as "
                          f"[\"LlamaForCausalLM\"], got {value!r}")
    return names


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
    if v is None:  # said as missing: "must be a positive integer, got None" reads like a bad value
        raise ConfigError(f"config.json: required field {key!r} is missing; copy it from the model's original "
                          "config.json")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config.json: field {key!r} must be a positive integer, got {v!r}")
    return v


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    """A positive integer field that may be absent or null (None then)."""
    return None if d.get(key) is None else _int(d, key)


def _float(d: dict[str, Any], key: str, default: float) -> float:
    """A positive number field (absent or null: ``default``)."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
        raise ConfigError(f"config.json: field {key!r} must be a positive number, got {v!r}")
    return float(v)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"config.json: field {key!r} must be true or false, got {v!r}")
    return v


def _token_id(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ConfigError(f"config.json: field {key!r} must be a token id (integer >= 0), got {v!r}")
    return v


def _sliding(d: dict[str, Any], arch: str, layers: int) -> tuple[int | None, list[str] | None]:
    """Qwen2's sliding window and which layers use it (transformers: layer_types, else i >= max_window_layers)."""
    if arch != "qwen2" or not _bool(d, "use_sliding_window", False):
        return None, None
    window = _opt_int(d, "sliding_window")
    if window is None:
        return None, None
    types = d.get("layer_types")
    if types is None:
        first = d.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError(f"config.json: field 'max_window_layers' must be an integer >= 0, got {first!r}")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise ConfigError(f"config.json: layer_types must list {layers} entries of {' or '.join(kinds)}")
    if "sliding_attention" not in types:
        return None, None
    return window, list(types)


def _check_whole_head_rotary(d: dict[str, Any]) -> None:
    """Llama and Qwen2 rotate the whole head: transformers' models ignore ``partial_rotary_factor`` (5.x; 4.x failed
    on it) while other engines rotate only part, so a factor below 1 (top level, or in rope_parameters as
    transformers 5 writes it) leaves the computation ambiguous and is refused instead of guessed."""
    rope_key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    for where, holder in (("", d), (f"{rope_key}.", _rope_dict(d))):
        partial = _float(holder, "partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ConfigError(f"config.json: {where}partial_rotary_factor {partial} is not supported: transformers' "
                              "Llama/Qwen2 rotate the whole head and ignore it, other engines rotate part of it; "
                              "remove the field if the model was trained rotating the whole head")


def _rope_dict(d: dict[str, Any]) -> dict[str, Any]:
    for key in ("rope_scaling", "rope_parameters"):
        v = d.get(key)
        if v is not None and not isinstance(v, dict):
            raise ConfigError(f"config.json: field {key!r} must be an object, got {v!r}")
    return d.get("rope_scaling") or d.get("rope_parameters") or {}


def _rope_theta(d: dict[str, Any]) -> float:
    """The rope dict's theta (transformers 5's ``rope_parameters``) over a top-level one, as transformers reads them:
    the top-level field only fills in a dict that has none (a stale one beside rope_parameters is ignored)."""
    rp = _rope_dict(d)
    if rp.get("rope_theta") is not None:
        return _float(rp, "rope_theta", 10000.0)
    return _float(d, "rope_theta", 10000.0)


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5 moved rope scaling into ``rope_parameters``; accept both spellings."""
    rs = dict(_rope_dict(d))
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if not isinstance(kind, str):
        raise ConfigError(f"config.json: rope_type must be a string, got {kind!r}")
    if kind == "default":
        return None
    rs["rope_type"] = kind
    return rs


def _eos_list(v: Any) -> list[int]:
    if v is None:
        return []
    items = v if isinstance(v, list) else [v]
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in items):
        raise ConfigError(f"config.json: field 'eos_token_id' must be a token id or a list of them, got {v!r}")
    return list(items)
