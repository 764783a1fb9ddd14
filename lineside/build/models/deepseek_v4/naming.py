"""Official DeepSeek ↔ Hugging Face tensor names, and a reader view that always answers in HF names.

The renames are transformers' ``conversion_mapping.py`` entry for ``deepseek_v4`` (applied in order);
official checkpoints also split the routed experts (``experts.E.w1/w2/w3``) where HF stacks them
(``experts.gate_up_proj`` [E, 2I, D] = w1 ‖ w3, ``experts.down_proj`` [E, D, I]). Weights in FP8 or
MXFP4 are dequantized per tensor (per expert) on read.
"""

from __future__ import annotations

import re

import numpy as np

from lineside.build.checkpoint import CheckpointReader
from lineside.build.checkpoint.fp8_mxfp4 import dequantize
from lineside.errors import CheckpointError

# (official pattern, HF replacement), in transformers' order.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_TOP_LEVEL = ("lm_head.weight",)
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # appended to names that don't end in .weight


def official_to_hf(name: str) -> str:
    """HF name of an official tensor (routed experts map to their stacked HF tensor).

    Also accepts what transformers' ``save_pretrained`` writes (official names under a ``model.``
    prefix) and HF names themselves: the renames never match an HF name, so they pass unchanged.
    """
    m = _EXPERT.match(name)
    if m:
        stacked = "down_proj" if m.group(3) == "w2" else "gate_up_proj"
        return f"model.layers.{m.group(1)}.mlp.experts.{stacked}"
    out = name[len("model."):] if name.startswith("model.") else name
    for pat, rep in _RENAMES:
        out = re.sub(pat, rep, out, count=1)
    return out if out in _TOP_LEVEL else "model." + out


