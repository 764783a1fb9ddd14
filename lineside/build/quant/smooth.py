"""SmoothQuant for the int8 prefill graph, and each linear's choice of int8 form, judged on calibration text.

A prompt row quantized to int8 as a whole loses its small channels to its few large ones (SmolLM2: +2.1%
perplexity with every linear's row quantized plainly, half of it from ``down_proj``). Dividing each input channel
by ``s = amax_x^alpha / amax_w^(1-alpha)`` and multiplying the weight's column by it (Xiao et al., SmoothQuant,
2023) moves that range into the weights, which are quantized per output channel and so barely mind it. Where the
inputs have no such channels smoothing can cost more than it gives, and where a weight mixes scales thousands apart
in one output channel (a GGUF's extreme blocks) no int8 form holds it: each linear takes whichever of smoothed,
plain or its 4-bit node (kept in the prefill graph) is closest to the float product on sampled calibration rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lineside.build.checkpoint import CheckpointReader
from lineside.build.quant.calibrate import checkpoint_calibration_ids, dense_forward
from lineside.config import ModelConfig
from lineside.strenum import StrEnum

SMOOTH_SEQS = 2  # calibration sequences (of calibrate.SEQ_LEN tokens): the large channels are the same on any text
ALPHA = 0.5  # SmoothQuant's balance between the activations' range and the weights'
SAMPLE_ROWS = 64  # calibration rows per linear input on which the int8 forms are judged
MAX_INT8_ERROR = 0.05  # relative output error on those rows above which a linear keeps its 4-bit node


@dataclass(frozen=True)
class InputStats:
    """A linear input on calibration text: each channel's largest magnitude, and a sample of its rows."""

    amax: np.ndarray  # float32 [in_features]
    rows: np.ndarray  # float32 [<= SAMPLE_ROWS, in_features]


class Int8Form(StrEnum):
    SMOOTHED = "smoothed"
    PLAIN = "plain"
    KEEP_4BIT = "4-bit"  # no int8 form is close enough: the prefill graph keeps the base graph's node


def activation_stats(cfg: ModelConfig, get: Callable[[str], np.ndarray], ids: np.ndarray
                     ) -> dict[tuple[int, str], InputStats]:
    """(layer, group) → InputStats over ``ids``; the groups are dense_forward's (qkv, o, gate_up, down)."""
    stats: dict[tuple[int, str], InputStats] = {}
    rng = np.random.default_rng(0)

    def hook(layer: int, group: str, _names: list[str], x: np.ndarray, _n: dict[str, str]) -> None:
        flat = x.reshape(-1, x.shape[-1]).astype(np.float32)
        pick = np.sort(rng.choice(len(flat), min(SAMPLE_ROWS, len(flat)), replace=False))
        stats[layer, group] = InputStats(np.abs(flat).max(axis=0), np.ascontiguousarray(flat[pick]))

    dense_forward(cfg, get, ids, hook)
    return stats


def prefill_calibration(cfg: ModelConfig, ckpt: CheckpointReader, get: Callable[[str], np.ndarray],
                        calib: Path | None, progress: Callable[[str, int], Callable[[int], None]]
                        ) -> dict[tuple[int, str], InputStats]:
    """activation_stats (weights read through ``get``) over SMOOTH_SEQS sequences of --calib or the shipped text, in
    ``ckpt``'s tokens: one float forward (~1 s for 135M parameters). The shipped text is taken as it tokenizes:
    the prefill graph is built by default, and a model of a dozen tokens (characters, DNA) sees only a few of them
    in it — statistics from those, or none (every linear plain), rather than a failed build. A --calib file
    keeps calibration_ids' checks."""
    ids = checkpoint_calibration_ids(ckpt, cfg, calib, max_seqs=SMOOTH_SEQS, strict=calib is not None)
    if ids.size == 0:
        return {}
    tick = progress("prefill graph calibration", 1)
    stats = activation_stats(cfg, get, ids)
    tick(1)
    return stats


def smooth_scales(act_max: np.ndarray, w: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """float32 ``[K]`` s for ``x @ W^T = (x / s) @ (W * s)^T``; 1 where a channel's statistics say nothing."""
    w_max = np.abs(np.asarray(w, dtype=np.float32)).max(axis=0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.power(np.asarray(act_max, dtype=np.float32), alpha) / np.power(w_max, 1.0 - alpha)
    ok = np.isfinite(s) & (s > 0)
    return np.where(ok, np.clip(s, 1e-4, 1e4), 1.0).astype(np.float32)


def quantize_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float ``[N, K]`` → (int8 ``[K, N]``, float32 scales ``[N]``): 127 steps of each output's largest magnitude."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(codes.T), scales


def int8_error(rows: np.ndarray, w: np.ndarray, s: np.ndarray | None) -> float:
    """Relative error of the prefill graph's int8 product (rows / s quantized per row, W * s per output channel)
    against ``rows @ W^T`` in float; 0 for rows whose product is all zero."""
    ref = rows @ w.T
    x, wq = (rows, w) if s is None else (rows / s, w * s[None, :])
    row_step = np.abs(x).max(axis=1, keepdims=True) / 127
    row_step = np.where(row_step > 0, row_step, 1.0)
    codes, scales = quantize_columns(wq)  # the weights exactly as the prefill graph stores them
    got = (np.rint(x / row_step) * row_step) @ (codes.astype(np.float32) * scales[None, :])
    norm = float(np.linalg.norm(ref))
    return float(np.linalg.norm(got - ref)) / norm if norm > 0 else 0.0


def choose_form(stats: InputStats, w: np.ndarray) -> tuple[Int8Form, np.ndarray | None, float]:
    """(form, smoothing scales for SMOOTHED else None, its error on the sampled rows): the closer of smoothed and
    plain int8, or KEEP_4BIT when even that is off by more than MAX_INT8_ERROR."""
    s = smooth_scales(stats.amax, w)
    with np.errstate(all="ignore"):
        smoothed, plain = int8_error(stats.rows, w, s), int8_error(stats.rows, w, None)
    if not np.isfinite(smoothed) and not np.isfinite(plain):
        return Int8Form.KEEP_4BIT, None, float("inf")
    smoother = smoothed <= plain or not np.isfinite(plain)
    form, err = (Int8Form.SMOOTHED, smoothed) if smoother else (Int8Form.PLAIN, plain)
    if err > MAX_INT8_ERROR:
        return Int8Form.KEEP_4BIT, None, err
    return form, (s if form == Int8Form.SMOOTHED else None), err
