"""A weight already quantized by the build (GPTQ): symmetric INT4 codes + per-group scales, plain data.

Getters hand it to the emitters in place of a float weight, so a calibrated quantizer's exact choice
of codes reaches the graph instead of being re-rounded by RTN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lineside.build.quant.rtn import dequantize_rtn
from lineside.errors import LinesideError


@dataclass(frozen=True)
class Int4Grid:
    """``w ≈ codes * scales`` per group: codes int8 ``[out, in]`` in [-8, 7], scales ``[out, ceil(in/group)]``."""

    codes: np.ndarray
    scales: np.ndarray
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.scales.shape != (n, -(-k // self.group_size)):
            raise LinesideError(f"INT4 grid scales {self.scales.shape} don't fit codes {self.codes.shape} "
                               f"in groups of {self.group_size}; rebuild the bundle")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]``: exactly the weight the quantized graph multiplies by."""
        return dequantize_rtn(self.codes, self.scales, self.group_size)


def concat_grids(grids: list[Int4Grid], name: str) -> Int4Grid:
    """Stack grids of layers sharing an input (q/k/v, gate/up) by output rows; rows quantize independently."""
    if len({g.group_size for g in grids}) != 1 or len({g.shape[1] for g in grids}) != 1:
        raise LinesideError(f"{name}: INT4 grids with different group sizes or inputs can't be fused; rebuild")
    dt = np.result_type(*[g.scales.dtype for g in grids])
    return Int4Grid(np.concatenate([g.codes for g in grids]), np.concatenate([g.scales.astype(dt) for g in grids]),
                    grids[0].group_size)
