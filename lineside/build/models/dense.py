"""Dense decoder graphs (Llama, Qwen2 — the DeepSeek-R1-Distill family) for both flavors.

``cpu``: com.microsoft GroupQueryAttention with the KV cache updated in place (past and present
share one ``[batch, kv_heads, max_seq, head_dim]`` buffer), SkipSimplifiedLayerNormalization.
``trt``: standard ops only; the cache comes in as ``[batch, kv_heads, past_seq, head_dim]`` with an
attention mask and only the new K/V go out (the runtime writes them into its arena).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import TensorProto

from lineside.build.checkpoint import CheckpointReader
from lineside.build.graph.builder import MS_DOMAIN, GraphBuilder
from lineside.build.graph.draft import LayerMark, write_draft_graph
from lineside.build.graph.lora import SiteTensors
from lineside.build.models.family import ModelFamily, WeightGetter, WeightSource
from lineside.build.models.rope import rope_cache
from lineside.build.quant.spec import QuantSpec
from lineside.build.tensors import GGMLBlocks
from lineside.bundle import DRAFT_GRAPHS, FlavorEntry
from lineside.config import ModelConfig
from lineside.errors import CheckpointError, ConfigError
from lineside.graph_io import StateTensor, StateUpdate
from lineside.lora import SITES, LoraTarget, lora_sites

if TYPE_CHECKING:  # quant/smooth.py runs the float forward through quant/calibrate.py, which reads this module
    from lineside.build.quant.smooth import InputStats

F32 = TensorProto.FLOAT


def layer_tensor_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    names = {
        "ln1": p + "input_layernorm.weight",
        "ln2": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
    }
    if cfg.attention_bias:
        names.update(qb=p + "self_attn.q_proj.bias", kb=p + "self_attn.k_proj.bias", vb=p + "self_attn.v_proj.bias")
    if cfg.o_proj_bias:
        names["ob"] = p + "self_attn.o_proj.bias"
    if cfg.mlp_bias:
        names.update(gateb=p + "mlp.gate_proj.bias", upb=p + "mlp.up_proj.bias", downb=p + "mlp.down_proj.bias")
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for every tensor the graph reads (HF layout)."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    per = dict(ln1=(h,), ln2=(h,), q=(q, h), k=(kv, h), v=(kv, h), o=(h, q), gate=(inter, h), up=(inter, h),
               down=(h, inter), qb=(q,), kb=(kv,), vb=(kv,), ob=(h,), gateb=(inter,), upb=(inter,), downb=(h,))
    for i in range(cfg.num_layers):
        shapes.update({name: per[key] for key, name in layer_tensor_names(cfg, i).items()})
    return shapes


def check_config(cfg: ModelConfig, flavors: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, a config these graphs cannot compute exactly (one line each)."""
    from lineside.build.models.rope import check_scaling

    check_scaling(cfg.rope_scaling)
    rot = cfg.rotary_dim or cfg.head_dim
    if rot % 2 or rot > cfg.head_dim:
        raise ConfigError(f"config.json: rotary dimension {rot} must be even and at most head_dim {cfg.head_dim}")
    if "cpu" in flavors and (cfg.head_dim % 16 or rot % 16):
        raise ConfigError(f"head_dim {cfg.head_dim} (rotary {rot}) is not a multiple of 16, which onnxruntime's "
                          "GroupQueryAttention needs; build the trt flavor (--flavors trt) for this model")


# safetensors dtypes that are never weights (int8/uint8 are: FP8 companions and MXFP4 pairs).
_NOT_WEIGHTS = ("BOOL", "I16", "I32", "I64", "U16", "U32", "U64")


def check_shapes(cfg: ModelConfig, ckpt: CheckpointReader, where: str) -> None:
    """Every tensor has the shape config.json implies and a float dtype, so a bad checkpoint fails here
    (one line) and not in onnxruntime or, worse, not at all."""
    dtype = getattr(ckpt, "dtype", None)  # safetensors readers; GGUF types are checked by the reader
    # a GGUF has no config.json: its config is made from its metadata (vocabulary size, head counts, ...)
    src = "its GGUF metadata" if str(getattr(ckpt, "path", "")).lower().endswith(".gguf") else "its config.json"
    for name, want in expected_shapes(cfg).items():
        got = tuple(int(v) for v in ckpt.shape(name))
        if got != want:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(got)} but {src.removeprefix('its ')} "
                                  f"implies {list(want)}; the checkpoint and {src} disagree")
        if dtype is not None and (dtype(name) in _NOT_WEIGHTS or (dtype(name) in _CODES and not _scaled(ckpt, name))):
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {dtype(name)}, which is not a weight type "
                                  "(expected F32/F16/BF16 or block-scaled FP8); re-export the checkpoint")


# int8 / uint8 tensors are weights only beside their scale (scaled INT8, MXFP4 pairs); alone they are codes
_CODES = ("I8", "U8")
_SCALES = (".weight_scale", ".weight_scale_inv", ".scale")


