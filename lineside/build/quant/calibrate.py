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

import numpy as np

from lineside.build.checkpoint import CheckpointReader
from lineside.build.models.dense import layer_tensor_names
from lineside.build.models.family import Weight
from lineside.build.models.rope import rope_cache
from lineside.build.quant.spec import QuantSpec
from lineside.config import ModelConfig
from lineside.errors import LinesideError

SEQ_LEN = 256
MAX_SEQS = 4
AWQ_HELD_SEQS = 2  # sequences kept out of AWQ's search to judge it on (every third of the spread)
SEARCH_ROWS = 512
AWQ_GRID = 10  # alphas per scaling family (activation-only and duo): 20 candidates per layer group


@dataclass
class AwqPlan:
    """Per-tensor transforms the build applies before quantizing (plain data; logged in the manifest)."""

    col_scale: dict[str, np.ndarray] = field(default_factory=dict)  # W[:, j] *= s[j]
    row_div: dict[str, np.ndarray] = field(default_factory=dict)  # W[i, :] /= s[i]
    norm_div: dict[str, np.ndarray] = field(default_factory=dict)  # gamma /= s
    input_scale: dict[str, np.ndarray] = field(default_factory=dict)  # graph feeds x / s (emit_linear awq_scale)
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # group → (rtn, awq) relative error
    nll_rtn: float | None = None  # calibration loss with RTN weights
    nll_awq: float | None = None  # ... and with AWQ weights
    fallback: bool = False  # AWQ did not help: the build uses RTN scales
    guard_tokens: int = 0  # tokens the two losses are measured on
    guard_held_out: bool = False  # ... held out of the scale search (in-sample when the text is too short)

    def transform(self, name: str, w: Weight) -> Weight:
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
    return resources.files("lineside.data").joinpath("calibration.txt").read_text(encoding="utf-8")


def read_calibration_text(path: Path) -> str:
    """A --calib file as text: a few undecodable bytes become U+FFFD, but a binary file is refused."""
    raw = Path(path).read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if b"\0" in raw or text.count("\ufffd") > len(text) // 4:
        raise LinesideError(f"--calib {path}: not a text file (binary or not UTF-8); give plain UTF-8 text")
    return text


