"""Key centering of int4 KV caches: the mean post-RoPE key of each (layer, KV head), from calibration text.

Softmax is unchanged when every key a query scores moves by the same vector m (each score moves by q·m),
so the cache may store k − m exactly. Keys carry a large common component (SmolLM2: |m| 13–26 per head),
which a 4-bit per-token grid otherwise spends its 15 levels on; without it the grid follows what varies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from lineside.build.checkpoint import CheckpointReader
from lineside.build.models.rope import rope_cache
from lineside.build.quant.calibrate import _rope, checkpoint_calibration_ids, dense_forward
from lineside.config import ModelConfig


def key_means(cfg: ModelConfig, get: Callable[[str], np.ndarray], ids: np.ndarray) -> np.ndarray:
    """[layers, kv_heads, head_dim] float32: the mean post-RoPE key over ids [n_seq, seq] (float32 forward)."""
    kvh, d = cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_cache(cfg.rotary_dim or d, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                          ids.shape[1])
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    means = np.zeros((cfg.num_layers, kvh, d), np.float32)

    def hook(layer: int, group: str, _names: list[str], x: np.ndarray, n: dict[str, str]) -> None:
        if group != "qkv":
            return
        k = x @ np.asarray(get(n["k"]), np.float32).T
        if n.get("kb"):
            k = k + np.asarray(get(n["kb"]), np.float32)
        k = _rope(k.reshape(*x.shape[:2], kvh, d), cos, sin)
        means[layer] = k.reshape(-1, kvh, d).mean(0)

    dense_forward(cfg, get, ids, hook)
    return means


def key_means_for(cfg: ModelConfig, ckpt: CheckpointReader, calib: Path | None,
                  log: Callable[[str], None]) -> np.ndarray:
    """key_means on --calib or the shipped calibration text, read with the checkpoint's float weights."""
    ids = checkpoint_calibration_ids(ckpt, cfg, calib)
    means = key_means(cfg, ckpt.get, ids)
    log(f"int4 KV: mean keys of {cfg.num_layers} layers from {ids.size} calibration tokens "
        f"(norm per head {float(np.linalg.norm(means, axis=-1).mean()):.2f} on average)")
    return means