def _scaled(ckpt: CheckpointReader, name: str) -> bool:
    prefix = name.removesuffix(".weight")
    return name.endswith(".weight") and any(ckpt.has(prefix + s) for s in _SCALES)


# quantization_config methods whose weights the reader dequantizes (a `.weight` with its scale); (method, format),
# the format being compressed-tensors' ``format`` (ModelOpt's ``quant_algo``: its FP8 ones, checked apart)
_READABLE_QUANT = {("fp8", None), ("fbgemm_fp8", None), ("modelopt", None), ("compressed-tensors", "float-quantized"),
                   ("compressed-tensors", "int-quantized"), ("compressed-tensors", "naive-quantized")}


def _prequantized(hf_config: dict[str, Any]) -> str | None:
    """config.json's quantization method when the reader cannot read its weights ("gptq", "compressed-tensors
    pack-quantized", "modelopt NVFP4", ...); None without a quantization_config or for a format it reads (FP8, scaled
    INT8)."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    fmt = {"compressed-tensors": qc.get("format"), "modelopt": qc.get("quant_algo")}.get(method)
    fmt = fmt if isinstance(fmt, str) else None
    if (method, fmt) in _READABLE_QUANT or (method == "modelopt" and fmt.upper().startswith("FP8")):
        return None  # ModelOpt FP8 (per tensor, FP8_PB_WO per block); its NVFP4 / INT4 AWQ weights are packed
    return " ".join(str(v) for v in (method, fmt) if isinstance(v, str)) or "quantization_config"


def required_tensors(cfg: ModelConfig) -> list[str]:
    """Every tensor the graph reads, so a missing one is reported by name before building."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        names.extend(layer_tensor_names(cfg, i).values())
    return names