def hf_to_official(name: str) -> str:
    """Official name of a (non-expert) HF tensor; the inverse of ``official_to_hf``."""
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        raise ValueError(f"{name} is stored per expert under official naming (experts.E.w1/w2/w3)")
    out = name[len("model."):] if name.startswith("model.") else name
    fixed = {
        "embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale",
    }
    if out in fixed:
        return fixed[out]
    back = [
        (".compressor.indexer.scorer.weights_proj.", ".indexer.weights_proj."),
        (".compressor.indexer.q_b_proj.", ".indexer.wq_b."),
        (".compressor.indexer.", ".indexer.compressor."),
        (".self_attn.", ".attn."), (".mlp.", ".ffn."),
        (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."),
        (".attn_hc.fn", ".hc_attn_fn"), (".attn_hc.base", ".hc_attn_base"), (".attn_hc.scale", ".hc_attn_scale"),
        (".ffn_hc.fn", ".hc_ffn_fn"), (".ffn_hc.base", ".hc_ffn_base"), (".ffn_hc.scale", ".hc_ffn_scale"),
        (".sinks", ".attn_sink"), (".position_bias", ".ape"), (".q_a_proj.", ".wq_a."), (".q_b_proj.", ".wq_b."),
        (".compressor.kv_norm.", ".compressor.norm."), (".kv_proj.", ".wkv."), (".gate_proj.", ".wgate."),
        (".o_a_proj.", ".wo_a."), (".o_b_proj.", ".wo_b."), (".q_a_norm.", ".q_norm."),
        (".gate.e_score_correction_bias", ".gate.bias"), (".shared_experts.wgate.", ".shared_experts.w1."),
        (".shared_experts.down_proj.", ".shared_experts.w2."), (".shared_experts.up_proj.", ".shared_experts.w3."),
    ]
    for a, b in back:
        out = out.replace(a, b)
    return out


def expert_official_names(layer: int, expert: int) -> tuple[str, str, str]:
    """Official names of one routed expert's gate (w1), up (w3) and down (w2) weights."""
    p = f"layers.{layer}.ffn.experts.{expert}"
    return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"


class V4Source:
    """A checkpoint reader seen through HF names, whatever the naming and dtype on disk."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        names = list(reader.names())
        self._names = set(names)
        self.official = any(_EXPERT.match(n) for n in names)  # routed experts stored one by one
        self._prefix = "model." if any(n.startswith("model.layers.") for n in names) else ""
        self._hf: dict[str, str] = {}
        for n in names:
            if not _EXPERT.match(n) and not _is_scale(n, self._names):
                self._hf.setdefault(official_to_hf(n), n)

    # ---- names -------------------------------------------------------------------------
    def source_name(self, hf_name: str) -> str:
        """The name this tensor has (or would have) on disk, for messages."""
        if hf_name in self._hf:
            return self._hf[hf_name]
        if not self.official:
            return hf_name
        off = hf_to_official(hf_name)
        return off if off in ("head.weight",) else self._prefix + off

    def has(self, hf_name: str) -> bool:
        return hf_name in self._hf

    def missing(self, hf_names: list[str], n_experts: dict[int, int]) -> list[str]:
        """Source names of required tensors that are absent (experts checked one by one when split)."""
        out = []
        for n in hf_names:
            m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", n)
            if m and self.official:
                layer = int(m.group(1))
                for e in range(n_experts.get(layer, 0)):
                    g, u, d = (self._prefix + x for x in expert_official_names(layer, e))
                    need = (g, u) if m.group(2) == "gate_up_proj" else (d,)
                    out += [x for x in need if x not in self._names]
            elif not self.has(n):
                out.append(self.source_name(n))
        return out

    def source_names(self) -> set[str]:
        return set(self._names)

    def expert_names(self, layer: int, e: int) -> tuple[str, str, str]:
        """On-disk names of a routed expert stored one by one (official naming): gate, up, down."""
        g, u, d = expert_official_names(layer, e)
        return self._prefix + g, self._prefix + u, self._prefix + d

    def logical_shape(self, src: str) -> tuple[int, ...]:
        """Shape of on-disk tensor ``src`` counted in values: MXFP4 (int8/uint8 with a scale) packs two a byte."""
        shape = tuple(int(v) for v in self.reader.shape(src))
        dtype = self.reader.dtype(src) if hasattr(self.reader, "dtype") else str(self.reader.get_raw(src).dtype)
        if dtype.upper() in ("I8", "U8", "INT8", "UINT8") and self._scale_name(src) is not None:
            return (*shape[:-1], 2 * shape[-1])
        return shape

    # ---- tensors -----------------------------------------------------------------------
    def read_source(self, name: str) -> np.ndarray:
        """float32 tensor by its on-disk name (dequantized if stored as FP8/MXFP4, like ``get``)."""
        return self._read(name)

    def get(self, hf_name: str) -> np.ndarray:
        """float32 tensor in HF layout (dequantized if stored as FP8/MXFP4)."""
        if hf_name not in self._hf:
            raise CheckpointError(f"tensor {self.source_name(hf_name)!r} is missing from the checkpoint")
        return self._read(self._hf[hf_name])

    def get_int(self, hf_name: str) -> np.ndarray:
        """An integer table (``tid2eid``) as int64."""
        raw = np.asarray(self.reader.get_raw(self._hf[hf_name]))
        if raw.dtype.kind not in "iu":
            if raw.dtype.kind == "f" and np.all(raw == np.round(raw)):
                return raw.astype(np.int64)
            raise CheckpointError(f"tensor {self._hf[hf_name]!r} must hold integers (expert ids), got {raw.dtype}")
        return raw.astype(np.int64)

    def expert(self, layer: int, e: int, inter: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, D], up [I, D], down [D, I]) float32 of routed expert ``e`` in ``layer``."""
        if self.official:
            g, u, d = self.expert_names(layer, e)
            return self._read(g), self._read(u), self._read(d)
        gu_name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
        dn_name = f"model.layers.{layer}.mlp.experts.down_proj"
        gu = self._read(gu_name, index=e)
        dn = self._read(dn_name, index=e)
        return gu[:inter], gu[inter:], dn

    def _read(self, src: str, index: int | None = None) -> np.ndarray:
        try:
            raw = self.reader.get_raw(src)
        except CheckpointError:
            raise
        except KeyError:
            raise CheckpointError(f"tensor {src!r} is missing from the checkpoint") from None
        if not isinstance(raw, np.ndarray):
            raise CheckpointError(f"tensor {src!r}: unsupported storage {type(raw).__name__} for DeepSeek-V4")
        scale = self._scale(src)
        if index is not None:
            raw = raw[index]
            scale = scale[index] if scale is not None else None
        return dequantize(raw, scale, src)

    def _scale(self, src: str) -> np.ndarray | None:
        name = self._scale_name(src)
        return None if name is None else np.asarray(self.reader.get_raw(name))

    def _scale_name(self, src: str) -> str | None:
        cands = [src[: -len(".weight")] + s for s in (".scale", ".weight_scale_inv")] if src.endswith(".weight") else []
        cands += [src + s for s in SCALE_SUFFIXES]
        return next((c for c in cands if c in self._names), None)


def _is_scale(name: str, names: set[str]) -> bool:
    for suf in (".scale", ".weight_scale_inv"):
        if name.endswith(suf) and name[: -len(suf)] + ".weight" in names:
            return True
    return any(name.endswith(s) and name[: -len(s)] in names for s in SCALE_SUFFIXES)
