"""DeepSeek-V4 attention for one layer: sliding window + (CSA | HCA) compressed entries, with decode state.

Math follows transformers' ``DeepseekV4Attention`` / ``DeepseekV4{CSA,HCA}Compressor`` /
``DeepseekV4Indexer``. The state layout (see ``state.py``) lets one graph serve prefill and decode:
the graph reads the old state and writes the whole new one (update mode "replace").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto

from lineside.build.models.deepseek_v4.config import CSA, SLIDING, V4Config
from lineside.build.models.deepseek_v4.ops import NEG, Ops
from lineside.build.models.deepseek_v4.state import n_entries


@dataclass
class StepCtx:
    """Per-step tensors shared by all layers."""

    past: str  # int64 [B]
    pos: str  # int64 [B, S] absolute positions of the new tokens
    seq: str  # int64 scalar S
    total: str  # int64 [B] past + S
    rope: dict[str, tuple[str, str]]  # "main"/"compress" → cos, sin [B, S, rd/2]
    rope_inv: dict[str, tuple[str, float]]  # label → (inv_freq const, attention factor)


def rope_tables(o: Ops, pos_f: str, inv: str, factor: float) -> tuple[str, str]:
    """cos/sin [..., rd/2] for float positions (the angle in float32, as transformers does)."""
    freqs = o.mul(o.unsqueeze(pos_f, [-1]), inv)
    cos, sin = o.op("Cos", freqs), o.op("Sin", freqs)
    if factor != 1.0:
        cos, sin = o.mul(cos, o.f32(factor)), o.mul(sin, o.f32(factor))
    return cos, sin


class CompressorEmitter:
    """One compressor (the attention's or the indexer's): raw-token buffer → new compressed entries."""

    def __init__(self, o: Ops, ctx: StepCtx, m: int, dim: int, overlap: bool, rope_dim: int, eps: float) -> None:
        self.o, self.ctx, self.m, self.dim, self.overlap = o, ctx, m, dim, overlap
        self.rope_dim, self.eps = rope_dim, eps
        self.buf = 2 * m if overlap else m  # raw tokens kept: enough for the previous + current window

    def emit(self, x: str, name: str, w: dict[str, np.ndarray], raw_kv: str, raw_gate: str,
             entries: str) -> tuple[str, str, str]:
        """Returns (new raw_kv, new raw_gate, new entries); all fixed-shape."""
        o, m, L, d = self.o, self.m, self.buf, self.dim
        kv = o.linear(x, f"{name}.kv_proj", w["kv_proj"])
        gate = o.linear(x, f"{name}.gate_proj", w["gate_proj"])
        cat_kv, cat_gate = o.concat([raw_kv, kv], 1), o.concat([raw_gate, gate], 1)  # [B, L+S, C]
        new_kv, new_gate = o.slice(cat_kv, -L, 2**62, 1), o.slice(cat_gate, -L, 2**62, 1)
        # Candidate windows: every window a new token falls into, past//m … (past+S-1)//m, so
        # K = (past mod m + S - 1)//m + 1 (the widest row's). Not the bound ceil((S-1)/m) + 1: that can name a window
        # past the last slot when m does not divide max_seq or exceeds it (GatherND/ScatterND out of range).
        w0 = o.div(self.ctx.past, o.i64(m))  # [B]
        if m > 1:
            rem = o.cast(o.sub(self.ctx.past, o.mul(w0, o.i64(m))), TensorProto.FLOAT)  # float: TRT 10.3 reduces
            rem = o.cast(o.reduce("ReduceMax", rem, 0, keep=False), TensorProto.INT64)
            k = o.add(o.div(o.add(rem, o.sub(self.ctx.seq, o.i64(1))), o.i64(m)), o.i64(1))
        else:
            k = self.ctx.seq
        ks = o.op("Range", o.i64(0), k, o.i64(1))  # [K]
        win = o.add(o.unsqueeze(w0, [1]), o.unsqueeze(ks, [0]))  # [B, K]
        complete = o.op("LessOrEqual", o.mul(o.add(win, o.i64(1)), o.i64(m)), o.unsqueeze(self.ctx.total, [1]))
        # Source positions of each window's slots: [prev window (overlap only)] + current window.
        offs = np.arange(-m if self.overlap else 0, m, dtype=np.int64)
        p = o.add(o.unsqueeze(o.mul(win, o.i64(m)), [2]), o.i64(offs))  # [B, K, M]
        valid = o.and_(o.op("GreaterOrEqual", p, o.i64(0)),
                       o.op("Less", p, o.unsqueeze(o.unsqueeze(self.ctx.total, [1]), [2])))
        base = o.sub(o.i64(L), o.unsqueeze(self.ctx.past, [1]))  # cat index = p - past + L
        j = o.add(p, o.unsqueeze(base, [2]))
        n_cat = o.add(self.ctx.seq, o.i64(L))
        j = o.op("Max", o.op("Min", j, o.sub(n_cat, o.i64(1))), o.i64(0))  # TRT 10.3: no INT64 Clip
        bidx = o.op("Range", o.i64(0), o.dim(self.ctx.past, 0), o.i64(1))
        flat_j = o.add(j, o.unsqueeze(o.mul(bidx, n_cat), [1, 2]))  # [B, K, M]
        c = 2 * d if self.overlap else d
        kv_w = o.gather(o.reshape(cat_kv, [-1, c]), flat_j, 0)  # [B, K, M, C]
        g_w = o.gather(o.reshape(cat_gate, [-1, c]), flat_j, 0)
        ape = w["position_bias"]
        g_w = o.add(g_w, o.w(f"{name}.position_bias", np.concatenate([ape, ape]) if self.overlap else ape))
        if self.overlap:  # previous window contributes its first half (Ca), the current one its second (Cb)
            kv_w = o.concat([o.slice(o.slice(kv_w, 0, m, 2), 0, d, 3), o.slice(o.slice(kv_w, m, 2 * m, 2), d, 2 * d, 3)], 2)
            g_w = o.concat([o.slice(o.slice(g_w, 0, m, 2), 0, d, 3), o.slice(o.slice(g_w, m, 2 * m, 2), d, 2 * d, 3)], 2)
        g_w = o.where(o.unsqueeze(valid, [3]), g_w, o.f32(NEG))
        prob = o.op("Softmax", g_w, axis=2)
        pooled = o.reduce("ReduceSum", o.mul(kv_w, prob), 2, keep=False)  # [B, K, d]
        pooled = o.rmsnorm(pooled, w["kv_norm"], self.eps, f"{name}.kv_norm")
        inv, factor = self.ctx.rope_inv["compress"]
        cos, sin = rope_tables(o, o.cast(o.mul(win, o.i64(m)), TensorProto.FLOAT), inv, factor)
        pooled = o.rope(pooled, cos, sin, self.rope_dim, d)
        # Write complete windows at their index; others keep the old entry.
        idx = o.concat([o.unsqueeze(o.op("Expand", o.unsqueeze(bidx, [1]), o.op("Shape", win)), [2]),
                        o.unsqueeze(win, [2])], 2)  # [B, K, 2]
        old = o.op("GatherND", entries, idx)
        upd = o.where(o.unsqueeze(complete, [2]), pooled, old)
        return new_kv, new_gate, o.op("ScatterND", entries, idx, upd)


class AttentionEmitter:
    """Emits one layer's attention; ``state`` maps state keys to (input name, output name)."""

    def __init__(self, o: Ops, cfg: V4Config, ctx: StepCtx, max_seq: int) -> None:
        self.o, self.cfg, self.ctx, self.max_seq = o, cfg, ctx, max_seq

    def _compressor(self, m: int, dim: int, overlap: bool) -> CompressorEmitter:
        return CompressorEmitter(self.o, self.ctx, m, dim, overlap, self.cfg.rope_dim, self.cfg.rms_norm_eps)

    def emit(self, layer: int, x: str, w: dict[str, Any], state: dict[str, tuple[str, str]]) -> tuple[str, dict[str, str]]:
        """Returns (attention output [B, S, hidden], {state key: new value})."""
        o, c, ctx = self.o, self.cfg, self.ctx
        ltype = c.layer_types[layer]
        label = "main" if ltype == SLIDING else "compress"
        cos, sin = ctx.rope[label]
        cos4, sin4 = o.unsqueeze(cos, [2]), o.unsqueeze(sin, [2])
        pre = f"layers.{layer}.attn"
        h, d, rd = c.num_heads, c.head_dim, c.rope_dim
        q_res = o.rmsnorm(o.linear(x, f"{pre}.q_a_proj", w["q_a_proj"]), w["q_a_norm"], c.rms_norm_eps, f"{pre}.q_a_norm")
        q = o.reshape(o.linear(q_res, f"{pre}.q_b_proj", w["q_b_proj"]), [0, 0, h, d])
        q = o.rope(o.rmsnorm(q, None, c.rms_norm_eps, ""), cos4, sin4, rd, d)
        q = o.transpose(q, [0, 2, 1, 3])  # [B, H, S, D]
        kv = o.rmsnorm(o.linear(x, f"{pre}.kv_proj", w["kv_proj"]), w["kv_norm"], c.rms_norm_eps, f"{pre}.kv_norm")
        kv = o.rope(kv, cos, sin, rd, d)  # [B, S, D]
        new: dict[str, str] = {}
        win_len = c.sliding_window
        keys = o.concat([state["window"][0], kv], 1)  # [B, W+S, D]
        new["window"] = o.slice(keys, -win_len, 2**62, 1)
        qpos = o.unsqueeze(ctx.pos, [2])  # [B, S, 1]
        kidx = o.op("Range", o.i64(0), o.add(ctx.seq, o.i64(win_len)), o.i64(1))
        kpos = o.unsqueeze(o.add(o.unsqueeze(o.sub(ctx.past, o.i64(win_len)), [1]), o.unsqueeze(kidx, [0])), [1])
        mask = o.and_(o.and_(o.op("GreaterOrEqual", kpos, o.i64(0)), o.op("LessOrEqual", kpos, qpos)),
                      o.op("Less", o.sub(qpos, kpos), o.i64(win_len)))  # [B, S, W+S]
        if ltype != SLIDING:
            m = c.compress_rates[ltype]
            comp = self._compressor(m, d, ltype == CSA)
            kv_s, g_s, e_s = comp.emit(x, f"{pre}.compressor", w["compressor"], state["comp_kv"][0],
                                       state["comp_gate"][0], state["comp"][0])
            new.update(comp_kv=kv_s, comp_gate=g_s, comp=e_s)
            n_idx = o.i64(np.arange(n_entries(self.max_seq, m), dtype=np.int64))
            visible = o.op("Less", n_idx, o.unsqueeze(o.div(o.add(ctx.pos, o.i64(1)), o.i64(m)), [2]))  # [B, S, Nc]
            if ltype == CSA:
                visible = o.and_(visible, self._indexer(layer, x, q_res, w["indexer"], state, new, visible, m))
            keys = o.concat([keys, e_s], 1)
            mask = o.concat([mask, visible], 2)
        scores = o.mul(o.matmul(q, o.unsqueeze(o.transpose(keys, [0, 2, 1]), [1])), o.f32(d ** -0.5))
        scores = o.where(o.unsqueeze(mask, [1]), scores, o.f32(NEG))  # [B, H, S, T]
        sink = o.w(f"{pre}.sinks", np.asarray(w["sinks"], np.float32).reshape(1, h, 1, 1))
        mx = o.op("Max", o.reduce("ReduceMax", scores, -1), sink)
        e = o.op("Exp", o.sub(scores, mx))
        den = o.add(o.reduce("ReduceSum", e, -1), o.op("Exp", o.sub(sink, mx)))
        out = o.matmul(o.div(e, den), o.unsqueeze(keys, [1]))  # [B, H, S, D]
        out = o.transpose(out, [0, 2, 1, 3])
        out = o.rope(out, cos4, o.op("Neg", sin4), rd, d)  # undo the rope V picked up (K = V)
        g = c.o_groups
        grouped = o.reshape(out, [0, 0, g, h * d // g])
        wa = np.asarray(w["o_a_proj"], np.float32).reshape(g, c.o_lora_rank, h * d // g)
        parts = [o.linear(o.pick(grouped, i, 2), f"{pre}.o_a_proj.{i}", wa[i]) for i in range(g)]
        return o.linear(o.concat(parts, -1), f"{pre}.o_b_proj", w["o_b_proj"]), new

    def _indexer(self, layer: int, x: str, q_res: str, w: dict[str, Any], state: dict[str, tuple[str, str]],
                 new: dict[str, str], visible: str, m: int) -> str:
        """Lightning indexer: bool [B, S, Nc], True for the top-k entries each query keeps."""
        o, c, ctx = self.o, self.cfg, self.ctx
        pre = f"layers.{layer}.attn.indexer"
        di, hi = c.index_head_dim, c.index_n_heads
        comp = self._compressor(m, di, True)
        kv_s, g_s, keys = comp.emit(x, f"{pre}.compressor", w, state["idx_kv"][0], state["idx_gate"][0],
                                    state["idx_keys"][0])
        new.update(idx_kv=kv_s, idx_gate=g_s, idx_keys=keys)
        cos, sin = ctx.rope["compress"]
        q = o.reshape(o.linear(q_res, f"{pre}.q_b_proj", w["q_b_proj"]), [0, 0, hi, di])
        q = o.rope(q, o.unsqueeze(cos, [2]), o.unsqueeze(sin, [2]), c.rope_dim, di)  # [B, S, Hi, Di]
        s = o.matmul(o.reshape(q, [0, -1, di]), o.transpose(keys, [0, 2, 1]))  # [B, S*Hi, Nc]
        s = o.mul(o.op("Relu", o.reshape(s, o.concat([o.slice(o.op("Shape", q), 0, 3, 0), o.i64([-1])], 0))),
                  o.f32(di ** -0.5))  # [B, S, Hi, Nc]
        wts = o.mul(o.linear(x, f"{pre}.weights_proj", w["weights_proj"], quantize=False), o.f32(hi ** -0.5))
        score = o.reduce("ReduceSum", o.mul(s, o.unsqueeze(wts, [3])), 2, keep=False)  # [B, S, Nc]
        score = o.where(visible, score, o.f32(NEG))
        n_c = n_entries(self.max_seq, m)
        k = min(c.index_topk, n_c)
        _, top = o.gb.op("TopK", [score, o.i64([k])], n_out=2, axis=-1, largest=1, sorted=1)
        ones = o.op("Expand", o.f32(1.0), o.op("Shape", top))
        zeros = o.op("Expand", o.f32(0.0), o.op("Shape", score))
        picked = o.op("ScatterElements", zeros, top, ones, axis=-1)
        return o.op("Greater", picked, o.f32(0.5))


