"""`lineside serve BUNDLE`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from lineside import cli_checks as checks

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def serve(
    bundle: Annotated[Path, typer.Argument(help="bundle directory (from `lineside build`)")],
    host: Annotated[str, typer.Option(help="address to bind; 0.0.0.0 serves the local network")] = "127.0.0.1",
    port: Annotated[int, checks.number_option(low=1, high=65535, help="TCP port")] = 8000,
    backend: Annotated[str, typer.Option(help="auto | onnxruntime | tensorrt")] = "auto",
    api_key: Annotated[str | None, typer.Option(envvar="LINESIDE_API_KEY", show_envvar=True,
                                                help="require 'Authorization: Bearer KEY' on /v1/*")] = None,
    request_timeout: Annotated[float | None, checks.number_option(
        kind=float, above=0, high=checks.MAX_SECONDS, help="seconds a request may take (default: none)")] = None,
    max_waiting: Annotated[int, checks.number_option(low=0, help="waiting-queue bound; beyond it requests get "
                                                                "429")] = 256,
    num_slots: Annotated[int, checks.number_option(low=1, high=4096, help="sequences decoded together (KV "
                                                                         "slots)")] = 8,
    drain_timeout: Annotated[float, checks.number_option(
        kind=float, low=0, high=checks.MAX_SECONDS,
        help="on SIGTERM, seconds to let in-flight requests finish")] = 30.0,
    latency_log: Annotated[Path | None, typer.Option(help="append one JSON line per finished request")] = None,
    threads: Annotated[int | None, checks.number_option(low=1, high=checks.MAX_THREADS,
                                                        help="onnxruntime intra-op threads")] = None,
    log_level: Annotated[str, typer.Option(help="critical | error | warning | info | debug")] = "info",
    access_log: Annotated[bool, typer.Option(help="log every HTTP request")] = False,
    served_model_name: Annotated[list[str] | None, typer.Option(
        help="name clients send as 'model' (repeat for aliases; the first is the id shown); default: the "
             "bundle directory's name and the checkpoint's name")] = None,
) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API (SSE streaming, /health, /metrics)."""
    from lineside.bundle import read_manifest
    from lineside.server.app import create_app
    from lineside.server.serve import bind_socket, run

    backend = checks.choice(backend, "--backend", ("auto", "onnxruntime", "tensorrt"))
    log_level = checks.choice(log_level, "--log-level", LOG_LEVELS)
    if latency_log is not None:
        checks.output_file(latency_log, "--latency-log", append=True)
    manifest = read_manifest(bundle)  # a wrong path fails here in one line, before the socket opens
    if backend != "tensorrt":  # the onnxruntime arena lives in host memory: refuse what cannot fit
        checks.fits_in_memory(checks.decode_state_bytes(manifest, num_slots),
                              f"the KV cache for --num-slots {num_slots}", "lower --num-slots")
    sock = bind_socket(host, port)  # a busy/privileged port or a foreign host: one line, before the model loads
    try:
        logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
        app = create_app(bundle, api_key=api_key, request_timeout=request_timeout, max_waiting=max_waiting,
                         latency_log=latency_log, drain_timeout=drain_timeout, backend=backend,
                         num_slots=num_slots, threads=threads,
                         served_model_names=[n.strip() for n in served_model_name or [] if n.strip()])
    except BaseException:
        sock.close()
        raise
    run(app, sock, log_level=log_level, access_log=access_log)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
