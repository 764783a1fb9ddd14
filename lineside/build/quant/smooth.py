"""SmoothQuant for the int8 prefill graph: activations' largest magnitude per input channel, on calibration text.

A prompt row quantized to int8 as a whole loses its small channels to its few large ones (SmolLM2: +2.1%
perplexity with every linear's row quantized plainly, half of it from ``down_proj``). Dividing each input channel
by ``s = amax_x^alpha / amax_w^(1-alpha)`` and multiplying the weight's column by it (Xiao et al., SmoothQuant,
2023) moves that range into the weights, which are quantized per output channel and so barely mind it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from lineside.build.checkpoint import CheckpointReader
from lineside.build.quant.calibrate import checkpoint_calibration_ids, dense_forward
from lineside.config import ModelConfig

SMOOTH_SEQS = 2  # calibration sequences (of calibrate.SEQ_LEN tokens): the large channels are the same on any text
ALPHA = 0.5  # SmoothQuant's balance between the activations' range and the weights'


def activation_max(cfg: ModelConfig, get: Callable[[str], np.ndarray], ids: np.ndarray
                   ) -> dict[tuple[int, str], np.ndarray]:
    """(layer, group) → float32 ``[in_features]``: each input channel's largest magnitude over ``ids``; groups are
    dense_forward's (``qkv``, ``o``, ``gate_up``, ``down``)."""
    stats: dict[tuple[int, str], np.ndarray] = {}

    def hook(layer: int, group: str, _names: list[str], x: np.ndarray, _n: dict[str, str]) -> None:
        stats[layer, group] = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0).astype(np.float32)

    dense_forward(cfg, get, ids, hook)
    return stats


def prefill_calibration(cfg: ModelConfig, ckpt: CheckpointReader, get: Callable[[str], np.ndarray],
                        calib: Path | None, progress: Callable[[str, int], Callable[[int], None]]
                        ) -> dict[tuple[int, str], np.ndarray]:
    """activation_max (weights read through ``get``) over SMOOTH_SEQS sequences of --calib or the shipped text, in
    ``ckpt``'s tokens: one float forward (~1 s for 135M parameters)."""
    ids = checkpoint_calibration_ids(ckpt, cfg, calib, max_seqs=SMOOTH_SEQS)
    tick = progress("prefill graph calibration", 1)
    stats = activation_max(cfg, get, ids)
    tick(1)
    return stats


def smooth_scales(act_max: np.ndarray, w: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """float32 ``[K]`` s for ``x @ W^T = (x / s) @ (W * s)^T``; 1 where a channel's statistics say nothing."""
    w_max = np.abs(np.asarray(w, dtype=np.float32)).max(axis=0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.power(np.asarray(act_max, dtype=np.float32), alpha) / np.power(w_max, 1.0 - alpha)
    ok = np.isfinite(s) & (s > 0)
    return np.where(ok, np.clip(s, 1e-4, 1e4), 1.0).astype(np.float32)