def calibration_ids(tokenize: Callable[[str], list[int]], text: str, max_seqs: int | None = None,
                    strict: bool = True) -> np.ndarray:
    """Token ids [n_seq, SEQ_LEN]; a text longer than max_seqs sequences gives ones spread over all of it.
    ``strict`` false: whatever the text gives (no ids: an empty [0, 0] array), without the length and variety
    checks meant for a --calib file (through a tokenizer of a dozen tokens the shipped text is a few ids)."""
    ids = tokenize(text)
    if not ids and not strict:
        return np.zeros((0, 0), dtype=np.int64)
    if strict and len(ids) < 16:
        raise LinesideError("calibration text is too short (fewer than 16 tokens); give a longer --calib file")
    if strict and len(set(ids)) < 16:  # one character or word repeated: every layer would be fitted to one input
        raise LinesideError(f"calibration text has only {len(set(ids))} distinct tokens; give --calib varied text "
                            "like what the model will serve")
    length = min(SEQ_LEN, len(ids))
    seqs = np.asarray(ids[: max(1, len(ids) // length) * length], dtype=np.int64).reshape(-1, length)
    n = min(MAX_SEQS if max_seqs is None else max_seqs, len(seqs))
    # The shipped text is a run of short, different sections: a spread keeps that variety in a few sequences.
    return seqs[np.linspace(0, len(seqs) - 1, n).round().astype(int)]


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
    # matmul on [B, H, S, D] (BLAS); einsum of the same took 8x as long (SmolLM2, 512 tokens: 2.2 s of 2.7)
    qh, kh, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    scores = np.matmul(qh, kh.transpose(0, 1, 3, 2)) / np.sqrt(d)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = j <= i if window is None else (j <= i) & (j > i - window)
    scores = np.where(allowed, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return np.matmul(p, vh).transpose(0, 2, 1, 3).reshape(b, s, h * d)


def _sample(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] > SEARCH_ROWS:
        x = x[rng.choice(x.shape[0], SEARCH_ROWS, replace=False)]
    return x


LinearHook = Callable[[int, str, list[str], np.ndarray, dict[str, str]], None]


def dense_forward(cfg: ModelConfig, get: Callable[[str], np.ndarray], ids: np.ndarray,
                  hook: LinearHook | None = None) -> np.ndarray:
    """float32 forward of a Llama/Qwen2 model over ids [n_seq, seq] → hidden states before the final norm.

    ``hook(layer, group, names, x, names_of_layer)`` sees the input of each group of linears that share it
    (``qkv``, ``o``, ``gate_up``, ``down``) before they run.
    """
    nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_cache(cfg.rotary_dim or d, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                          ids.shape[1])
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    h = np.asarray(get("model.embed_tokens.weight"), dtype=np.float32)[ids]  # [B, S, H]
    bsz, seq, _ = h.shape
    hook = hook or (lambda *_: None)

    def lin(x: np.ndarray, name: str, bias: str | None = None) -> np.ndarray:
        y = x @ np.asarray(get(name), dtype=np.float32).T
        return y + np.asarray(get(bias), dtype=np.float32) if bias else y

    for i in range(cfg.num_layers):
        n = layer_tensor_names(cfg, i)
        x = _rms(h, np.asarray(get(n["ln1"]), dtype=np.float32), cfg.rms_norm_eps)
        hook(i, "qkv", [n["q"], n["k"], n["v"]], x, n)
        q = _rope(lin(x, n["q"], n.get("qb")).reshape(bsz, seq, nh, d), cos, sin)
        kk = _rope(lin(x, n["k"], n.get("kb")).reshape(bsz, seq, kvh, d), cos, sin)
        v = lin(x, n["v"], n.get("vb")).reshape(bsz, seq, kvh, d)
        att = _attention(q, kk, v, cfg.layer_window(i))
        hook(i, "o", [n["o"]], att, n)
        h = h + lin(att, n["o"], n.get("ob"))
        x = _rms(h, np.asarray(get(n["ln2"]), dtype=np.float32), cfg.rms_norm_eps)
        hook(i, "gate_up", [n["gate"], n["up"]], x, n)
        gate = lin(x, n["gate"], n.get("gateb"))
        act = gate / (1 + np.exp(-gate)) * lin(x, n["up"], n.get("upb"))
        hook(i, "down", [n["down"]], act, n)
        h = h + lin(act, n["down"], n.get("downb"))
    return h


def calibration_nll(cfg: ModelConfig, get: Callable[[str], np.ndarray], ids: np.ndarray) -> float:
    """Mean next-token negative log-likelihood of the calibration ids under the weights ``get`` returns."""
    h = _rms(dense_forward(cfg, get, ids), np.asarray(get("model.norm.weight"), np.float32), cfg.rms_norm_eps)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    logits = h[:, :-1] @ np.asarray(get(head), dtype=np.float32).T
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tgt = ids[:, 1:]
    return float(-np.take_along_axis(logp, tgt[..., None], -1).mean())


def awq_plan_dense(cfg: ModelConfig, get: Callable[[str], np.ndarray], ids: np.ndarray, group_size: int | None,
                   bits: int, progress: Callable[[int], None] = lambda _n: None) -> AwqPlan:
    """Search AWQ scales for every linear of a Llama/Qwen2 model on calibration ids [n_seq, seq]."""
    from lineside.build.quant.awq import _output_error, awq_search

    plan = AwqPlan()
    rng = np.random.default_rng(0)

    def search(names: list[str], x: np.ndarray, key: str) -> np.ndarray:
        """Search on half of the calibration rows; keep the scale only if it also wins on the other half."""
        w = np.concatenate([np.asarray(get(n), dtype=np.float32) for n in names], axis=0)
        rows = _sample(x, rng)
        fit, held = rows[0::2], rows[1::2]
        s, _, _ = awq_search(w, fit, group_size, bits, n_grid=AWQ_GRID)
        ones = np.ones_like(s)
        e_rtn, e_awq = (_output_error(w, held, v, bits, group_size) for v in (ones, s))
        if e_awq >= e_rtn:
            s, e_awq = ones, e_rtn
        ref = max(float(np.einsum("ij,ij->", held @ w.T, held @ w.T)), 1e-30)
        plan.errors[key] = (float(np.sqrt(e_rtn / ref)), float(np.sqrt(e_awq / ref)))
        return s

    def hook(i: int, group: str, names: list[str], x: np.ndarray, n: dict[str, str]) -> None:
        s = search(names, x, f"layers.{i}.{group}")
        if group == "qkv":
            plan.norm_div[n["ln1"]] = s
            for k in ("q", "k", "v"):
                plan.col_scale[n[k]] = s
        elif group == "o":
            plan.input_scale[n["o"]] = s
        elif group == "gate_up":
            plan.norm_div[n["ln2"]] = s
            plan.col_scale[n["gate"]] = plan.col_scale[n["up"]] = s
        else:
            plan.row_div[n["up"]], plan.col_scale[n["down"]] = s, s
            if "upb" in n:  # up's output is divided by s: its bias too (a 1-D division, like a norm's)
                plan.norm_div[n["upb"]] = s
            progress(1)

    dense_forward(cfg, get, ids, hook)
    return plan


def _fake_quant_getter(cfg: ModelConfig, get: Callable[[str], np.ndarray], bits: int, group_size: int | None,
                       plan: AwqPlan | None) -> Callable[[str], np.ndarray]:
    """Weights as the quantized graph multiplies by them (RTN, or AWQ-transformed then quantized)."""
    from lineside.build.quant.rtn import fake_quantize

    linears = {v for i in range(cfg.num_layers) for k, v in layer_tensor_names(cfg, i).items()
               if k in ("q", "k", "v", "o", "gate", "up", "down")}

    def fq(name: str) -> np.ndarray:
        w = np.asarray(get(name), dtype=np.float32)
        if plan is not None:
            w = np.asarray(plan.transform(name, w), dtype=np.float32)
        if name not in linears:
            return w
        s = plan.input_scale.get(name) if plan is not None else None
        if s is not None:
            return fake_quantize(w * s[None, :], bits, group_size) / s[None, :]
        return fake_quantize(w, bits, group_size)

    return fq


def checkpoint_calibration_ids(ckpt: CheckpointReader, cfg: ModelConfig, calib: Path | None,
                               max_seqs: int | None = None, strict: bool = True) -> np.ndarray:
    """calibration_ids of --calib or the shipped text, tokenized by the checkpoint's own tokenizer, clipped to
    the vocabulary (``strict``: see calibration_ids)."""
    import tempfile

    from tokenizers import Tokenizer as HFTokenizer

    text = read_calibration_text(Path(calib)) if calib else default_calibration_text()
    with tempfile.TemporaryDirectory() as td:
        ckpt.write_tokenizer(Path(td))
        tok = HFTokenizer.from_file(str(Path(td) / "tokenizer.json"))
    ids = calibration_ids(lambda t: tok.encode(t, add_special_tokens=False).ids, text, max_seqs=max_seqs,
                          strict=strict)
    return np.clip(ids, 0, cfg.vocab_size - 1)


def awq_scales_for(cfg: ModelConfig, ckpt: CheckpointReader, spec: QuantSpec, calib: Path | None,
                   progress: Callable[[str, int], Callable[[int], None]],
                   log: Callable[[str], None]) -> AwqPlan:
    """Run AWQ calibration for a checkpoint; the text comes from --calib or the shipped default."""
    if cfg.architecture not in ("llama", "qwen2"):
        raise LinesideError(f"--method awq is not supported for {cfg.architecture} yet; use --method rtn")
    ids = checkpoint_calibration_ids(ckpt, cfg, calib, max_seqs=MAX_SEQS + AWQ_HELD_SEQS)
    fit, held = split_held_out(ids)
    bits = 4 if spec.scheme == "w4a16" else 8
    tick = progress("AWQ calibration", cfg.num_layers)
    gs = spec.group_size if bits == 4 else None
    plan = awq_plan_dense(cfg, ckpt.get, fit, gs, bits, tick)
    # Per-layer output error is only a proxy, and the loss on the searched text flatters AWQ (on SmolLM2 it
    # fell while perplexity elsewhere rose): keep AWQ only if the loss on held-out text improves.
    plan.nll_rtn = calibration_nll(cfg, _fake_quant_getter(cfg, ckpt.get, bits, gs, None), held)
    plan.nll_awq = calibration_nll(cfg, _fake_quant_getter(cfg, ckpt.get, bits, gs, plan), held)
    plan.guard_tokens, plan.guard_held_out = int(held.size), held is not fit
    where = "held-out" if held is not fit else "calibration"
    log(f"AWQ on {fit.size} calibration tokens: loss on {held.size} {where} tokens RTN {plan.nll_rtn:.4f}, "
        f"AWQ {plan.nll_awq:.4f}")
    if plan.nll_awq >= plan.nll_rtn:
        log(f"AWQ did not lower the {where} loss; using round-to-nearest scales for every layer")
        return AwqPlan(errors=plan.errors, nll_rtn=plan.nll_rtn, nll_awq=plan.nll_awq, fallback=True,
                       guard_tokens=plan.guard_tokens, guard_held_out=plan.guard_held_out)
    return plan


def split_held_out(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fit, held-out) sequences: every third one is held out; with fewer than 3, both are all of them."""
    if ids.shape[0] < 3:
        return ids, ids
    held = np.zeros(ids.shape[0], dtype=bool)
    held[2::3] = True
    return ids[~held], ids[held]
