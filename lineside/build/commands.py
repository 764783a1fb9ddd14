"""`lineside build`: checkpoint → bundle, with progress bars on the long steps."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from lineside.build.pipeline import BuildOptions, build_bundle, describe

err = Console(stderr=True)


@contextmanager
def rich_progress(enabled: bool = True):
    """Yield a factory (description, total) → advance(n) backed by one rich progress display."""
    if not enabled:
        yield lambda _d, _t: (lambda _n: None)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=False) as prog:
        def factory(desc: str, total: int) -> Callable[[int], None]:
            task = prog.add_task(desc, total=total)
            return lambda n: prog.advance(task, n)
        yield factory


def build(
    checkpoint: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory or .gguf file")],
    output: Annotated[Path, typer.Option("-o", "--output", help="bundle directory to write")],
    quant: Annotated[str, typer.Option(help="fp32 | fp16 | w8a16 | w4a16")] = "w4a16",
    group_size: Annotated[int, typer.Option(help="INT4 group size along in_features (64 or 128 for trt)")] = 128,
    method: Annotated[str, typer.Option(help="rtn | awq | gptq (w4a16, Llama/Qwen2)")] = "rtn",
    calib: Annotated[Path | None, typer.Option(help="calibration text for AWQ/GPTQ (default: shipped text)")] = None,
    flavors: Annotated[str, typer.Option(help="comma list of graph flavors: cpu,trt")] = "cpu",
    max_seq_len: Annotated[int | None, typer.Option(help="context length the bundle supports")] = None,
    requantize: Annotated[bool, typer.Option(help="re-quantize a 4-bit GGUF instead of keeping its grid")] = False,
    accuracy_level: Annotated[int, typer.Option(help="MatMulNBits accuracy level for cpu (0 exact, 4 int8 act)")] = 4,
    lm_head_bits: Annotated[int, typer.Option(help="w4a16 LM head bits: 8 (quality) or 4 (speed)")] = 8,
    kv_dtype: Annotated[str, typer.Option(help="KV cache: fp16 (float) | int8 | fp8 (trt flavor; fp8 needs SM >= 8.9)")] = "fp16",
    force: Annotated[bool, typer.Option(help="replace an existing output directory")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bars")] = False,
) -> None:
    """Build a bundle (graphs + manifest + tokenizer) from a checkpoint."""
    opts = BuildOptions(quant=quant, group_size=group_size, method=method, calib=calib,
                        flavors=tuple(f.strip() for f in flavors.split(",") if f.strip()),
                        max_seq_len=max_seq_len, requantize=requantize, accuracy_level=accuracy_level,
                        lm_head_bits=lm_head_bits, kv_dtype=kv_dtype, force=force)
    with rich_progress(not quiet and err.is_terminal) as progress:
        out = build_bundle(checkpoint, output, opts, progress=progress,
                           log=(lambda m: None) if quiet else err.print)
    print(f"{out}: {describe(out)}")


def register(app: typer.Typer) -> None:
    app.command("build")(build)
