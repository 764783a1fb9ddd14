"""GPTQ calibration for dense models (Llama/Qwen2): per-layer Hessians from the numpy calibration forward.

Sequential, as in the GPTQ paper: layer i's linears are quantized as soon as their input is seen, and
the forward continues through the *quantized* weights, so later layers are fitted to the inputs they
will really get. q/k/v share one Hessian, gate/up one, o_proj and down_proj their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lineside.build.checkpoint import CheckpointReader
from lineside.build.models.dense import layer_tensor_names
from lineside.build.models.family import Weight, WeightGetter
from lineside.build.quant.calibrate import (
    calibration_nll,
    checkpoint_calibration_ids,
    dense_forward,
)
from lineside.build.quant.gptq import PERCDAMP, gptq_quantize, hessian
from lineside.build.quant.grid import Int4Grid
from lineside.build.quant.rtn import fake_quantize
from lineside.build.quant.spec import QuantSpec
from lineside.config import ModelConfig
from lineside.errors import LinesideError

GPTQ_MAX_SEQS = 16  # up to 4096 calibration tokens, spread over the text (the shipped one has ~8,000)
ERROR_ROWS = 512  # calibration rows the per-layer error report is measured on
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class GptqPlan:
    """GPTQ's INT4 grid for every dense linear (plain data); empty when the guard fell back to RTN."""

    grids: dict[str, Int4Grid] = field(default_factory=dict)
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # group → (rtn, gptq) relative error
    nll_rtn: float | None = None  # calibration loss with RTN weights
    nll_gptq: float | None = None  # ... and with GPTQ weights
    fallback: bool = False  # GPTQ did not help: the build uses RTN
    calibration_tokens: int = 0  # tokens GPTQ was fitted on
    guard_tokens: int = 0  # held-out tokens the two losses are measured on (in-sample if only one sequence)
    seconds: float = 0.0

    def transform(self, name: str, get: WeightGetter) -> Weight:
        """The weight the emitters get: GPTQ's grid for a planned linear, else the source tensor."""
        grid = self.grids.get(name)
        return grid if grid is not None else get(name)

    def record(self) -> dict[str, Any]:
        """The manifest's ``quantization.gptq`` block."""
        groups = sorted({g.group_size for g in self.grids.values()})
        return {"calibration_nll_rtn": self.nll_rtn, "calibration_nll_gptq": self.nll_gptq,
                "fell_back_to_rtn": self.fallback, "calibration_tokens": self.calibration_tokens,
                "guard_tokens": self.guard_tokens,
                "seconds": round(self.seconds, 1), "group_sizes": groups, "percdamp": PERCDAMP, "act_order": False,
                "grid_note": "one INT4 grid serves every flavor: with trt built, a layer whose in_features the "
                             "group size does not divide uses groups of 64 in the cpu flavor too",
                "relative_output_error": {k: {"rtn": round(a, 5), "gptq": round(b, 5)}
                                          for k, (a, b) in self.errors.items()}}


def _rel_err(x: np.ndarray, w: np.ndarray, wq: np.ndarray) -> float:
    d, y = x @ (w - wq).T, x @ w.T
    return float(np.sqrt(np.einsum("ij,ij->", d, d, dtype=np.float64) / max(np.einsum("ij,ij->", y, y), 1e-30)))


def gptq_plan_dense(cfg: ModelConfig, get: Callable[[str], np.ndarray], ids: np.ndarray,
                    group_for: Callable[[int], int], scale_dtype: type = np.float32,
                    progress: Callable[[int], None] = lambda _n: None) -> GptqPlan:
    """GPTQ every linear of a Llama/Qwen2 model on calibration ids [n_seq, seq]; ``group_for(in_features)``."""
    plan = GptqPlan(calibration_tokens=int(ids.size))
    rng = np.random.default_rng(0)

    def quantized_get(name: str) -> np.ndarray:
        grid = plan.grids.get(name)
        return grid.dequantize() if grid is not None else get(name)

    def hook(i: int, group: str, names: list[str], x: np.ndarray, _n: dict[str, str]) -> None:
        ws = [np.asarray(get(n), dtype=np.float32) for n in names]
        w = np.concatenate(ws, axis=0)  # rows quantize independently: one Hessian factorization serves all
        gs = group_for(w.shape[1])
        codes, scales = gptq_quantize(w, hessian(x), gs, scale_dtype=scale_dtype)
        r0 = 0
        for name, wi in zip(names, ws, strict=True):
            r1 = r0 + wi.shape[0]
            plan.grids[name] = Int4Grid(codes[r0:r1], scales[r0:r1], gs)
            r0 = r1
        rows = x.reshape(-1, x.shape[-1])
        rows = rows[rng.choice(rows.shape[0], ERROR_ROWS, replace=False)] if rows.shape[0] > ERROR_ROWS else rows
        wq = np.concatenate([plan.grids[n].dequantize() for n in names], axis=0)
        plan.errors[f"layers.{i}.{group}"] = (_rel_err(rows, w, fake_quantize(w, 4, gs, scale_dtype)),
                                              _rel_err(rows, w, wq))
        if group == "down":
            progress(1)

    dense_forward(cfg, quantized_get, ids, hook)
    return plan


