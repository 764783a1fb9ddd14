#!/usr/bin/env python3
"""Workstation entry point: `python build_engine.py CHECKPOINT -o BUNDLE [options]`.

The same options as `lineside build`; when TensorRT is importable here (and the trt flavor is
built), it also builds the TensorRT engine for this machine's GPU into the bundle.
Engines are per GPU/TensorRT version, so on Jetson run `lineside engine BUNDLE` on the device.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from lineside.build.commands import build as build_command
from lineside.errors import LinesideError


def main(
    checkpoint: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory or .gguf file")],
    output: Annotated[Path, typer.Option("-o", "--output", help="bundle directory to write")],
    quant: Annotated[str, typer.Option(help="fp32 | fp16 | w8a16 | w4a16")] = "w4a16",
    group_size: Annotated[int, typer.Option(help="INT4 group size (64 or 128 for trt)")] = 128,
    method: Annotated[str, typer.Option(help="rtn | awq | gptq")] = "rtn",
    calib: Annotated[Path | None, typer.Option(help="calibration text for AWQ/GPTQ")] = None,
    flavors: Annotated[str, typer.Option(help="comma list: cpu,trt")] = "cpu,trt",
    max_seq_len: Annotated[int | None, typer.Option(help="context length")] = None,
    requantize: Annotated[bool, typer.Option(help="re-quantize a 4-bit GGUF")] = False,
    accuracy_level: Annotated[int, typer.Option(help="MatMulNBits accuracy level (cpu)")] = 4,
    lm_head_bits: Annotated[int, typer.Option(help="w4a16 LM head bits: 8 or 4")] = 8,
    kv_dtype: Annotated[str, typer.Option(help="KV cache: fp16 | int8 (trt flavor only: --flavors trt)")] = "fp16",
    force: Annotated[bool, typer.Option(help="replace an existing output directory")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    engine: Annotated[bool, typer.Option(help="also build the TensorRT engine when TensorRT is importable")] = True,
) -> None:
    """Build a bundle, then its TensorRT engine if this machine can."""
    build_command(checkpoint, output, quant=quant, group_size=group_size, method=method, calib=calib,
                  flavors=flavors, max_seq_len=max_seq_len, requantize=requantize, accuracy_level=accuracy_level,
                  lm_head_bits=lm_head_bits, kv_dtype=kv_dtype, force=force, quiet=quiet)
    if not engine or "trt" not in flavors:
        return
    from lineside.runtime.tensorrt.env import import_tensorrt

    try:
        import_tensorrt()
    except LinesideError as e:
        print(f"skipping the TensorRT engine: {e}", file=sys.stderr)
        return
    from lineside.build.tensorrt.builder import build_engine

    path = build_engine(output)
    print(f"engine written to {path}")


if __name__ == "__main__":
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(main)
    try:
        app()
    except LinesideError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
