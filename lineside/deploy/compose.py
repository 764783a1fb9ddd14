"""The files `lineside deploy datacenter` writes: engine config, launch script, docker compose (engine + SMG)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from lineside.deploy.engines import PORT, Deployment
from lineside.errors import LinesideError

SMG_PIN = "smg==1.13.0"
GATEWAY_PORT = 30000
METRICS_PORT = 29000


def smg_argv(workers: list[str], policy: str = "cache_aware") -> list[str]:
    """The SMG router in front of the engine replicas (same options as `lineside fleet gateway` uses)."""
    return ["smg", "launch", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT), "--worker-urls", *workers,
            "--policy", policy, "--sticky-sessions", "--routing-key-headers", "x-session-id", "x-smg-routing-key",
            "--sticky-key-idle-secs", "300", "--health-check-endpoint", "/health",
            "--health-check-interval-secs", "10", "--cb-failure-threshold", "5", "--cb-timeout-duration-secs", "30",
            "--retry-max-retries", "3", "--prometheus-host", "0.0.0.0", "--prometheus-port", str(METRICS_PORT),
            "--worker-startup-timeout-secs", "3600"]


def project_name(served_name: str) -> str:
    """docker compose's project name: compose-spec allows only [a-z0-9_-], first a letter or digit, and refuses
    the whole file otherwise (a served name such as deepseek-r1-distill-qwen-1.5b has a dot)."""
    return "lineside-" + (re.sub(r"[^a-z0-9_-]+", "-", served_name.lower()).strip("-_") or "model")


def compose(d: Deployment) -> dict[str, Any]:
    """docker compose: one service per engine replica (its GPUs reserved), and the gateway after them."""
    services: dict[str, Any] = {}
    for r in d.replicas:
        services[r.name] = {
            "image": d.image,
            "entrypoint": r.command,  # replaces the image's own entrypoint (vllm-openai has one)
            "ipc": "host",
            "shm_size": "32gb",
            "ulimits": {"memlock": -1, "stack": 67108864},
            "volumes": ["${MODEL_DIR:-/models}:/models:ro", f"./{d.config_file}:/config/{d.config_file}:ro"],
            "environment": {"HF_HUB_OFFLINE": "1"},
            "deploy": {"resources": {"reservations": {"devices": [
                {"driver": "nvidia", "device_ids": [str(i) for i in r.gpu_ids], "capabilities": ["gpu"]}]}}},
            "healthcheck": {"test": ["CMD-SHELL", "curl -fsS http://localhost:8000/health || exit 1"],
                            "interval": "30s", "timeout": "5s", "retries": 3, "start_period": "3600s"},
            "restart": "unless-stopped",
        }
    workers = [f"http://{r.name}:8000" for r in d.replicas]
    services["gateway"] = {
        "image": "python:3.12-slim",
        "command": ["sh", "-c", f"pip install --no-cache-dir '{SMG_PIN}' && exec " + shlex.join(smg_argv(workers))],
        "ports": [f"{GATEWAY_PORT}:{GATEWAY_PORT}", f"127.0.0.1:{METRICS_PORT}:{METRICS_PORT}"],
        "depends_on": {r.name: {"condition": "service_healthy"} for r in d.replicas},
        "restart": "unless-stopped",
    }
    return {"name": project_name(d.served_name), "services": services}


def deployment_files(d: Deployment) -> dict[str, str]:
    """What `deploy datacenter` writes into its directory: file name -> text (launch.sh is made executable)."""
    lines = ["#!/bin/sh", f"# {d.model} on {d.gpus} with {d.engine}; the config is ./{d.config_file}", "set -e"]
    if len(d.replicas) > 1:
        lines.insert(2, f"# {len(d.replicas)} servers on ports {PORT}-{PORT + len(d.replicas) - 1}: give each to the "
                        "gateway (smg --worker-urls)")
    for i, r in enumerate(d.replicas):
        cmd = [a.replace(f"/config/{d.config_file}", f"$(dirname \"$0\")/{d.config_file}") for a in r.command]
        if len(d.replicas) > 1:  # one host: each server its own port (in compose each has its own container)
            cmd = with_port(cmd, PORT + i)
        env = f"CUDA_VISIBLE_DEVICES={','.join(map(str, r.gpu_ids))} "
        lines.append(env + " ".join(a if a.startswith("$(") else shlex.quote(a) for a in cmd)
                     + (" &" if len(d.replicas) > 1 else ""))
    if len(d.replicas) > 1:
        lines.append("wait")
    return {
        d.config_file: f"# {d.engine} config for {d.model} on {d.gpus} (written by `lineside deploy datacenter`)\n"
                       + yaml.safe_dump(d.config, sort_keys=False),
        "launch.sh": "\n".join(lines) + "\n",
        "docker-compose.yaml": f"# {d.model} on {d.gpus}: {d.engine} + SMG gateway (MODEL_DIR holds {d.hf_id})\n"
                               + yaml.safe_dump(compose(d), sort_keys=False),
        "plan.json": json.dumps({"engine": d.engine, "model": d.model, "hf_id": d.hf_id, "gpus": d.gpus,
                                 "image": d.image, "plan": d.plan.to_dict(), "notes": d.notes}, indent=2) + "\n",
    }


def with_port(command: list[str], port: int) -> list[str]:
    """The command listening on ``port``: its --port replaced, or added (vLLM and SGLang take a command-line
    option over the same one in --config)."""
    if "--port" in command:
        i = command.index("--port")
        return [*command[:i + 1], str(port), *command[i + 2:]]
    return [*command, "--port", str(port)]


def write_deployment(d: Deployment, out: Path, *, force: bool = False) -> list[Path]:
    """Write the files into ``out``; one that is there already with other content (edited by hand, or another
    deployment's) is kept, and the whole write refused, unless ``force``."""
    files = deployment_files(d)
    if not force:
        changed = [name for name, text in files.items()
                   if (out / name).exists() and _read(out / name) != text]
        if changed:
            raise LinesideError(f"--output {out}: {', '.join(changed)} differ{'s' if len(changed) == 1 else ''} from "
                                "what this deployment writes (edited since, or another deployment's); choose another "
                                "--output, or pass --force to replace them")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        if name == "launch.sh":
            path.chmod(0o755)
        written.append(path)
    return written


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
