"""KV-cache dtypes a build may store (``--kv-dtype``), which flavor can emit which, and the manifest record.

Quantized caches (trt flavor) keep scales computed when the entry is written, stored in fp16 as a second
state tensor next to the values: int8 one per (token, KV head) = amax over head_dim / 127; int4 an asymmetric
grid, a (scale, minimum) pair per (token, KV head, group of 16 channels) = ((max − min) / 15, min), two 4-bit
values per byte. Dynamic
per-token scales follow every token's own range (K has outlier channels and tokens that a static per-head
scale from calibration clips or wastes bits on) and need no calibration text.
"""

from __future__ import annotations

from dataclasses import dataclass

from lineside.errors import LinesideError
from lineside.graph_io import PACKED_INT4
from lineside.strenum import StrEnum


class KvDtype(StrEnum):
    FP16 = "fp16"  # float cache as before: trt fp16 (fp32 for the fp32 reference), cpu float32
    INT8 = "int8"
    FP8 = "fp8"  # e4m3; TensorRT on SM >= 8.9 only (no FP8 on Orin, SM 8.7)
    INT4 = "int4"


@dataclass(frozen=True)
class KvFormat:
    """How one cached head vector is stored: its element dtype (manifest name) and its scale."""

    dtype: KvDtype
    element: str  # numpy / manifest dtype of the values
    qmax: float  # largest magnitude of the quantized grid (0 for float caches)
    scale_dtype: str | None  # dtype of the per-(token, head) scale state, None when unscaled
    offset: float = 0.0  # stored = grid value + offset (int8 grid kept in uint8 I/O)
    pack: int = 1  # grid values per stored byte (int4: 2, the halves of the head vector share a byte)
    group: int = 0  # channels per scale (0: the whole head vector)
    zero: bool = False  # asymmetric: grid 0..qmax over [min, max] of the group, an fp16 minimum beside each scale
    sink: int = 0  # a sequence's first entries also kept in fp16 (dense models): attention reads those from there

    @property
    def per_group(self) -> int:
        """fp16 numbers stored per scale group: the scale (and the group's minimum when asymmetric)."""
        return 2 if self.zero else 1

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    def stored_dim(self, head_dim: int) -> int:
        """Last dim of the stored values of one head vector (bytes)."""
        if head_dim % self.pack:
            raise LinesideError(f"--kv-dtype {self.dtype}: head_dim {head_dim} is not a multiple of {self.pack} "
                                f"(two 4-bit values per byte); use --kv-dtype int8")
        return head_dim // self.pack

    def scale_dim(self, head_dim: int) -> int:
        """Scales per head vector."""
        if not self.group or self.group >= head_dim:
            return 1
        if head_dim % self.group:
            raise LinesideError(f"--kv-dtype {self.dtype}: head_dim {head_dim} is not a multiple of its scale group "
                                f"{self.group}; use --kv-dtype int8")
        return head_dim // self.group

    def scale_state_dim(self, head_dim: int) -> int:
        """Last dim of the fp16 scale state of one head vector: a scale per group (asymmetric: (scale, minimum)
        pairs, interleaved)."""
        return self.scale_dim(head_dim) * self.per_group


FORMATS = {  # the quantized caches; fp16 (float) has none
    KvDtype.INT8: KvFormat(KvDtype.INT8, "uint8", 127.0, "float16", offset=128.0),
    KvDtype.INT4: KvFormat(KvDtype.INT4, PACKED_INT4, 15.0, "float16", pack=2, group=16, zero=True, sink=4),
}

SCALE_SCHEME = "per-token-per-head dynamic"
ROTATION = ("dense models with a power-of-two head_dim store K and V rotated by an orthonormal Hadamard matrix "
            "(queries rotated alike, the attention output rotated back): outlier channels spread over the vector, "
            "so the grid step shrinks; SmolLM2 perplexity +0.28% instead of +0.56% over fp16 KV")
SCALE_WHY = ("one fp16 scale per (token, KV head) = amax(head vector)/qmax, computed when the entry is written: "
             "follows each token's range (no calibration, no clipping of outlier tokens), 2 bytes per head vector")
INT4_SCALES = "per-token-per-head dynamic, one (scale, minimum) pair per group of 16 channels"
INT4_WHY = ("asymmetric: per (token, KV head, 16 channels) an fp16 scale (max-min)/15 and the fp16 minimum, computed "
            "when the entry is written, so all 16 levels cover the group's own range (a symmetric grid has 15 over "
            "+-amax); SmolLM2 float weights, numpy simulation, 1,024 tokens: perplexity +2.0% (one 1,024 chunk: +2.7%) "
            "against +3.4% (+4.3%) with one symmetric amax/7 scale per 16 channels, see README); 4 bytes per 16 values "
            "(+2 bits per value: head_dim 64 -> 48 bytes, 0.375x fp16)")
