"""DeepSeek-V4's MTP module for the tests: random ``mtp.0.*`` tensors named and shaped as DeepSeek's release names
them, and an independent numpy implementation of the published formula (DeepSeek's ``MTPBlock.forward``:
e_proj(enorm(embed(t[p+1]))) + h_proj(hnorm(h_p)) → Block (mHC + sliding-window attention + top-k MoE) →
hc_head → norm → the shared LM head), written from the reference code, not from lineside's graph emitters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np


def mtp_tensors(cfg: dict, seed: int = 5) -> dict[str, np.ndarray]:
    """Random float32 ``mtp.0.*`` tensors for a transformers DeepseekV4Config dict (official names and shapes)."""
    rng = np.random.default_rng(seed)
    d, n, hd, heads = cfg["hidden_size"], cfg["hc_mult"], cfg["head_dim"], cfg["num_attention_heads"]
    q, g, olr, e, i = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"], cfg["n_routed_experts"], \
        cfg["moe_intermediate_size"]
    mix = (2 + n) * n

    def lin(o: int, k: int) -> np.ndarray:
        return (rng.standard_normal((o, k)) / k ** 0.5).astype(np.float32)

    def norm(k: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)

    def vec(*shape: int) -> np.ndarray:
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)

    t = {"e_proj.weight": lin(d, d), "h_proj.weight": lin(d, d), "enorm.weight": norm(d), "hnorm.weight": norm(d),
         "norm.weight": norm(d), "hc_head_fn": lin(n, n * d), "hc_head_base": vec(n), "hc_head_scale": vec(1),
         "attn_norm.weight": norm(d), "ffn_norm.weight": norm(d),
         "attn.wq_a.weight": lin(q, d), "attn.q_norm.weight": norm(q), "attn.wq_b.weight": lin(heads * hd, q),
         "attn.wkv.weight": lin(hd, d), "attn.kv_norm.weight": norm(hd), "attn.wo_a.weight": lin(g * olr, heads * hd // g),
         "attn.wo_b.weight": lin(d, g * olr), "attn.attn_sink": vec(heads),
         "ffn.gate.weight": lin(e, d), "ffn.gate.bias": vec(e),
         "ffn.shared_experts.w1.weight": lin(i, d), "ffn.shared_experts.w3.weight": lin(i, d),
         "ffn.shared_experts.w2.weight": lin(d, i)}
    for hc in ("attn", "ffn"):
        t[f"hc_{hc}_fn"], t[f"hc_{hc}_base"], t[f"hc_{hc}_scale"] = lin(mix, n * d), vec(mix), vec(3)
    for x in range(e):
        t[f"ffn.experts.{x}.w1.weight"], t[f"ffn.experts.{x}.w3.weight"] = lin(i, d), lin(i, d)
        t[f"ffn.experts.{x}.w2.weight"] = lin(d, i)
    return {f"mtp.0.{k}": v for k, v in t.items()}


def with_mtp(src: Path, dst: Path, seed: int = 5, quantized: bool = False) -> Path:
    """A copy of the checkpoint ``src`` whose safetensors also carry ``mtp.0.*`` (num_nextn_predict_layers 1).
    ``quantized``: as DeepSeek ships them — FP8 e4m3 with ue8m0 128×128 block scales (``.scale``) for the block's
    linears and e_proj/h_proj, MXFP4 for the routed experts; norms, hc mixers, sinks and the router stay float."""
    import torch
    from safetensors.torch import load_file, save_file

    from lineside.build.checkpoint.fp8_mxfp4 import quantize_fp8_blocks, quantize_mxfp4

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    out = load_file(str(dst / "model.safetensors"))
    for name, w in mtp_tensors(cfg, seed).items():
        base = name[: -len(".weight")]
        if quantized and ".experts." in name and ".shared_experts." not in name:
            q, sc = quantize_mxfp4(w)
            out[name], out[base + ".scale"] = torch.from_numpy(q), torch.from_numpy(sc.view(np.uint8)).view(
                torch.float8_e8m0fnu)
        elif quantized and w.ndim == 2 and name.endswith(".weight") and ".gate." not in name:
            q, sc = quantize_fp8_blocks(w, 128, ue8m0=True)
            out[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            out[base + ".scale"] = torch.from_numpy(sc.view(np.uint8)).view(torch.float8_e8m0fnu)
        else:
            out[name] = torch.from_numpy(w)
    save_file(out, str(dst / "model.safetensors"))
    return dst


# ---- the formula in numpy (float64) -------------------------------------------------------------------------
def _rms(x: np.ndarray, eps: float, w: np.ndarray | None = None) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class NumpyMtp:
    """MTPBlock.forward over positions 0..T-1 of one sequence; ``w`` maps names without the ``mtp.0.`` prefix."""

    def __init__(self, w: dict[str, np.ndarray], cfg: dict, embed: np.ndarray, head: np.ndarray) -> None:
        self.w = {k: np.asarray(v, np.float64) for k, v in w.items()}
        self.c, self.embed, self.head = cfg, np.asarray(embed, np.float64), np.asarray(head, np.float64)
        self.eps = cfg["rms_norm_eps"]

    def _hc_split(self, x: np.ndarray, which: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """hc_pre (DeepSeek's hc_split_sinkhorn): x [T, N, D] → (collapsed [T, D], post [T, N], comb [T, N, N])."""
        n, eps = self.c["hc_mult"], self.c["hc_eps"]
        fn, base, scale = (self.w[f"hc_{which}_{k}"] for k in ("fn", "base", "scale"))
        flat = x.reshape(x.shape[0], -1)
        mixes = (flat @ fn.T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + self.eps)
        pre = _sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
        post = 2.0 * _sigmoid(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = mixes[:, 2 * n:].reshape(-1, n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = np.exp(comb - comb.max(-1, keepdims=True))
        comb = comb / comb.sum(-1, keepdims=True) + eps
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
        for _ in range(self.c["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + eps)
            comb = comb / (comb.sum(-2, keepdims=True) + eps)
        return np.einsum("tn,tnd->td", pre, x), post, comb

    @staticmethod
    def _hc_post(y: np.ndarray, x: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
        """y [T, D], residual streams x [T, N, D]: post ⊗ y + Σ_m comb[m, n] x[m]."""
        return post[..., None] * y[:, None, :] + np.einsum("tmn,tmd->tnd", comb, x)

    def _rope(self, x: np.ndarray, pos: np.ndarray, inverse: bool = False) -> np.ndarray:
        """Interleaved rotary embedding on the last rope_dim channels (default rope, the main theta)."""
        c = self.c
        hd = c["head_dim"]
        rd = int(hd * c["partial_rotary_factor"])
        theta = (c.get("rope_parameters") or {}).get("main", {}).get("rope_theta", c.get("rope_theta", 10000.0))
        inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
        ang = pos[:, None] * inv[None, :]  # [T, rd/2]
        cos, sin = np.cos(ang), np.sin(ang) * (-1 if inverse else 1)
        while cos.ndim < x.ndim:
            cos, sin = cos[:, None], sin[:, None]
        r = x[..., hd - rd:].reshape(*x.shape[:-1], rd // 2, 2)
        a, b = r[..., 0], r[..., 1]
        out = np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(*x.shape[:-1], rd)
        return np.concatenate([x[..., :hd - rd], out], -1)

    def _attention(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Sliding-window MQA with sinks (K = V, rope undone on the output), grouped low-rank output."""
        c, w = self.c, self.w
        h, hd, win, g = c["num_attention_heads"], c["head_dim"], c["sliding_window"], c["o_groups"]
        t = x.shape[0]
        qr = _rms(x @ w["attn.wq_a.weight"].T, self.eps, w["attn.q_norm.weight"])
        qh = _rms((qr @ w["attn.wq_b.weight"].T).reshape(t, h, hd), self.eps)
        qh = self._rope(qh, pos)
        kv = self._rope(_rms(x @ w["attn.wkv.weight"].T, self.eps, w["attn.kv_norm.weight"]), pos)  # [T, hd]
        s = np.einsum("thd,sd->hts", qh, kv) * hd ** -0.5
        qp, kp = pos[:, None], pos[None, :]
        allowed = (kp <= qp) & (qp - kp < win)
        s = np.where(allowed[None], s, -np.inf)
        sink = w["attn.attn_sink"][:, None, None]
        mx = np.maximum(s.max(-1, keepdims=True), sink)
        e = np.exp(s - mx)
        p = e / (e.sum(-1, keepdims=True) + np.exp(sink - mx))
        o = self._rope(np.einsum("hts,sd->thd", p, kv), pos, inverse=True).reshape(t, g, -1)
        wa = w["attn.wo_a.weight"].reshape(g, c["o_lora_rank"], -1)
        return np.einsum("tgk,grk->tgr", o, wa).reshape(t, -1) @ w["attn.wo_b.weight"].T

    def _moe(self, x: np.ndarray) -> np.ndarray:
        """Top-k routed experts (score function, correction bias picks, weights renormalised × scale) + shared."""
        c, w = self.c, self.w
        lim, k = c["swiglu_limit"], c["num_experts_per_tok"]

        def mlp(v: np.ndarray, g1: np.ndarray, g3: np.ndarray, g2: np.ndarray) -> np.ndarray:
            gate, up = np.minimum(v @ g1.T, lim), np.clip(v @ g3.T, -lim, lim)
            return (gate * _sigmoid(gate) * up) @ g2.T

        logits = x @ w["ffn.gate.weight"].T
        f = c["scoring_func"]
        scores = np.sqrt(np.log1p(np.exp(logits))) if f == "sqrtsoftplus" else (
            _sigmoid(logits) if f == "sigmoid" else np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))
        out = mlp(x, *(w[f"ffn.shared_experts.{j}.weight"] for j in ("w1", "w3", "w2")))
        for r in range(x.shape[0]):
            top = np.argsort(-(scores[r] + w["ffn.gate.bias"]), kind="stable")[:k]
            wt = scores[r, top] / scores[r, top].sum() * c["routed_scaling_factor"]
            for e, a in zip(top, wt, strict=True):
                out[r] += a * mlp(x[r], *(w[f"ffn.experts.{e}.{j}.weight"] for j in ("w1", "w3", "w2")))
        return out

    def forward(self, next_ids: np.ndarray, hidden: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """next_ids [T] (t[p+1]), hidden [T, N, D] (h_p), pos [T] → (logits [T, V], the block's streams [T, N, D]).
        All T positions attend within this call (the whole sequence so far, positions in order)."""
        w, eps = self.w, self.eps
        e = _rms(self.embed[next_ids], eps, w["enorm.weight"])
        x = (e @ w["e_proj.weight"].T)[:, None, :] + _rms(np.asarray(hidden, np.float64), eps, w["hnorm.weight"]) @ w["h_proj.weight"].T
        col, post, comb = self._hc_split(x, "attn")
        x = self._hc_post(self._attention(_rms(col, eps, w["attn_norm.weight"]), pos), x, post, comb)
        col, post, comb = self._hc_split(x, "ffn")
        x = self._hc_post(self._moe(_rms(col, eps, w["ffn_norm.weight"])), x, post, comb)
        flat = x.reshape(x.shape[0], -1)
        mixes = (flat @ w["hc_head_fn"].T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + eps)
        pre = _sigmoid(mixes * w["hc_head_scale"][0] + w["hc_head_base"]) + self.c["hc_eps"]
        y = _rms(np.einsum("tn,tnd->td", pre, x), eps, w["norm.weight"])
        return y @ self.head.T, x

    def drafts(self, tokens: list[int], hidden: np.ndarray, k: int) -> list[int]:
        """Greedy k drafts after ``tokens`` (t_0..t_n) from the main streams h_0..h_{n-1}: the first from position
        n-1, each next one feeding the block's own output streams back as the hidden state (vLLM's recursion)."""
        n = len(tokens) - 1
        ids, hid, pos = list(tokens[1:]), list(hidden[:n]), list(range(n))
        out = []
        for _ in range(k):
            logits, streams = self.forward(np.array(ids), np.stack(hid), np.array(pos, np.float64))
            out.append(int(np.argmax(logits[-1])))
            ids.append(out[-1])
            hid.append(streams[-1])
            pos.append(pos[-1] + 1)
        return out
