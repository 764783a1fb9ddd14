"""Bytes a quantized weight takes, for the memory planner, and which tensors stay in higher precision."""

from __future__ import annotations

import math

from lineside.build.quant.spec import QuantSpec

# (tensor kind, precision kept, why) — written into the bundle manifest next to the quantization.
KEPT_HIGH_PRECISION: tuple[tuple[str, str, str], ...] = (
    ("norm weights (RMSNorm/LayerNorm)", "float32",
     "tiny vectors that scale every activation; quantizing them saves nothing and costs accuracy"),
    ("biases", "float32", "one value per output; added after the matmul"),
    ("token embeddings (w4a16/w8a16, cpu flavor)", "8-bit codes + float32 scales (the LM head's table if tied)",
     "only the gathered rows are dequantized; a 4-bit table can't be gathered with standard ops"),
    ("token embeddings (w4a16/w8a16, trt flavor)", "float16",
     "TensorRT 10.3 can't Gather INT8/UINT8 tensors, so the table stays a float16 Gather"),
    ("LM head (w4a16, via emit_lm_head)", "int8 per-channel (w8a16)",
     "logits are the most quantization-sensitive output; emit_lm_head(keep_8bit=False) makes it 4-bit"),
    ("GGUF Q4_0/Q4_1/Q8_0 weights (cpu flavor)", "the source grid (Q4_1's offsets at accuracy level 4 to within d/32 of the GGUF's, quant/q4_1.py)",
     "re-quantizing an already-quantized weight adds a second rounding error"),
    ("AWQ input scales", "float32", "a per-input-channel Mul on the activations (or folded by the caller)"),
)


def kept_high_precision_note() -> list[dict[str, str]]:
    """Manifest-ready list of the tensors not quantized to the scheme's bits, and why."""
    return [{"tensors": t, "precision": p, "why": w} for t, p, w in KEPT_HIGH_PRECISION]


def quantized_bytes(shape: tuple[int, ...] | list[int], spec: QuantSpec, *, flavor: str = "trt") -> int:
    """Bytes of a linear weight ``[out, in]`` (codes + scales) as emitted by ``emit_linear``.

    trt: fp16 scales when ``spec.trt_dtype == "fp16"``; cpu: float32 scales, and w8a16's per-channel
    scale repeated per block (MatMulNBits has no per-channel mode), or float32 below accuracy level 4.
    """
    out_f, in_f = (int(v) for v in shape[-2:])
    lead = math.prod(int(v) for v in shape[:-2])
    n = out_f * in_f
    if spec.scheme == "fp32":
        per = 4 * n
    elif spec.scheme == "fp16":
        per = 2 * n
    else:
        scale_bytes = 2 if (flavor == "trt" and spec.trt_dtype == "fp16") else 4
        if spec.scheme == "w4a16":
            per = (n + 1) // 2 + out_f * math.ceil(in_f / spec.group_size) * scale_bytes
        elif flavor == "trt":
            per = n + out_f * scale_bytes
        elif spec.accuracy_level < 4:  # emit_linear stores 8-bit grids as float32 there (speed)
            per = 4 * n
        else:
            block = next((g for g in (spec.group_size, 128, 64, 32, 16) if in_f % g == 0), in_f)
            per = n + out_f * (in_f // block) * scale_bytes
    return lead * per
