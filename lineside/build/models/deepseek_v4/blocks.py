"""mHC hyper-connections and the MoE block (hash / top-k routed experts + shared expert).

MoE strategy per flavor: ``cpu`` runs each expert inside an ``If`` taken only when some token picked
it, and there gathers that expert's tokens (NonZero → Gather → expert MLP → ScatterND add), so the
work per token grows with the selected experts (an idle expert costs two tiny nodes); ``trt`` runs every expert
densely on all tokens and masks by the combine weight (no data-dependent shapes, so the decode step
stays CUDA-graph capturable), so its cost grows with the number of experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from lineside.build.models.deepseek_v4.config import V4Config
from lineside.build.models.deepseek_v4.ops import Ops


class HyperConnection:
    """transformers' DeepseekV4HyperConnection: streams [B, S, N, D] → (post, comb, collapsed)."""

    def __init__(self, o: Ops, cfg: V4Config) -> None:
        self.o, self.cfg = o, cfg

    def _normed_mix(self, x: str, fn: np.ndarray, name: str) -> str:
        o, c = self.o, self.cfg
        flat = o.reshape(x, [0, 0, c.hc_mult * c.hidden_size])
        return o.matmul(o.rmsnorm(flat, None, c.rms_norm_eps, ""), o.w(name, np.asarray(fn, np.float32).T))

    def pre(self, x: str, w: dict[str, np.ndarray], name: str) -> tuple[str, str, str]:
        o, c = self.o, self.cfg
        n = c.hc_mult
        mix = self._normed_mix(x, w["fn"], f"{name}.fn")
        base, scale = np.asarray(w["base"], np.float32), np.asarray(w["scale"], np.float32)
        pre_w, post_w, comb_w = o.slice(mix, 0, n, -1), o.slice(mix, n, 2 * n, -1), o.slice(mix, 2 * n, n * (n + 2), -1)
        pre = o.add(o.op("Sigmoid", o.add(o.mul(pre_w, o.f32(scale[0])), o.w(f"{name}.pre_b", base[:n]))), o.f32(c.hc_eps))
        post = o.mul(o.op("Sigmoid", o.add(o.mul(post_w, o.f32(scale[1])), o.w(f"{name}.post_b", base[n:2 * n]))),
                     o.f32(2.0))
        comb = o.add(o.mul(o.reshape(comb_w, [0, 0, n, n]), o.f32(scale[2])), o.w(f"{name}.comb_b", base[2 * n:].reshape(n, n)))
        comb = o.add(o.op("Softmax", comb, axis=-1), o.f32(c.hc_eps))
        eps = o.f32(c.hc_eps)
        comb = o.div(comb, o.add(o.reduce("ReduceSum", comb, -2), eps))
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = o.div(comb, o.add(o.reduce("ReduceSum", comb, -1), eps))
            comb = o.div(comb, o.add(o.reduce("ReduceSum", comb, -2), eps))
        collapsed = o.reduce("ReduceSum", o.mul(o.unsqueeze(pre, [-1]), x), 2, keep=False)
        return post, comb, collapsed

    def post(self, x: str, out: str, post: str, comb: str) -> str:
        """post ⊗ block output + combᵀ @ streams."""
        o = self.o
        return o.add(o.mul(o.unsqueeze(post, [-1]), o.unsqueeze(out, [2])), o.matmul(o.transpose(comb, [0, 1, 3, 2]), x))

    def head(self, x: str, w: dict[str, np.ndarray], name: str = "hc_head") -> str:
        """DeepseekV4HyperHead: final collapse of the streams (the MTP block has its own, named apart)."""
        o, c = self.o, self.cfg
        mix = self._normed_mix(x, w["hc_fn"], f"{name}.fn")
        scale = float(np.asarray(w["hc_scale"], np.float32).reshape(-1)[0])
        pre = o.add(o.op("Sigmoid", o.add(o.mul(mix, o.f32(scale)), o.w(f"{name}.base", w["hc_base"]))), o.f32(c.hc_eps))
        return o.reduce("ReduceSum", o.mul(o.unsqueeze(pre, [-1]), x), 2, keep=False)


