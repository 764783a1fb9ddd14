"""What a user asked for: the quantization scheme, group size, method and CPU accuracy level."""

from __future__ import annotations

from dataclasses import dataclass

from lineside.errors import LinesideError

SCHEMES = ("fp32", "fp16", "w8a16", "w4a16")
METHODS = ("rtn", "awq", "gptq")
FLAVORS = ("cpu", "trt")
TRT_GROUP_SIZES = (64, 128)  # TensorRT INT4 block sizes (REFERENCE.md: TensorRT)
TRT_DTYPES = ("fp16", "fp32")


def _pow2_divisors(k: int) -> list[int]:
    return [g for g in (256, 128, 64, 32, 16) if k % g == 0]


@dataclass
class QuantSpec:
    """Weight quantization settings for every linear layer of a build.

    ``trt_dtype`` is the dtype of the trt flavor's dequantized weights and scales, and so of the
    MatMul TensorRT runs: "fp16" (default, the W4A16 kernels' activation type) or "fp32".
    """

    scheme: str = "w4a16"
    group_size: int = 128
    method: str = "rtn"
    accuracy_level: int = 4
    trt_dtype: str = "fp16"
    lm_head_bits: int = 8  # w4a16 keeps the LM head at 8 bits (quality); 4 reads half the bytes per token
    kv_dtype: str = "fp16"  # KV-cache storage (quant/kv.py): fp16 (float, as always) | int8 | fp8

    @property
    def bits(self) -> int:
        """Weight bits of the scheme (32 and 16 for the float schemes)."""
        return {"fp32": 32, "fp16": 16, "w8a16": 8, "w4a16": 4}[self.scheme]

    @property
    def quantized(self) -> bool:
        return self.scheme in ("w8a16", "w4a16")

    def check(self) -> None:
        """Checks that don't depend on a layer: names and ranges of every field."""
        if self.scheme not in SCHEMES:
            raise LinesideError(f"unknown quantization scheme {self.scheme!r}; use one of {', '.join(SCHEMES)}")
        if self.method not in METHODS:
            raise LinesideError(f"unknown quantization method {self.method!r}; use one of {', '.join(METHODS)}")
        gs = self.group_size
        if not isinstance(gs, int) or gs < 16 or gs & (gs - 1):
            raise LinesideError(f"group size {gs!r} is not a power of two >= 16; use 64 or 128")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise LinesideError(
                f"accuracy level {self.accuracy_level!r} is not 0-4; use 0 (exact fp32) or 4 (int8 activations, faster)"
            )
        if self.lm_head_bits not in (4, 8):
            raise LinesideError(f"LM head bits {self.lm_head_bits!r} must be 4 or 8")
        from lineside.build.quant.kv import parse_kv_dtype

        parse_kv_dtype(self.kv_dtype)
        if self.trt_dtype not in TRT_DTYPES:
            raise LinesideError(f"trt dtype {self.trt_dtype!r} is not one of {', '.join(TRT_DTYPES)}")

    def trt_group(self, in_features: int) -> int:
        """TensorRT INT4 block for a layer: the group size, or 64 where it doesn't tile ``in_features``."""
        gs = self.group_size
        return gs if in_features % gs == 0 else 64

    def validate(self, in_features: int, name: str, flavor: str | None = None) -> None:
        """Raise a one-line LinesideError if this spec can't quantize a layer with ``in_features`` inputs."""
        self.check()
        if flavor is not None and flavor not in FLAVORS:
            raise LinesideError(f"unknown graph flavor {flavor!r} for {name}; use one of {', '.join(FLAVORS)}")
        if in_features <= 0:
            raise LinesideError(f"layer {name} has {in_features} input features; the checkpoint looks malformed")
        if self.scheme != "w4a16":
            return
        gs = self.group_size
        if flavor == "trt" and gs not in TRT_GROUP_SIZES:
            raise LinesideError(
                f"group size {gs} is not supported by TensorRT INT4 (layer {name}); use --group-size 64 or 128"
            )
        if in_features % gs and flavor == "cpu" and in_features % 2 == 0:
            return  # MatMulNBits takes a ragged last block (the quantizer pads it with zeros)
        if flavor == "trt" and in_features % gs and in_features % 64 == 0:
            return  # trt_group() falls back to 64 for this layer (e.g. SmolLM2's 576 inputs at 128)
        if in_features % gs:
            ok = [g for g in _pow2_divisors(in_features) if flavor != "trt" or g in TRT_GROUP_SIZES]
            hint = f"use --group-size {' or '.join(map(str, ok))}" if ok else "use --quant w8a16 or fp16"
            if flavor == "trt":  # the cpu flavor takes a ragged last block (above): a cpu-only bundle builds
                hint += ", or build --flavors cpu"
            raise LinesideError(
                f"group size {gs} does not divide in_features {in_features} of layer {name}; {hint}"
            )
