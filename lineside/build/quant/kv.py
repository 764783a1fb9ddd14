"""KV-cache dtypes a build may store (``--kv-dtype``), which flavor can emit which, and the manifest record.

Quantized caches (trt flavor, int8) keep one scale per (token, KV head), computed when the entry is
written: amax over head_dim / qmax, stored in fp16 as a second state tensor next to the values.
Dynamic per-token scales follow every token's own range (K has outlier channels and tokens that a
static per-head scale from calibration clips or wastes bits on), cost 2 bytes per head vector
(+1.6% at head_dim 128) and need no calibration text.
"""

from __future__ import annotations

from dataclasses import dataclass

from lineside.errors import LinesideError
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

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None


FORMATS = {  # the quantized caches; fp16 (float) has none
    KvDtype.INT8: KvFormat(KvDtype.INT8, "uint8", 127.0, "float16", offset=128.0),
}

SCALE_SCHEME = "per-token-per-head dynamic"
ROTATION = ("dense models with a power-of-two head_dim store K and V rotated by an orthonormal Hadamard matrix "
            "(queries rotated alike, the attention output rotated back): outlier channels spread over the vector, "
            "so the grid step shrinks; SmolLM2 perplexity +0.28% instead of +0.56% over fp16 KV")
SCALE_WHY = ("one fp16 scale per (token, KV head) = amax(head vector)/qmax, computed when the entry is written: "
             "follows each token's range (no calibration, no clipping of outlier tokens), 2 bytes per head vector")


def parse_kv_dtype(value: str) -> KvDtype:
    try:
        return KvDtype(value.strip().lower())
    except ValueError:
        raise LinesideError(f"--kv-dtype {value!r} is not one of {', '.join(k.value for k in KvDtype)}") from None


def check_kv_flavors(kv: KvDtype, flavors: tuple[str, ...]) -> None:
    """Refuse, before any work, a KV dtype a requested flavor cannot store (one line each)."""
    if kv == KvDtype.INT4:
        raise LinesideError("--kv-dtype int4: neither flavor can store it (TensorRT 10.3 takes INT4 only as constant "
                            "weights; onnxruntime's CPU GroupQueryAttention fails on 4-bit caches); use --kv-dtype int8")
    if kv == KvDtype.FP8:
        raise LinesideError("--kv-dtype fp8: TensorRT's ONNX parser takes no FP8 network input/output (the cache "
                            "would cross the graph's edge in FP8; `lineside check` refuses it), and Orin (SM 8.7) "
                            "has no FP8; use --kv-dtype int8")
    if kv != KvDtype.FP16 and "cpu" in flavors:
        raise LinesideError(f"--kv-dtype {kv}: the cpu flavor keeps a float32 cache (quantized KV only pays on the GPU, "
                            f"see benchmarks/kv_dtype_cpu.py); build --flavors trt with --kv-dtype {kv}")


def kv_record(kv: KvDtype) -> dict[str, object]:
    """What manifest.json says about the cache (``quantization.kv_cache``)."""
    if kv == KvDtype.FP16:
        return {"dtype": "fp16", "scales": None,
                "why": "float cache: trt float16 (float32 for the fp32 reference), cpu float32 (GroupQueryAttention)"}
    fmt = FORMATS[kv]
    return {"dtype": kv.value, "element": fmt.element, "grid": f"symmetric -{fmt.qmax:g}..{fmt.qmax:g}, stored "
            f"+{fmt.offset:g} as {fmt.element} (TensorRT 10.3 network I/O takes UINT8, not INT8)",
            "scales": SCALE_SCHEME, "scale_dtype": fmt.scale_dtype, "why": SCALE_WHY, "rotation": ROTATION,
            "flavors": ["trt"],
            "kept_high_precision": "queries, RoPE, scores and softmax in float32; K/V are dequantized inside "
                                   "attention, the new tokens' too (prefill and decode read the same values)"}