class MoE:
    """DeepseekV4SparseMoeBlock on flattened tokens [N, D]."""

    def __init__(self, o: Ops, cfg: V4Config) -> None:
        self.o, self.cfg = o, cfg

    def mlp(self, x: str, name: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray, branch: bool = False) -> str:
        """Clamped SwiGLU (routed experts and the shared expert alike); ``branch``: inside an If (Ops.linear)."""
        o, lim = self.o, self.cfg.swiglu_limit
        g = o.clip(o.linear(x, f"{name}.gate", gate, branch=branch), None, lim)
        u = o.clip(o.linear(x, f"{name}.up", up, branch=branch), -lim, lim)
        return o.linear(o.mul(o.silu(g), u), f"{name}.down", down, branch=branch)

    def _scores(self, logits: str) -> str:
        o, f = self.o, self.cfg.scoring_func
        if f == "sqrtsoftplus":
            return o.op("Sqrt", o.op("Softplus", logits))
        if f == "softmax":
            return o.op("Softmax", logits, axis=-1)
        return o.op("Sigmoid", logits)

    def emit(self, x: str, layer: int, w: dict[str, Any], ids: str,
             expert: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]]) -> str:
        """x [B, S, D] → [B, S, D]; ``expert(e)`` yields (gate, up, down) float32 weights one at a time."""
        o, c = self.o, self.cfg
        pre = f"layers.{layer}.ffn"
        n_exp, k = c.n_routed_experts, c.num_experts_per_tok
        flat = o.reshape(x, [-1, c.hidden_size])
        scores = self._scores(o.linear(flat, f"{pre}.gate", w["gate"], quantize=False))  # [N, E]
        if c.mlp_layer_types[layer] == "hash_moe":
            table = np.asarray(w["tid2eid"], np.int64)
            idx = o.gather(o.gb.const(table, np.int64) if table.size <= 256 else o.gb.weight(f"{pre}.tid2eid", table),
                           o.reshape(ids, [-1]), 0)  # [N, k]
        else:
            biased = o.add(scores, o.w(f"{pre}.gate.bias", w["bias"]))
            _, idx = o.gb.op("TopK", [biased, o.i64([k])], n_out=2, axis=-1, largest=1, sorted=1)
        wts = o.op("GatherElements", scores, idx, axis=-1)
        wts = o.div(wts, o.add(o.reduce("ReduceSum", wts, -1), o.f32(1e-20)))
        wts = o.mul(wts, o.f32(c.routed_scaling_factor))
        onehot = o.cast(o.op("Equal", o.unsqueeze(idx, [-1]), o.i64(np.arange(n_exp))), 1)  # [N, k, E]
        combine = o.reduce("ReduceSum", o.mul(onehot, o.unsqueeze(wts, [-1])), 1, keep=False)  # [N, E]
        hit = o.reduce("ReduceSum", onehot, 1, keep=False)
        out = self.mlp(flat, f"{pre}.shared", w["shared_gate"], w["shared_up"], w["shared_down"])
        if o.flavor == "cpu":
            routed = o.op("Greater", o.transpose(hit, [1, 0]), o.f32(0.0))  # [E, N]
            used = o.op("Greater", o.reduce("ReduceSum", hit, 0, keep=False), o.f32(0.0))  # [E]
        for e in range(n_exp):
            g, u, d = expert(e)
            name = f"{pre}.experts.{e}"
            if o.flavor == "cpu":
                out = self._routed_cpu(flat, out, name, (g, u, d), o.pick(routed, e, 0), o.pick(combine, e, 1),
                                       o.pick(used, e, 0))
            else:
                out = o.add(out, o.mul(self.mlp(flat, name, g, u, d), o.unsqueeze(o.pick(combine, e, 1), [1])))
        return o.reshape(out, o.op("Shape", x))

    def _routed_cpu(self, flat: str, acc: str, name: str, w: tuple[np.ndarray, np.ndarray, np.ndarray],
                    routed: str, cw: str, used: str) -> str:
        """acc + expert(routed tokens) · weight, inside an If so an unselected expert costs two nodes."""
        o, gb = self.o, self.o.gb
        outer = gb.nodes
        gb.nodes = []
        try:
            rows = o.reshape(o.op("NonZero", routed), [-1])
            y = self.mlp(o.gather(flat, rows, 0), name, *w, branch=True)
            y = o.mul(y, o.unsqueeze(o.gather(cw, rows, 0), [1]))
            then_out = gb.op("ScatterND", [acc, o.unsqueeze(rows, [1]), y], reduction="add")
            then_nodes = gb.nodes
        finally:
            gb.nodes = outer
        else_node = helper.make_node("Identity", [acc], [f"{name}/skip_out"], name=f"{name}/skip")
        branch = [helper.make_tensor_value_info(then_out, TensorProto.FLOAT, None)]
        then_g = helper.make_graph(then_nodes, f"{name}/run", [], branch)
        else_g = helper.make_graph([else_node], f"{name}/skip",
                                   [], [helper.make_tensor_value_info(f"{name}/skip_out", TensorProto.FLOAT, None)])
        return gb.op("If", [used], name=f"{name}/if", then_branch=then_g, else_branch=else_g)
