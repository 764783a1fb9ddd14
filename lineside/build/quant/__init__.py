"""quant part of lineside: QuantSpec, RTN and AWQ quantizers, GGUF block decoding, packing, sizes."""

from lineside.build.quant.awq import awq_search
from lineside.build.quant.rtn import dequantize_rtn, fake_quantize, quantize_rtn
from lineside.build.quant.size import KEPT_HIGH_PRECISION, kept_high_precision_note, quantized_bytes
from lineside.build.quant.spec import QuantSpec

__all__ = [
    "KEPT_HIGH_PRECISION",
    "QuantSpec",
    "awq_search",
    "dequantize_rtn",
    "fake_quantize",
    "kept_high_precision_note",
    "quantize_rtn",
    "quantized_bytes",
]
