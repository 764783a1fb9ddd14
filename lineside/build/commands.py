"""`lineside build`: checkpoint → bundle, with progress on the long steps (bars on a terminal, lines in a log)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from lineside import cli_checks as checks
from lineside.build.pipeline import BuildOptions, build_bundle, describe, refuse_taken
from lineside.build.progress import build_progress, progress_mode
from lineside.console_line import say
from lineside.errors import LinesideError
from lineside.lora import parse_targets

err = Console(stderr=True)


# The options of a build, declared once: `lineside build` and build_engine.py take the same ones.
CheckpointArg = Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory or .gguf file")]
OutputOpt = Annotated[Path, typer.Option("-o", "--output", help="bundle directory to write (its parent must exist)")]
QuantOpt = Annotated[str, typer.Option(help="fp32 | fp16 | w8a16 | w4a16")]
GroupSizeOpt = Annotated[int, checks.number_option(low=16, help="INT4 group size along in_features, a power of two "
                                                                "(64 or 128 for trt)")]
MethodOpt = Annotated[str, typer.Option(help="rtn | awq | gptq (w4a16, Llama/Qwen2)")]
CalibOpt = Annotated[Path | None, typer.Option(help="calibration text for AWQ/GPTQ and the int8 prefill graph (default: shipped text)")]
FlavorsOpt = Annotated[str, typer.Option(help="comma list of graph flavors: cpu,trt")]
MaxSeqLenOpt = Annotated[int | None, checks.number_option(
    low=2, help="context length the bundle supports (at most the model's own; default: min(model's, 4096))")]
RequantizeOpt = Annotated[bool, typer.Option(help="re-quantize a 4-bit GGUF instead of keeping its grid")]
AccuracyLevelOpt = Annotated[int, checks.number_option(
    low=0, high=4, help="MatMulNBits accuracy level for cpu (0 exact, 4 int8 activations)")]
LmHeadBitsOpt = Annotated[int | None, checks.number_option(
    low=4, high=8, help="w4a16 LM head bits: 8 (quality, the default) or 4 (speed)")]
KvDtypeOpt = Annotated[str, typer.Option(help="KV cache: fp16 (float) | int8 | int4 (trt flavor; fp8 is refused: "
                                               "TensorRT takes no FP8 cache across the network's edge)")]
DraftLayersOpt = Annotated[str | None, typer.Option(
    help="layerskip draft graphs: comma list of N (the first N layers + final norm + LM head, sharing the "
         "weights), for `--speculative layerskip:N`")]
MaxLoraRankOpt = Annotated[int, checks.number_option(
    low=0, high=1024, help="also build LoRA graphs (multi-adapter serving); the adapter slots' default rank (0: none)")]
LoraTargetsOpt = Annotated[str | None, typer.Option(help="linears the LoRA graphs adapt: comma list of "
                                                         "q,k,v,o,gate,up,down or all (the default)")]
PrefillGraphOpt = Annotated[bool | None, typer.Option(help="cpu flavor: also an int8 graph for prompt chunks (3x faster "
                                                          "prefill; the bundle holds an int8 copy of every linear); "
                                                          "default: on at --accuracy-level 4")]
ForceOpt = Annotated[bool, typer.Option(help="replace an existing bundle at -o (never a directory that is not one)")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="no progress (bars on a terminal, plain lines in a log) or log lines")]


def build(
    checkpoint: CheckpointArg,
    output: OutputOpt,
    quant: QuantOpt = "w4a16",
    group_size: GroupSizeOpt = 128,
    method: MethodOpt = "rtn",
    calib: CalibOpt = None,
    flavors: FlavorsOpt = "cpu",
    max_seq_len: MaxSeqLenOpt = None,
    requantize: RequantizeOpt = False,
    accuracy_level: AccuracyLevelOpt = 4,
    lm_head_bits: LmHeadBitsOpt = None,
    kv_dtype: KvDtypeOpt = "fp16",
    draft_layers: DraftLayersOpt = None,
    max_lora_rank: MaxLoraRankOpt = 0,
    lora_targets: LoraTargetsOpt = None,
    prefill_graph: PrefillGraphOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Build a bundle (graphs + manifest + tokenizer) from a checkpoint."""
    check_build_paths(checkpoint, output, calib, force)
    opts = BuildOptions(quant=quant, group_size=group_size, method=method, calib=calib,
                        flavors=tuple(f.strip() for f in flavors.split(",") if f.strip()),
                        max_seq_len=max_seq_len, requantize=requantize, accuracy_level=accuracy_level,
                        lm_head_bits=lm_head_bits, kv_dtype=kv_dtype, draft_layers=parse_draft_layers(draft_layers),
                        force=force, max_lora_rank=max_lora_rank, prefill_graph=prefill_graph,
                        lora_targets=None if lora_targets is None else parse_targets(lora_targets))
    with build_progress(progress_mode(quiet, err, sys.stderr), err) as progress:
        out = build_bundle(checkpoint, output, opts, progress=progress,
                           log=(lambda m: None) if quiet else (lambda m: say(err, m)))
    print(f"{out}: {describe(out)}")


def parse_draft_layers(value: str | None) -> tuple[int, ...]:
    """`--draft-layers 2` or `2,4` → (2,) / (2, 4); one line for anything else."""
    if not value:
        return ()
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts or not all(p.isdecimal() for p in parts):  # isdigit() takes "²", which int() refuses
        raise LinesideError(f"--draft-layers {value!r}: give layer counts, e.g. --draft-layers 4 or 2,4")
    return tuple(sorted({int(p) for p in parts}))


def check_build_paths(checkpoint: Path, output: Path, calib: Path | None, force: bool) -> None:
    """Every path option of a build, before the checkpoint is read (one line each; nothing is written)."""
    # absolute: a relative path's directory counts too. A GGUF file is read by Python alone, which takes any name.
    checks.utf8_path(checks.normalized(output), "-o")
    if Path(checkpoint).expanduser().is_dir():
        checks.utf8_path(checks.normalized(checkpoint), "CHECKPOINT")
    if not Path(checkpoint).expanduser().exists():
        raise LinesideError(f"{checkpoint}: no such file or directory; pass a Hugging Face directory or a .gguf file")
    out = checks.output_dir(output, "-o", force=force, what="bundle")
    if calib is not None:
        checks.input_file(calib, "--calib", "calibration text file")
    checks.apart_from(output, "-o", {"the checkpoint": checkpoint, "--calib": calib})
    refuse_taken(out, force)  # --force replaces a bundle, never a directory of the user's


def register(app: typer.Typer) -> None:
    app.command("build")(build)
