#!/usr/bin/env python3
"""Workstation entry point: `.venv/bin/python build_engine.py CHECKPOINT -o BUNDLE [options]`.

The same options as `lineside build` (but both flavors, cpu,trt, by default); when TensorRT is
importable here and a GPU is present, it also builds the TensorRT engine for this machine's GPU into
the bundle (otherwise it says why it skipped it).
Engines are per GPU/TensorRT version, so on Jetson run `lineside engine BUNDLE` on the device.
"""

from __future__ import annotations

import sys
from typing import Annotated

try:
    import typer
except ModuleNotFoundError:  # run with a Python that lacks lineside's dependencies (not the venv's)
    sys.exit("error: this Python has no typer (lineside is not installed for it); run "
             ".venv/bin/python build_engine.py ... after `bash scripts/setup.sh`")

from lineside.build import commands as b
from lineside.cli import run_app
from lineside.errors import LinesideError


def main(
    checkpoint: b.CheckpointArg,
    output: b.OutputOpt,
    quant: b.QuantOpt = "w4a16",
    group_size: b.GroupSizeOpt = 128,
    method: b.MethodOpt = "rtn",
    calib: b.CalibOpt = None,
    flavors: b.FlavorsOpt = "cpu,trt",
    max_seq_len: b.MaxSeqLenOpt = None,
    requantize: b.RequantizeOpt = False,
    accuracy_level: b.AccuracyLevelOpt = 4,
    lm_head_bits: b.LmHeadBitsOpt = None,
    kv_dtype: b.KvDtypeOpt = "fp16",
    draft_layers: b.DraftLayersOpt = None,
    max_lora_rank: b.MaxLoraRankOpt = 0,
    lora_targets: b.LoraTargetsOpt = None,
    prefill_graph: b.PrefillGraphOpt = None,
    force: b.ForceOpt = False,
    quiet: b.QuietOpt = False,
    engine: Annotated[bool, typer.Option(help="also build the TensorRT engine when TensorRT is importable")] = True,
) -> None:
    """Build a bundle, then its TensorRT engine if this machine can."""
    b.build(checkpoint, output, quant=quant, group_size=group_size, method=method, calib=calib, flavors=flavors,
            max_seq_len=max_seq_len, requantize=requantize, accuracy_level=accuracy_level,
            lm_head_bits=lm_head_bits, kv_dtype=kv_dtype, draft_layers=draft_layers,
            max_lora_rank=max_lora_rank, lora_targets=lora_targets, prefill_graph=prefill_graph, force=force,
            quiet=quiet)
    if not engine or "trt" not in flavors:
        return
    from lineside.runtime.tensorrt import key

    try:  # TensorRT, cuda-python, a driver and a GPU: pip installs TensorRT on machines that have no GPU
        key.machine_key()
    except LinesideError as e:
        why = str(e).split(";")[0]
        print(f"skipping the TensorRT engine: {why}. The bundle is complete (its cpu flavor runs here on "
              f"onnxruntime); build the engine on the GPU machine with `lineside engine {output}` "
              "(--no-engine silences this)", file=sys.stderr)
        return
    from lineside.build.tensorrt.builder import build_engine

    path = build_engine(output)
    print(f"engine written to {path}")


if __name__ == "__main__":
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(main)
    code = run_app(app, None, prog="build_engine.py")
    if code:
        sys.exit(code)