KEY_CENTERING = ("dense models (int4): keys stored minus their mean post-RoPE key per (layer, KV head), measured on "
                 "the calibration text (--calib or the shipped one); exact, since softmax ignores a shift every key of "
                 "a query shares, and it leaves the 4-bit grid to what varies (SmolLM2, 32-channel groups: perplexity "
                 "+11% -> +3.7% in simulation). DeepSeek-V4 stores K = V entries and keeps them uncentred")
SINK = ("dense models (int4): the first 4 entries of every sequence (positions 0-3) are also kept in fp16, K and V "
        "head vectors per (layer, KV head) in a fixed-size state (manifest update 'prefix'), and attention reads "
        "them from there: those are the attention sinks most queries put much of their weight on (StreamingLLM "
        "keeps 4 such tokens), so their 4-bit rounding error reaches every later token; 0.5 KiB per (layer, KV "
        "head) and sequence at head_dim 64, see README for SmolLM2's perplexity. DeepSeek-V4 has learned attention "
        "sinks (attn_sink logits) and keeps none")
PACKING = ("two 4-bit grid values (0..15) per byte: byte = q[c] + 16 * q[c + head_dim/2], packed "
           "by a float MatMul with a 0/1/16 matrix, unpacked with float Mul/Sub/Floor, and Cast to/from UINT8 "
           "(TensorRT 10.3's parser has no BitShift/BitwiseAnd)")


# onnx-tensorrt docs/operators.md (10.1 through the FP4 releases): "INT8, INT4, FP8 ... are treated as Quantized
# Types in TensorRT, where support is available only through quantization from a floating-point type with higher
# precision"; TensorRT's DataType docs: UINT8 "cannot be used to represent quantized floating-point values"
# (its Cast converts values, no op in the tables reinterprets bytes) -> a cache that lives between steps can't be FP8.
FP8_REFUSAL = ("--kv-dtype fp8: TensorRT takes FP8 only from a QuantizeLinear inside the network (onnx-tensorrt "
               "operators.md: quantized types only through quantization from a higher-precision float), never as "
               "the network input a cache is, and UINT8 bytes can't be reinterpreted as FP8; Orin (SM 8.7) has "
               "no FP8 at all: use --kv-dtype int8 (or int4)")


def parse_kv_dtype(value: str) -> KvDtype:
    try:
        return KvDtype(value.strip().lower())
    except ValueError:
        raise LinesideError(f"--kv-dtype {value!r} is not one of {', '.join(k.value for k in KvDtype)}") from None


def check_kv_flavors(kv: KvDtype, flavors: tuple[str, ...]) -> None:
    """Refuse, before any work, a KV dtype a requested flavor cannot store (one line each)."""
    if kv == KvDtype.FP8:
        raise LinesideError(FP8_REFUSAL)
    if kv != KvDtype.FP16 and "cpu" in flavors:
        raise LinesideError(f"--kv-dtype {kv}: the cpu flavor keeps a float32 cache (quantized KV only pays on the GPU, "
                            f"see benchmarks/kv_dtype_cpu.py); build --flavors trt with --kv-dtype {kv}")


def kv_record(kv: KvDtype, head_dim: int | None = None) -> dict[str, object]:
    """What manifest.json says about the cache (``quantization.kv_cache``); ``head_dim`` adds the bytes of one
    stored head vector."""
    if kv == KvDtype.FP16:
        return {"dtype": "fp16", "scales": None,
                "why": "float cache: trt float16 (float32 for the fp32 reference), cpu float32 (GroupQueryAttention)"}
    fmt = FORMATS[kv]
    packed = {"packing": PACKING, "key_centering": KEY_CENTERING} if fmt.pack > 1 else {}
    if fmt.sink:
        packed["sink"] = SINK
    held = "two per uint8 byte" if fmt.pack > 1 else f"as {fmt.element}"
    if fmt.zero:
        grid = (f"asymmetric 0..{fmt.qmax:g} over [min, max] of each group, value = q * scale + minimum, {held} "
                f"(TensorRT 10.3 network I/O takes UINT8, not INT8/INT4)")
    else:
        grid = (f"symmetric -{fmt.qmax:g}..{fmt.qmax:g}, stored +{fmt.offset:g} {held} (TensorRT 10.3 network I/O "
                f"takes UINT8, not INT8/INT4)")
    size = ({"bytes_per_head_vector": fmt.stored_dim(head_dim) + 2 * fmt.scale_state_dim(head_dim),
             "bytes_per_head_vector_fp16": 2 * head_dim} if head_dim else {})
    return {"dtype": kv.value, "element": fmt.element, "grid": grid, **packed,
            "scales": INT4_SCALES if fmt.group else SCALE_SCHEME, "scale_dtype": fmt.scale_dtype,
            "scale_group": fmt.group or None, **({"scale_state": "(scale, minimum) pairs, interleaved"}
                                                 if fmt.zero else {}), **size,
            "why": INT4_WHY if fmt.group else SCALE_WHY, "rotation": ROTATION,
            "flavors": ["trt"],
            "kept_high_precision": "queries, RoPE, scores and softmax in float32; K/V are dequantized inside "
                                   "attention, the new tokens' too (prefill and decode read the same values)"}