def rtn_getter(cfg: ModelConfig, get: Callable[[str], np.ndarray], group_for: Callable[[int], int],
               scale_dtype: type = np.float32) -> Callable[[str], np.ndarray]:
    """Weights as an RTN build with the same group layout multiplies by them (the guard's baseline)."""
    linears = {v for i in range(cfg.num_layers) for k, v in layer_tensor_names(cfg, i).items() if k in LINEARS}

    def fq(name: str) -> np.ndarray:
        w = np.asarray(get(name), dtype=np.float32)
        return fake_quantize(w, 4, group_for(w.shape[1]), scale_dtype) if name in linears else w

    return fq


def gptq_ids(ckpt: CheckpointReader, cfg: ModelConfig, calib: Path | None) -> np.ndarray:
    """Calibration token ids [n_seq, seq] from --calib or the shipped text, tokenized by the checkpoint."""
    return checkpoint_calibration_ids(ckpt, cfg, calib, max_seqs=GPTQ_MAX_SEQS)


def gptq_plan_for(cfg: ModelConfig, ckpt: CheckpointReader, spec: QuantSpec, flavors: tuple[str, ...], calib: Path | None,
                  progress: Callable[[str, int], Callable[[int], None]], log: Callable[[str], None]) -> GptqPlan:
    """Run GPTQ for a checkpoint; keep it only if its loss on held-out calibration text is below RTN's."""
    if cfg.architecture not in ("llama", "qwen2"):
        raise LinesideError(f"--method gptq is not supported for {cfg.architecture} yet; use --method rtn or awq")
    if spec.scheme != "w4a16":
        raise LinesideError(f"--method gptq writes INT4 weights; use it with --quant w4a16, not {spec.scheme}")
    t0 = time.time()
    trt = "trt" in flavors
    # One grid serves every flavor: the trt block where TensorRT needs it (both flavors then hold the same
    # codes), and fp16-exact scales when the trt flavor stores fp16 ones.
    def group_for(k: int) -> int:
        return spec.trt_group(k) if trt else spec.group_size

    sdt = np.float16 if trt and spec.trt_dtype == "fp16" else np.float32
    ids = gptq_ids(ckpt, cfg, calib)
    # GPTQ fits its calibration tokens closely (few tokens: the loss on them drops while other text gets
    # worse), so the guard compares losses on sequences held out of the fit.
    n_held = ids.shape[0] // 4 if ids.shape[0] >= 2 else 0
    fit, held = (ids[:-n_held], ids[-n_held:]) if n_held else (ids, ids)
    plan = gptq_plan_dense(cfg, ckpt.get, fit, group_for, sdt, progress("GPTQ calibration", cfg.num_layers))
    plan.guard_tokens = int(held.size)
    tick = progress("GPTQ check: held-out loss", 2)
    plan.nll_rtn = calibration_nll(cfg, rtn_getter(cfg, ckpt.get, group_for, sdt), held)
    tick(1)
    plan.nll_gptq = calibration_nll(cfg, lambda n: plan.grids[n].dequantize() if n in plan.grids else ckpt.get(n),
                                    held)
    tick(1)
    plan.seconds = time.time() - t0
    log(f"GPTQ on {fit.size} calibration tokens in {plan.seconds:.0f}s: loss on {held.size} "
        f"{'held-out' if n_held else 'calibration'} tokens RTN {plan.nll_rtn:.4f}, GPTQ {plan.nll_gptq:.4f}")
    if plan.nll_gptq >= plan.nll_rtn:
        log("GPTQ did not lower the calibration loss; using round-to-nearest for every layer")
        plan.grids.clear()
        plan.fallback = True
    return plan
