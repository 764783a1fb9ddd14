"""RoPE tables for the rope-scaling types dense checkpoints use (default, linear, llama3, yarn, dynamic).

The tables are baked into the graph as cos/sin caches ``[max_seq, rotary_dim/2]``, so every
static scaling type costs nothing at run time. Formulas follow transformers' modeling_rope_utils.
``dynamic`` (NTK) is static up to max_position_embeddings, where its frequencies are the default
ones; past it transformers recomputes them from the running length, so no table goes there.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lineside.errors import ConfigError

SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (float64) and the attention factor applied to cos/sin."""
    check_scaling(scaling)
    kind = (scaling or {}).get("rope_type", "default")
    base = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if kind in ("default", "dynamic"):  # dynamic: its frequencies up to max_position_embeddings, where bundles stop
        return base, 1.0
    s = scaling or {}
    if kind == "linear":
        return base / float(s["factor"]), 1.0
    if kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / base
        inv = np.where(wavelen > old / low, base / factor, base)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, inv), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, s, max_position_embeddings)
    raise ConfigError(
        f"rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED)}); "
        "use a checkpoint with static RoPE scaling"
    )


# Fields each scaling type needs (transformers' modeling_rope_utils; yarn derives a missing factor from
# max_position_embeddings), checked before any work.
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"), "yarn": ()}
_OPTIONAL = ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim")


def check_scaling(scaling: dict[str, Any] | None) -> None:
    """One-line ConfigError for an unsupported scaling type or a missing / non-numeric field."""
    if not scaling:
        return
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return
    if kind not in SUPPORTED:
        raise ConfigError(
            f"rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED)}); "
            "use a checkpoint with static RoPE scaling"
        )
    for key in _REQUIRED[kind] + _OPTIONAL:
        v = scaling.get(key)
        if v is None and key in _REQUIRED[kind]:
            raise ConfigError(f"config.json: {kind} rope scaling needs {key!r}; add it to rope_scaling")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v < 0 or (v == 0 and key not in ("mscale", "mscale_all_dim"))):
            raise ConfigError(f"config.json: rope scaling field {key!r} must be a positive number, got {v!r}")
    if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ConfigError("config.json: llama3 rope scaling needs high_freq_factor > low_freq_factor")


def dynamic_past_context(max_seq: int, max_position_embeddings: int, name: str = "the checkpoint") -> str:
    """The one line refusing a context past max_position_embeddings under dynamic RoPE scaling."""
    return (f"--max-seq-len {max_seq} is above the model's context limit {max_position_embeddings} "
            f"(max_position_embeddings of {name}: past it, its 'dynamic' RoPE scaling recomputes the frequencies "
            f"from the running length, which a bundle's fixed tables cannot follow); choose at most "
            f"{max_position_embeddings}")


def _yarn(dim: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[np.ndarray, float]:
    orig = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extra, inter = 1.0 / pos, 1.0 / (factor * pos)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, float(attn)


def rope_cache(dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int,
               max_seq: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables float32 [max_seq, dim/2] including the attention factor."""
    inv, attn = rope_inv_freq(dim, theta, scaling, max_position_embeddings)
    # transformers computes the angles in float32; match it so long positions agree bit-for-bit-ish.
    t = np.arange(max_seq, dtype=np.float32)[:, None] * inv.astype(np.float32)[None, :]
    return (np.cos(t) * attn).astype(np.float32), (np.sin(t) * attn).astype(np.float32)
