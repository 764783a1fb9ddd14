"""AWQ calibration for dense models: a float32 numpy forward over calibration text, layer by layer.

Only one layer's weights and the calibration hidden states are in memory at a time. Scales for
q/k/v and gate/up are folded into the preceding RMSNorm, down_proj's into up_proj's rows (all
exact); o_proj gets an explicit ``x / s`` in the graph (GQA makes folding into v_proj inexact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from trtedge.build.models.dense import layer_tensor_names
from trtedge.build.models.rope import rope_cache
from trtedge.config import ModelConfig
from trtedge.errors import TrtedgeError

SEQ_LEN = 256
MAX_SEQS = 4
SEARCH_ROWS = 256
AWQ_GRID = 10  # alphas per scaling family (activation-only and duo): 20 candidates per layer group


@dataclass
class AwqPlan:
    """Per-tensor transforms the build applies before quantizing (plain data; logged in the manifest)."""

    col_scale: dict[str, np.ndarray] = field(default_factory=dict)  # W[:, j] *= s[j]
    row_div: dict[str, np.ndarray] = field(default_factory=dict)  # W[i, :] /= s[i]
    norm_div: dict[str, np.ndarray] = field(default_factory=dict)  # gamma /= s
    input_scale: dict[str, np.ndarray] = field(default_factory=dict)  # graph feeds x / s (emit_linear awq_scale)
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # group → (rtn, awq) relative error

    def transform(self, name: str, w: Any) -> Any:
        if name in self.norm_div:
            return np.asarray(w, dtype=np.float32) / self.norm_div[name]
        if name in self.col_scale or name in self.row_div:
            w = np.array(w, dtype=np.float32)
            if name in self.col_scale:
                w *= self.col_scale[name][None, :]
            if name in self.row_div:
                w /= self.row_div[name][:, None]
        return w


def default_calibration_text() -> str:
    return resources.files("trtedge.data").joinpath("calibration.txt").read_text(encoding="utf-8")


def calibration_ids(tokenize: Callable[[str], list[int]], text: str) -> np.ndarray:
    ids = tokenize(text)
    if len(ids) < 16:
        raise TrtedgeError("calibration text is too short (fewer than 16 tokens); give a longer --calib file")
    n = min(MAX_SEQS, max(1, len(ids) // SEQ_LEN))
    length = min(SEQ_LEN, len(ids))
    return np.asarray(ids[: n * length], dtype=np.int64).reshape(n, length)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    r = cos.shape[-1] * 2
    x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None) -> np.ndarray:
    """q [B, S, H, D], k/v [B, S, KV, D] → [B, S, H*D], causal."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = j <= i if window is None else (j <= i) & (j > i - window)
    scores = np.where(allowed, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, h * d)


def _sample(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] > SEARCH_ROWS:
        x = x[rng.choice(x.shape[0], SEARCH_ROWS, replace=False)]
    return x


def awq_plan_dense(cfg: ModelConfig, get: Callable[[str], np.ndarray], ids: np.ndarray, group_size: int | None,
                   bits: int, progress: Callable[[int], None] = lambda _n: None) -> AwqPlan:
    """Search AWQ scales for every linear of a Llama/Qwen2 model on calibration ids [n_seq, seq]."""
    from trtedge.build.quant.awq import awq_search

    plan = AwqPlan()
    rng = np.random.default_rng(0)
    nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rot = cfg.rotary_dim or d
    cos, sin = rope_cache(rot, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, ids.shape[1])
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    h = np.asarray(get("model.embed_tokens.weight"), dtype=np.float32)[ids]  # [B, S, H]
    bsz, seq, _ = h.shape

    def lin(x: np.ndarray, name: str, bias: str | None = None) -> np.ndarray:
        y = x @ np.asarray(get(name), dtype=np.float32).T
        return y + np.asarray(get(bias), dtype=np.float32) if bias else y

    def search(names: list[str], x: np.ndarray, key: str) -> np.ndarray:
        w = np.concatenate([np.asarray(get(n), dtype=np.float32) for n in names], axis=0)
        s, e_rtn, e_awq = awq_search(w, _sample(x, rng), group_size, bits, n_grid=AWQ_GRID)
        plan.errors[key] = (e_rtn, e_awq)
        return s

    for i in range(cfg.num_layers):
        n = layer_tensor_names(cfg, i)
        x = _rms(h, np.asarray(get(n["ln1"]), dtype=np.float32), cfg.rms_norm_eps)
        s = search([n["q"], n["k"], n["v"]], x, f"layers.{i}.qkv")
        plan.norm_div[n["ln1"]] = s
        for k in ("q", "k", "v"):
            plan.col_scale[n[k]] = s
        q = _rope(lin(x, n["q"], n.get("qb")).reshape(bsz, seq, nh, d), cos, sin)
        kk = _rope(lin(x, n["k"], n.get("kb")).reshape(bsz, seq, kvh, d), cos, sin)
        v = lin(x, n["v"], n.get("vb")).reshape(bsz, seq, kvh, d)
        att = _attention(q, kk, v, cfg.sliding_window)
        plan.input_scale[n["o"]] = search([n["o"]], att, f"layers.{i}.o")
        h = h + lin(att, n["o"])
        x = _rms(h, np.asarray(get(n["ln2"]), dtype=np.float32), cfg.rms_norm_eps)
        s = search([n["gate"], n["up"]], x, f"layers.{i}.gate_up")
        plan.norm_div[n["ln2"]] = s
        plan.col_scale[n["gate"]] = plan.col_scale[n["up"]] = s
        gate = lin(x, n["gate"])
        act = gate / (1 + np.exp(-gate)) * lin(x, n["up"])
        s = search([n["down"]], act, f"layers.{i}.down")
        plan.row_div[n["up"]], plan.col_scale[n["down"]] = s, s
        h = h + lin(act, n["down"])
        progress(1)
    return plan


def awq_scales_for(cfg: ModelConfig, ckpt: Any, spec: Any, calib: Path | None,
                   progress: Callable[[str, int], Callable[[int], None]],
                   log: Callable[[str], None]) -> AwqPlan:
    """Run AWQ calibration for a checkpoint; the text comes from --calib or the shipped default."""
    if cfg.architecture not in ("llama", "qwen2"):
        raise TrtedgeError(f"--method awq is not supported for {cfg.architecture} yet; use --method rtn")
    import tempfile

    from tokenizers import Tokenizer as HFTokenizer

    text = Path(calib).read_text(encoding="utf-8", errors="replace") if calib else default_calibration_text()
    with tempfile.TemporaryDirectory() as td:
        ckpt.write_tokenizer(Path(td))
        tok = HFTokenizer.from_file(str(Path(td) / "tokenizer.json"))
    ids = calibration_ids(lambda t: tok.encode(t, add_special_tokens=False).ids, text)
    ids = np.clip(ids, 0, cfg.vocab_size - 1)
    bits = 4 if spec.scheme == "w4a16" else 8
    tick = progress("AWQ calibration", cfg.num_layers)
    plan = awq_plan_dense(cfg, ckpt.get, ids, spec.group_size if bits == 4 else None, bits, tick)
    rtn = np.mean([e[0] for e in plan.errors.values()])
    awq = np.mean([e[1] for e in plan.errors.values()])
    log(f"AWQ on {ids.size} calibration tokens: mean relative output error RTN {rtn:.4f} → AWQ {awq:.4f}")
    return plan
