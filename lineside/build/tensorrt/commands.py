"""CLI: `lineside engine BUNDLE` (build the TensorRT engine here) and `lineside check BUNDLE --trt 10.3`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from lineside import cli_checks as checks
from lineside.console_line import say
from lineside.errors import LinesideError


def register(app: typer.Typer) -> None:
    @app.command("engine")
    def engine(
        bundle: Path = typer.Argument(..., help="bundle directory (with a trt graph)"),
        slots: int = checks.number_option("--slots", default=4, low=1, high=1024,
                                          help="max batch = number of decode slots the server runs"),
        max_prefill: int = checks.number_option("--max-prefill", default=None, low=1,
                                                help="longest prompt chunk per step (default 512)"),
        max_logits: int = checks.number_option("--max-logits", default=None, low=1,
                                               help="logits positions per step (default: fits 256 MB)"),
        fp16: bool = typer.Option(True, "--fp16/--no-fp16", help="let TensorRT run layers in fp16"),
        workspace_gb: float = checks.number_option("--workspace-gb", default=None, kind=float, above=0,
                                                   help="builder memory limit in GB"),
        opt_level: int = checks.number_option("--opt-level", default=None, low=0, high=5,
                                              help="builder optimization level"),
        max_loras: int = checks.number_option("--max-loras", default=0, low=0, high=64,
                                              help="build the LoRA graph's engine with this many adapter slots "
                                                   "(0: the base graph's)"),
        max_lora_rank: int = checks.number_option("--max-lora-rank", default=None, low=1, high=1024,
                                                  help="rank of each adapter slot (default: the bundle's)"),
        force: bool = typer.Option(False, "--force",
                                   help="build even when BUNDLE already holds this machine's engine with these "
                                        "settings (another build's, or an earlier run's)"),
    ) -> None:
        """Build the TensorRT engine for this machine's GPU into BUNDLE/engines/<key>/.

        A good engine of these settings already there (another run's) is kept; --force rebuilds it."""
        from lineside.build.tensorrt.builder import BuildOptions, ensure_built

        checks.input_dir(bundle, "BUNDLE", "bundle directory")

        try:
            done = ensure_built(bundle, BuildOptions(slots, max_prefill, max_logits, fp16, workspace_gb, opt_level,
                                                     max_loras=max_loras, max_lora_rank=max_lora_rank), force=force)
        except LinesideError as e:  # the backend's lines end in advice for serve/generate, which have --backend
            if "use --backend onnxruntime" not in str(e):
                raise
            raise LinesideError(str(e).replace("use --backend onnxruntime", "run the bundle without an engine "
                                               f"(`lineside serve {bundle} --backend onnxruntime`)")) from None
        typer.echo(f"engine written to {done.path}" if done.built else f"engine kept in {done.path}")

    @app.command("check")
    def check(
        bundle: Path = typer.Argument(..., help="bundle directory, or a .onnx file"),
        trt: str = typer.Option("10.3", "--trt", help="TensorRT release: 10.3 (JetPack 6) or newest"),
    ) -> None:
        """List the trt graph's nodes that TensorRT's ONNX parser would reject (runs without TensorRT)."""
        from lineside.build.tensorrt.check import check_bundle_graphs, check_onnx_file
        from lineside.bundle import open_bundle

        if bundle.suffix == ".onnx":
            checks.input_file(bundle, "BUNDLE", ".onnx file")
        else:
            checks.input_dir(bundle, "BUNDLE", "bundle directory")
        reps = [check_onnx_file(bundle, trt)] if bundle.suffix == ".onnx" else check_bundle_graphs(open_bundle(bundle),
                                                                                                 trt)
        console = Console()
        for rep in reps:  # the trt graph, then its LoRA graph when the bundle has one
            for n in rep.notes:
                say(console, f"note: {n}")
            if rep.offenders:
                t = Table("node", "op", "dtype", "why")
                for o in rep.offenders:
                    t.add_row(o.node, o.op, o.dtypes, o.reason)
                console.print(t)
                raise LinesideError(f"{rep.summary()}; fix the graph emitter or use --backend onnxruntime")
            say(console, rep.summary())
