"""`lineside deploy datacenter MODEL --gpus 8xH200 --engine vllm -o DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lineside import cli_checks as checks

deploy = typer.Typer(help="Deploy models lineside does not serve itself (DeepSeek-V4 on datacenter GPUs).",
                     no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@deploy.command("datacenter")
def datacenter_cmd(
    model: Annotated[str, typer.Argument(help="a shipped config name as `jetson plan` takes it (e.g. deepseek-v4-flash) "
                                               "or a Hugging Face checkpoint directory; not a bundle or GGUF")],
    gpus: Annotated[str, typer.Option(help="COUNTxGPU, COUNT 1 to 8 (one node): 8xH200, 6xB200, 3xH100, ...; or auto: this host's "
                                         "GPUs from nvidia-smi (one kind of H100, H200, B200). GPUs the model cannot "
                                         "split over are left idle and named")],
    engine: Annotated[str, typer.Option(help="vllm | sglang | trtllm")],
    output: Annotated[Path, typer.Option("--output", "-o", help="directory for the config, launch.sh and compose")],
    profile: Annotated[str, typer.Option(help="throughput (attention-DP, MTP 1; batch pools; dense models pipelined "
                                               "onto GPUs TP leaves idle) | latency (TP, MTP 3)")]
    = "throughput",
    mtp_tokens: Annotated[int | None, checks.number_option(
        low=0, high=16, help="MTP draft tokens (default: 1 throughput, 3 latency)")] = None,
    gpu_memory_utilization: Annotated[float, checks.number_option(
        kind=float, above=0, high=1, help="share of each GPU's memory the engine may use")] = 0.90,
    model_dir: Annotated[str, typer.Option(help="where the checkpoints are mounted in the container")] = "/models",
    force: Annotated[bool, typer.Option(help="replace files in --output that differ from what this writes "
                                             "(edited since, or another deployment's)")] = False,
) -> None:
    """Write the engine's launch command and config (TP/EP, attention-DP, FP8 KV, MTP, CUDA graphs, max context)
    and a docker compose file for engine + SMG gateway; refuse what the engine does not run."""
    from lineside.deploy.compose import write_deployment
    from lineside.deploy.engines import build_deployment, format_deployment

    checks.target_dir(output, "--output")  # before anything is written
    d = build_deployment(model, gpus, engine, profile=profile, mtp_tokens=mtp_tokens, model_dir=model_dir,
                         gpu_memory_utilization=gpu_memory_utilization)
    written = write_deployment(d, output, force=force)
    print(format_deployment(d))
    print("wrote " + ", ".join(str(p) for p in written))


def register(app: typer.Typer) -> None:
    app.add_typer(deploy, name="deploy")