class DenseEmitter:
    """Emits one dense decoder graph; ``weights`` maps HF names to arrays (or GGMLBlocks)."""

    def __init__(self, cfg: ModelConfig, get_weight: WeightGetter, spec: QuantSpec, flavor: str,
                 onnx_path: Path, max_seq_len: int, awq_scales: dict[str, np.ndarray] | None = None,
                 draft_layers: tuple[int, ...] = (), lora_targets: tuple[LoraTarget, ...] = (),
                 key_means: np.ndarray | None = None, lora_x_scales: dict[str, np.ndarray] | None = None,
                 prefill_stats: dict[tuple[int, str], InputStats] | None = None):
        from lineside.build.graph import prefill
        from lineside.build.graph.embedding import emit_embedding
        from lineside.build.graph.linear import emit_linear, emit_lm_head
        from lineside.build.quant.kv import FORMATS, KvDtype

        self.cfg, self.get, self.spec, self.flavor = cfg, get_weight, spec, flavor
        self.kv_fmt = FORMATS.get(KvDtype(spec.kv_dtype))  # the quantized cache's format; None for a float cache
        self.max_seq = max_seq_len
        self.awq = awq_scales or {}
        self.key_means = key_means if flavor == "trt" and spec.kv_dtype == "int4" else None
        self.gb = GraphBuilder(onnx_path, name=f"{cfg.architecture}-{flavor}")
        if prefill_stats is not None and flavor == "cpu" and spec.quantized:
            # every linear also recorded on int8, for the prompt's variant (graph/prefill.py), in the form its input on
            # calibration text favours (quant/smooth.py), looked up by the names the linears are emitted under
            prefill.enable(self.gb, {name: m for (i, group), m in prefill_stats.items()
                                     for name in linear_names(cfg, i, group)})
        self._emit_linear, self._emit_embedding, self._emit_lm_head = emit_linear, emit_embedding, emit_lm_head
        self.rot_dim = cfg.rotary_dim or cfg.head_dim
        # LoRA: the adapted matmuls by (layer, site), and where each reads x and writes y (graph/lora.py)
        self.lora_sites = {(s.layer, s.site): s for s in lora_sites(cfg, lora_targets)}
        self.lora_tensors: list[SiteTensors] = []
        # AWQ folded 1/s into what feeds these linears (norm gammas, up_proj's rows): the graph's x is x/s there
        self.lora_x_scales = lora_x_scales or {}
        check_config(cfg, (flavor,))
        bad = [n for n in draft_layers if not 1 <= n < cfg.num_layers]
        if bad:
            raise ConfigError(f"--draft-layers {bad[0]}: a draft needs 1 to {cfg.num_layers - 1} of the model's "
                                f"{cfg.num_layers} layers")
        self.draft_layers = tuple(sorted(set(draft_layers)))

    # ---- small pieces ----------------------------------------------------------------
    def linear(self, x: str, name: str, bias_name: str | None = None) -> str:
        w = self.get(name)
        bias = np.asarray(self.get(bias_name), dtype=np.float32) if bias_name else None
        return self._emit_linear(self.gb, x, name, w, self.spec, self.flavor, bias=bias,
                                 awq_scale=self.awq.get(name))

    def fused_linear(self, x: str, names: list[str], bias_names: list[str | None], fused: str) -> str:
        """Layers reading the same x (q/k/v, gate/up) as one matmul: fewer kernels per decode step."""
        from lineside.build.graph.table8 import concat_out_features

        weights = [self.get(n) for n in names]
        if len({w.ggml_type if isinstance(w, GGMLBlocks) else None for w in weights}) > 1:
            # GGUF blocks of different types (llama-quantize --tensor-type attn_v=q8_0), or beside a float weight:
            # one matrix would be float and quantized again, so each layer keeps its own grid and the outputs join.
            ys = [self._emit_linear(self.gb, x, n, w, self.spec, self.flavor,
                                    bias=np.asarray(self.get(b), dtype=np.float32) if b else None)
                  for n, w, b in zip(names, weights, bias_names, strict=True)]
            return self.gb.op("Concat", ys, axis=-1, name=f"{fused}/concat")
        w = concat_out_features(weights, fused)
        bias = None
        if any(bias_names):
            bias = np.concatenate([np.asarray(self.get(b), dtype=np.float32) if b else
                                   np.zeros(self.get(n).shape[0], np.float32) for n, b in zip(names, bias_names, strict=True)])
        return self._emit_linear(self.gb, x, fused, w, self.spec, self.flavor, bias=bias)

    def adapted(self, layer: int, site: str, x: str, y: str) -> str:
        """Note a matmul the LoRA graph adapts (its x and y); the base graph is unchanged."""
        if (layer, site) in self.lora_sites:
            first = layer_tensor_names(self.cfg, layer)[SITES[site][0].value]  # the site's linears share x
            self.lora_tensors.append(SiteTensors(self.lora_sites[(layer, site)], x, y, self.lora_x_scales.get(first)))
        return y

    def norm_weight(self, name: str) -> str:
        return self.gb.weight(name, np.asarray(self.get(name), dtype=np.float32))

    def rms_norm(self, x: str, w: str) -> str:
        """RMSNorm from standard ops (trt flavor; TensorRT fuses the pattern)."""
        g = self.gb
        sq = g.op("Mul", [x, x])
        ms = g.op("ReduceMean", [sq, g.const([-1])], keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const(self.cfg.rms_norm_eps, np.float32)])])])
        return g.op("Mul", [g.op("Mul", [x, inv]), w])

    def skip_norm(self, x: str, residual: str | None, w: str) -> tuple[str, str]:
        """(normed, new_residual) where new_residual = x + residual."""
        g = self.gb
        if self.flavor == "cpu" and residual is not None:
            out, _, _, summed = g.op("SkipSimplifiedLayerNormalization", [x, residual, w], n_out=4,
                                     domain=MS_DOMAIN, epsilon=self.cfg.rms_norm_eps)
            return out, summed
        summed = x if residual is None else g.op("Add", [x, residual])
        return self.rms_norm(summed, w), summed

    # ---- graph -----------------------------------------------------------------------
    def emit(self, progress: Callable[[int], None] | None = None) -> FlavorEntry:
        cfg, g = self.cfg, self.gb
        ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
        g.input("logits_positions", TensorProto.INT64, ["batch", "n_logits"])
        if self.flavor == "cpu":
            g.input("seqlens_k", TensorProto.INT32, ["batch"])
            g.input("total_sequence_length", TensorProto.INT32, [])
        else:
            g.input("position_ids", TensorProto.INT64, ["batch", "seq"])
            g.input("attention_mask", TensorProto.INT64, ["batch", "total_seq"])
        cos, sin = rope_cache(self.rot_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                              self.max_seq)
        self.cos, self.sin = g.weight("rope_cos", cos), g.weight("rope_sin", sin)
        if self.flavor == "trt":
            self._trt_prelude()

        h = self._emit_embedding(g, ids, self.get("model.embed_tokens.weight"), self.spec, self.flavor)
        residual = None
        states: list[StateTensor] = []
        marks = []
        for i in range(cfg.num_layers):
            n = layer_tensor_names(cfg, i)
            x, residual = self.skip_norm(h, residual, self.norm_weight(n["ln1"]))
            attn = self.attention(i, x, n, states)
            x, residual = self.skip_norm(attn, residual, self.norm_weight(n["ln2"]))
            gate_up = self.adapted(i, "gate_up", x, self.fused_linear(
                x, [n["gate"], n["up"]], [n.get("gateb"), n.get("upb")], fused_name(i, "gate_up")))
            inter = cfg.intermediate_size
            gate, up = g.op("Split", [gate_up, g.const([inter, inter])], n_out=2, axis=-1)
            act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
            h = self.adapted(i, "down", act, self.linear(act, n["down"], n.get("downb")))
            marks.append(LayerMark(len(g.nodes), h, residual, len(states)))
            if progress:
                progress(1)
        # Only the requested positions go through the final norm and the LM head.
        tail_start = len(g.nodes)
        h = g.op("Add", [h, residual])
        h = self._gather_positions(h)
        x, _ = self.skip_norm(h, None, self.norm_weight("model.norm.weight"))
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        # The head stays at 8 bits in w4a16 builds (logits are the most sensitive output; see manifest).
        logits = self._emit_lm_head(g, x, self.get(head), self.spec, self.flavor, name=head,
                                    keep_8bit=getattr(self.spec, "lm_head_bits", 8) >= 8)
        g.op("Identity", [logits], outputs=["logits"])
        g.output("logits", F32, ["batch", "n_logits", cfg.vocab_size])
        g.save()
        drafts = {str(n): write_draft_graph(g, g.onnx_path.with_name(f"draft-{n}.onnx"), marks[n - 1], tail_start,
                                            states) for n in self.draft_layers}
        extra: dict[str, Any] = {DRAFT_GRAPHS: drafts} if drafts else {}
        if self.lora_sites:
            from lineside.build.graph.lora import write_lora_graph

            lora = write_lora_graph(g, self.lora_tensors, g.onnx_path.with_name(g.onnx_path.stem + ".lora.onnx"))
            extra["lora_graph"] = lora.name  # beside the base graph, reading its external data
        from lineside.build.graph import prefill
        from lineside.build.graph.prefill import PREFILL_FORMS, PREFILL_GRAPH, write_prefill_graph
        from lineside.build.quant.smooth import Int8Form

        variant = write_prefill_graph(g, g.onnx_path.with_name(g.onnx_path.stem + ".prefill.onnx"))
        if variant is not None:
            extra[PREFILL_GRAPH] = variant.name  # beside the base graph, its int8 weights in the same data file
            forms = prefill.forms(g)  # how many linears took each int8 form, and which kept their 4-bit node
            extra[PREFILL_FORMS] = {str(f): sum(v == f for v in forms.values()) for f in Int8Form}
            kept = sorted(n for n, f in forms.items() if f == Int8Form.KEEP_4BIT)
            if kept:
                extra[PREFILL_FORMS]["kept_4bit"] = kept
        return FlavorEntry(inputs=[v.name for v in g.inputs], state=states, activation_dtype="float32", extra=extra)

    def _gather_positions(self, h: str) -> str:
        g = self.gb
        idx = g.op("Unsqueeze", ["logits_positions", g.const([-1])])  # [B, K, 1]
        shape = g.op("Concat", [g.op("Shape", ["logits_positions"]), g.const([self.cfg.hidden_size])], axis=0)
        idx = g.op("Expand", [idx, shape])
        return g.op("GatherElements", [h, idx], axis=1)

    # ---- attention -------------------------------------------------------------------
    def attention(self, i: int, x: str, n: dict[str, str], states: list[StateTensor]) -> str:
        cfg, g = self.cfg, self.gb
        qkv = self.adapted(i, "qkv", x, self.fused_linear(x, [n["q"], n["k"], n["v"]],
                                                          [n.get("qb"), n.get("kb"), n.get("vb")],
                                                          fused_name(i, "qkv")))
        pk, pv, ok, ov = f"past_key.{i}", f"past_value.{i}", f"present_key.{i}", f"present_value.{i}"
        kvh, d = cfg.num_kv_heads, cfg.head_dim
        if self.flavor == "cpu":
            for name in (pk, pv):
                g.input(name, F32, ["batch", kvh, "max_seq", d])
            for name in (ok, ov):
                g.output(name, F32, ["batch", kvh, "max_seq", d])
            attrs: dict[str, Any] = dict(num_heads=cfg.num_heads, kv_num_heads=kvh, do_rotary=1,
                                         rotary_interleaved=0, scale=float(d) ** -0.5)
            if cfg.layer_window(i):
                attrs["local_window_size"] = int(cfg.layer_window(i))
            # Packed QKV: GroupQueryAttention splits it itself (key/value inputs left empty).
            out, _, _ = g.op("GroupQueryAttention",
                       [qkv, "", "", pk, pv, "seqlens_k", "total_sequence_length", self.cos, self.sin],
                       domain=MS_DOMAIN, outputs=[g.fresh("gqa_out"), ok, ov], **attrs)
            states += [StateTensor(pk, ok, ["batch", kvh, "max_seq", d], update=StateUpdate.INPLACE),
                       StateTensor(pv, ov, ["batch", kvh, "max_seq", d], update=StateUpdate.INPLACE)]
        else:
            out, layer_states = self._trt_layer(i, qkv)
            states += layer_states
        return self.adapted(i, "o", out, self.linear(out, n["o"], n.get("ob")))

    def _trt_layer(self, i: int, qkv: str) -> tuple[str, list[StateTensor]]:
        """trt-flavor attention of layer i: its output and its state tensors (values, then per-token scales)."""
        from lineside.build.graph.kv_cache import scale_name

        cfg, g = self.cfg, self.gb
        kvh, d = cfg.num_kv_heads, cfg.head_dim
        fmt = self.kv_fmt
        names = {"k": (f"past_key.{i}", f"present_key.{i}"), "v": (f"past_value.{i}", f"present_value.{i}")}
        shape: list[Any] = ["batch", kvh, "past_seq", d]
        out_shape: list[Any] = ["batch", kvh, "seq", d]
        states: list[StateTensor] = []
        if fmt is None:
            # KV cache in fp16 unless the build is the fp32 reference: half the bytes on the GPU.
            kv_t = F32 if self.spec.scheme == "fp32" else TensorProto.FLOAT16
            kv_name = "float32" if kv_t == F32 else "float16"
            for past, present in names.values():
                g.input(past, kv_t, shape)
                g.output(present, kv_t, out_shape)
                states.append(StateTensor(past, present, shape, dtype=kv_name, update=StateUpdate.APPEND))
            self.kv_io = {key: (past, present, None, None) for key, (past, present) in names.items()}
        else:
            q_t = TensorProto.UINT8  # int8: grid + 128; int4: two grid values + 8 per byte (graph/kv_cache.py)
            v_shape, v_out = shape[:3] + [fmt.stored_dim(d)], out_shape[:3] + [fmt.stored_dim(d)]
            s_shape, s_out = shape[:3] + [fmt.scale_state_dim(d)], out_shape[:3] + [fmt.scale_state_dim(d)]
            self.kv_io = {}
            for key, (past, present) in names.items():
                ps, os_ = scale_name(past), scale_name(present)
                g.input(past, q_t, v_shape)
                g.input(ps, TensorProto.FLOAT16, s_shape)
                g.output(present, q_t, v_out)
                g.output(os_, TensorProto.FLOAT16, s_out)
                states += [StateTensor(past, present, v_shape, dtype=fmt.element, update=StateUpdate.APPEND),
                           StateTensor(ps, os_, s_shape, dtype="float16", update=StateUpdate.APPEND)]
                self.kv_io[key] = (past, present, ps, os_)
            if fmt.sink:  # K's heads then V's, positions 0..sink-1 in fp16 (quant/kv.py SINK)
                past, present = f"past_sink.{i}", f"present_sink.{i}"
                sink_shape: list[Any] = ["batch", 2 * kvh, fmt.sink, d]
                g.input(past, TensorProto.FLOAT16, sink_shape)
                g.output(present, TensorProto.FLOAT16, sink_shape)
                states.append(StateTensor(past, present, sink_shape, dtype="float16", update=StateUpdate.PREFIX))
                self.kv_io["sink"] = (past, present, None, None)
        q, k, v = g.op("Split", [qkv, g.const([cfg.num_heads * d, kvh * d, kvh * d])], n_out=3, axis=-1)
        return self._trt_attention(q, k, v, self.allowed[cfg.layer_window(i)], layer=i), states

    def _kv_write(self, x: str, key: str) -> tuple[str, str]:
        """Float caches: store the new entries x [B, kvh, S, d]; returns (what attention reads for the new entries,
        for the past) — the stored values, so prefill and decode agree."""
        g = self.gb
        past, present, _, _ = self.kv_io[key]
        if self.spec.scheme == "fp32":
            g.op("Identity", [x], outputs=[present])
            return x, past
        g.op("Cast", [x], outputs=[present], to=TensorProto.FLOAT16)  # rounded once; attention reads it
        return g.op("Cast", [present], to=F32), g.op("Cast", [past], to=F32)

    def _kv_write_pair(self, kv: str) -> tuple[str, str, bool]:
        """Quantized caches: store the new K and V entries ``kv`` [B, 2·kvh, S, d] (K's heads, then V's) through one
        set of ops and read past and new back dequantized (graph/kv_cache.py); returns K, V, [B, kvh, T, d], and
        whether K is transposed, [B, kvh, d, T] (int8; int4's K is not: ``_kv_sink``)."""
        from lineside.build.graph.kv_cache import emit_kv_pair

        g, kvh, d = self.gb, self.cfg.num_kv_heads, self.cfg.head_dim
        fmt = self.kv_fmt
        assert fmt is not None
        (pk, ok, pks, oks), (pv, ov, pvs, ovs) = self.kv_io["k"], self.kv_io["v"]
        both = emit_kv_pair(g, kv, fmt, past=(pk, pv), past_scales=(pks, pvs), present=(ok, ov),
                            present_scales=(oks, ovs), heads=kvh, head_dim=d, sink=bool(fmt.sink))
        return (*self._kv_sink(kv, *both), False) if fmt.sink else (*both, True)

    def _kv_sink(self, kv: str, past: tuple[str, str], new: str) -> tuple[str, str]:
        """int4: new entries at positions < n also go to the fp16 sink state, and attention reads the n sink slots
        as keys of their own in front of the cache's entries, whose 4-bit copies at those positions the step's mask
        hides (``_trt_prelude``), so a step reads the same floats for them as every later step. ``kv``: the new
        entries [B, 2·kvh, S, d]; ``past``: K's and V's whole past dequantized, [B, kvh, P, d] each; ``new``: the new
        entries dequantized, [B, 2·kvh, S, d]; returns K and V, [B, kvh, n + P + S, d], the entries in the mask's
        order: no Slice of the past, no pick of the new entries by position. K is not transposed here: attention
        transposes it right before q·kᵀ's MatMul, which onnxruntime's CPU folds into it (FusedMatMul, transB), so
        no pass transposes K (nor its bytes, nor its scales)."""
        g = self.gb
        past_sink, present, _, _ = self.kv_io["sink"]
        written = g.op("MatMul", [self.sink_onehot, kv])  # [B, 2·kvh, n, d]: exact, one term per slot
        # chosen in float32, then rounded once: a float16 Where runs as float32 on onnxruntime's CPU, whose
        # cast clean-up would then let attention read the unrounded entry this step (prefill != decode)
        chosen = g.op("Where", [self.sink_written, written, g.op("Cast", [past_sink], to=F32)])
        g.op("Cast", [chosen], outputs=[present], to=TensorProto.FLOAT16)
        sink = g.op("Cast", [present], to=F32)
        halves = g.const([self.cfg.num_kv_heads] * 2)
        (sk, sv), (nk, nv) = (g.op("Split", [t, halves], n_out=2, axis=1) for t in (sink, new))
        return g.op("Concat", [sk, past[0], nk], axis=2), g.op("Concat", [sv, past[1], nv], axis=2)

    def _kv_rotation(self, inverse: bool = False) -> str | None:
        """The Hadamard rotation of quantized caches (graph/kv_cache.py), as a graph weight; None for float ones."""
        from lineside.build.graph.kv_cache import hadamard

        h = hadamard(self.cfg.head_dim) if self.kv_fmt is not None else None
        if h is None:
            return None
        return self.gb.const(h.T if inverse else h, np.float32)  # de-duplicated: one pair per graph

    def _trt_prelude(self) -> None:
        """Per-graph tensors shared by every layer: rope cos/sin for the new positions and the mask bias."""
        cfg, g = self.cfg, self.gb
        cos = g.op("Gather", [self.cos, "position_ids"], axis=0)  # [B, S, rot/2]
        sin = g.op("Gather", [self.sin, "position_ids"], axis=0)
        self.cos_b = g.op("Unsqueeze", [cos, g.const([1])])  # [B, 1, S, rot/2]
        self.sin_b = g.op("Unsqueeze", [sin, g.const([1])])
        # Key positions: the past occupies positions 0..P-1, then the new tokens' own positions.
        total = g.op("Shape", ["attention_mask"], start=1, end=2)
        seq = g.op("Shape", ["position_ids"], start=1, end=2)
        past = g.op("Sub", [total, seq])
        past_pos = g.op("Range", [g.const(0), g.op("Squeeze", [past, g.const([0])]), g.const(1)])  # [P]
        bsz = g.op("Shape", ["position_ids"], start=0, end=1)
        past_pos = g.op("Expand", [g.op("Unsqueeze", [past_pos, g.const([0])]), g.op("Concat", [bsz, past], axis=0)])
        key_pos = g.op("Concat", [past_pos, "position_ids"], axis=1)  # [B, T]
        valid = g.op("Cast", ["attention_mask"], to=TensorProto.BOOL)  # [B, T]
        n = self.kv_fmt.sink if self.kv_fmt is not None else 0
        if n:  # int4's fp16 sink entries (_kv_sink): which new entry is which sink slot, once per graph
            slots = g.const(np.arange(n, dtype=np.int64)[:, None])  # [n, 1]
            hit = g.op("Equal", [g.op("Unsqueeze", ["position_ids", g.const([1])]), slots])  # [B, n, S]
            onehot = g.op("Unsqueeze", [g.op("Cast", [hit], to=F32), g.const([1])])  # [B, 1, n, S]
            self.sink_onehot = onehot
            self.sink_written = g.op("Greater", [g.op("ReduceMax", [onehot, g.const([3])], keepdims=1),
                                                 g.const(0.5, np.float32)])  # [B, 1, n, 1]
            # Keys: the n sink slots (positions 0..n-1), then the step's past and new entries, whose copies at those
            # positions are masked. A slot is valid where the entry at its position is: [B, n] from [B, n, T].
            at = g.op("And", [g.op("Equal", [g.op("Unsqueeze", [key_pos, g.const([1])]), slots]),
                              g.op("Unsqueeze", [valid, g.const([1])])])
            slot_valid = g.op("Greater", [g.op("ReduceMax", [g.op("Cast", [at], to=F32), g.const([2])], keepdims=0),
                                          g.const(0.5, np.float32)])
            valid = g.op("Concat", [slot_valid, g.op("And", [valid, g.op("Greater", [key_pos, g.const(n - 1)])])],
                         axis=1)
            slot_pos = g.op("Expand", [g.const(np.arange(n, dtype=np.int64)[None, :]),
                                       g.op("Concat", [bsz, g.const([n])], axis=0)])  # [B, n]
            key_pos = g.op("Concat", [slot_pos, key_pos], axis=1)  # [B, n + T]
        qp = g.op("Unsqueeze", ["position_ids", g.const([2])])  # [B, S, 1]
        kp = g.op("Unsqueeze", [key_pos, g.const([1])])  # [B, 1, T]
        causal = g.op("LessOrEqual", [kp, qp])
        valid = g.op("Unsqueeze", [valid, g.const([1])])  # [B, 1, T]
        # window (None: full attention) -> [B, 1, 1, S, T] mask broadcasting over (kv_heads, group)
        self.allowed: dict[int | None, str] = {}
        for window in dict.fromkeys(cfg.layer_window(i) for i in range(cfg.num_layers)):
            allowed = causal
            if window:
                lo = g.op("Sub", [qp, g.const(int(window))])
                allowed = g.op("And", [allowed, g.op("Greater", [kp, lo])])
            allowed = g.op("And", [allowed, valid])  # [B, S, T]
            self.allowed[window] = g.op("Unsqueeze", [allowed, g.const([1, 2])])
        self.neg = g.const(-1e30, np.float32)

    def _rope(self, x: str, heads: int) -> str:
        """rotate-half RoPE on x [B, H, S, D] (first rot_dim dims)."""
        g, d, r = self.gb, self.cfg.head_dim, self.rot_dim
        if r < d:
            xr, xp = g.op("Split", [x, g.const([r, d - r])], n_out=2, axis=-1)
        else:
            xr, xp = x, None
        x1, x2 = g.op("Split", [xr, g.const([r // 2, r // 2])], n_out=2, axis=-1)
        a = g.op("Sub", [g.op("Mul", [x1, self.cos_b]), g.op("Mul", [x2, self.sin_b])])
        b = g.op("Add", [g.op("Mul", [x2, self.cos_b]), g.op("Mul", [x1, self.sin_b])])
        parts = [a, b] + ([xp] if xp else [])
        return g.op("Concat", parts, axis=-1)

    def _trt_attention(self, q: str, k: str, v: str, allowed: str, *, layer: int) -> str:
        cfg, g = self.cfg, self.gb
        nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        grp = nh // kvh

        def heads(t: str, h: int) -> str:  # [B, S, h*d] -> [B, h, S, d]
            return g.op("Transpose", [g.op("Reshape", [t, g.const([0, 0, h, d])])], perm=[0, 2, 1, 3])

        qh = self._rope(heads(q, nh), nh)
        kh, vh = self._rope(heads(k, kvh), kvh), heads(v, kvh)
        if self.key_means is not None:  # int4: keys centred on their calibrated mean (quant/kv_calib.py: exact)
            kh = g.op("Sub", [kh, g.const(self.key_means[layer][:, None, :], np.float32)])
        rot = self._kv_rotation()
        k_transposed = True
        if self.kv_fmt is None:
            kh, pk = self._kv_write(kh, "k")
            vh, pv = self._kv_write(vh, "v")
            kall = g.op("Transpose", [g.op("Concat", [pk, kh], axis=2)], perm=[0, 1, 3, 2])  # [B, kvh, d, T]
            vall = g.op("Concat", [pv, vh], axis=2)  # [B, kvh, T, d]
        else:  # quantized: K and V of the layer are stored through one set of ops (graph/kv_cache.py)
            kv = g.op("Concat", [kh, vh], axis=1)  # [B, 2·kvh, S, d]
            if rot is not None:  # stored in the rotated basis: q·k is invariant, ctx is rotated back below
                qh, kv = g.op("MatMul", [qh, rot]), g.op("MatMul", [kv, rot])
            kall, vall, k_transposed = self._kv_write_pair(kv)
        qg = g.op("Reshape", [qh, g.const([0, kvh, grp, -1, d])])  # [B, kvh, grp, S, d]
        kt = g.op("Unsqueeze", [kall, g.const([2])])  # [B,kvh,1,d,T]
        if not k_transposed:  # [B, kvh, 1, T, d]: transposed next to the MatMul (onnxruntime folds it in)
            kt = g.op("Transpose", [kt], perm=[0, 1, 2, 4, 3])
        scores = g.op("Mul", [g.op("MatMul", [qg, kt]), g.const(float(d) ** -0.5, np.float32)])
        scores = g.op("Where", [allowed, scores, self.neg])
        probs = g.op("Softmax", [scores], axis=-1)
        ctx = g.op("MatMul", [probs, g.op("Unsqueeze", [vall, g.const([2])])])  # [B, kvh, grp, S, d]
        if rot is not None:
            ctx = g.op("MatMul", [ctx, self._kv_rotation(inverse=True)])
        ctx = g.op("Transpose", [ctx], perm=[0, 3, 1, 2, 4])  # [B, S, kvh, grp, d]
        return g.op("Reshape", [ctx, g.const([0, 0, nh * d])])


def fused_name(layer: int, group: str) -> str:
    """The name a fused linear (``qkv``, ``gate_up``) is emitted under."""
    return {"qkv": f"model.layers.{layer}.self_attn.qkv_proj",
            "gate_up": f"model.layers.{layer}.mlp.gate_up_proj"}[group]


def linear_names(cfg: ModelConfig, layer: int, group: str) -> list[str]:
    """Every name a linear of ``group`` (calibrate.dense_forward's: qkv, o, gate_up, down) may be emitted under:
    the fused one, and each layer's own (GGUF blocks of different types are not fused)."""
    n = layer_tensor_names(cfg, layer)
    own = {"qkv": ["q", "k", "v"], "o": ["o"], "gate_up": ["gate", "up"], "down": ["down"]}[group]
    return [n[k] for k in own] + ([fused_name(layer, group)] if len(own) > 1 else [])


def emit_graph(cfg: ModelConfig, get_weight: WeightGetter, spec: QuantSpec, flavor: str, onnx_path: Path,
               max_seq_len: int, progress: Callable[[int], None] | None = None,
               awq_scales: dict[str, np.ndarray] | None = None, draft_layers: tuple[int, ...] = (),
               lora_targets: tuple[LoraTarget, ...] = (), key_means: np.ndarray | None = None,
               lora_x_scales: dict[str, np.ndarray] | None = None,
               prefill_stats: dict[tuple[int, str], InputStats] | None = None) -> FlavorEntry:
    """Write the dense graph for ``flavor`` to ``onnx_path`` (its layerskip drafts and, given LoRA targets, its LoRA
    variant beside it); returns its manifest entry. ``key_means`` [layers, kv_heads, head_dim]: what an int4
    cache subtracts from its keys (quant/kv_calib.py). ``lora_x_scales``: linear → s where AWQ folded 1/s into
    its input (AwqPlan.col_scale); the LoRA variant multiplies that input back by s. ``prefill_stats`` (layer,
    group) → its input on calibration text (quant/smooth.py): also the cpu flavor's int8 variant for prompt
    chunks (graph/prefill.py)."""
    return DenseEmitter(cfg, get_weight, spec, flavor, onnx_path, max_seq_len, awq_scales, draft_layers, lora_targets,
                        key_means=key_means, lora_x_scales=lora_x_scales, prefill_stats=prefill_stats).emit(progress)


class DenseFamily(ModelFamily):
    """Llama and Qwen2: HF names, read through the pipeline's getter (GGUF blocks carried, AWQ/GPTQ applied)."""

    draft_graphs = True  # emits layerskip drafts (`build --draft-layers N`)

    def check_config(self, cfg: ModelConfig, flavors: tuple[str, ...]) -> None:
        check_config(cfg, flavors)

    def required_tensors(self, cfg: ModelConfig) -> list[str]:
        return required_tensors(cfg)

    def open_weights(self, cfg: ModelConfig, ckpt: CheckpointReader, where: str) -> None:
        missing = [n for n in required_tensors(cfg) if not ckpt.has(n)]
        packed = _prequantized(ckpt.hf_config)
        try:
            if missing:
                raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing"
                                      + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                                      + "; the checkpoint is incomplete or config.json describes another model "
                                        "(re-download it)")
            check_shapes(cfg, ckpt, where)
        except CheckpointError as e:
            if not packed:
                raise
            # GPTQ/AWQ qweight, compressed-tensors weight_packed (no `.weight`), bitsandbytes' flat uint8 weights
            raise CheckpointError(f"{where}: the checkpoint is already quantized ({packed}, config.json's "
                                  "quantization_config) in a packed format lineside cannot read "
                                  f"({str(e).removeprefix(where + ': ').split(';')[0]}); build from the original "
                                  "bf16/fp16 model, which lineside quantizes itself (--quant w4a16, --method awq "
                                  "or gptq)") from None
        return None

    def emit_graph(self, cfg: ModelConfig, weights: WeightGetter | WeightSource, spec: QuantSpec, flavor: str,
                   onnx_path: Path, max_seq_len: int, *, progress: Callable[[int], None] | None = None,
                   awq_scales: dict[str, np.ndarray] | None = None, draft_layers: tuple[int, ...] = (),
                   lora_targets: tuple[LoraTarget, ...] = (), key_means: np.ndarray | None = None,
                   lora_x_scales: dict[str, np.ndarray] | None = None,
                   prefill_stats: dict[tuple[int, str], InputStats] | None = None) -> FlavorEntry:
        get = weights if callable(weights) else weights.get  # a WeightSource reads by name too
        return emit_graph(cfg, get, spec, flavor, onnx_path, max_seq_len, progress, awq_scales, draft_layers,
                          lora_targets, key_means, lora_x_scales, prefill_stats)


FAMILY = DenseFamily()
