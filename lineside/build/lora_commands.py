"""`lineside lora add` / `lineside lora list`: LoRA adapters carried in a bundle, checksummed like its other files.

``add`` checks the adapter against the bundle's model (architecture, layer count, every A/B shape) and its
LoRA graphs (rank, adapted linears) before it copies anything, then copies ``adapter_config.json`` and
``adapter_model.safetensors`` into ``adapters/NAME/`` and rewrites the manifest with their sha256.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from lineside import cli_checks as checks
from lineside.bundle import (
    AdapterEntry,
    Manifest,
    add_to_manifest,
    default_model_names,
    manifest_lock,
    open_bundle,
)
from lineside.errors import LinesideError
from lineside.lora import CONFIG_FILE, WEIGHTS_FILE, LoraTarget, check_fits, check_name, read_adapter

lora_app = typer.Typer(help="LoRA adapters carried in a bundle (served as models of their own)",
                       no_args_is_help=True, add_completion=False)


@lora_app.command("add")
def add(
    bundle: Annotated[Path, typer.Argument(help="bundle directory (built with --max-lora-rank)")],
    adapter_dir: Annotated[Path, typer.Argument(help="PEFT adapter: adapter_config.json + adapter_model.safetensors")],
    name: Annotated[str, typer.Option(help="adapter name: the model name requests select it by")],
    force: Annotated[bool, typer.Option(help="replace an adapter of that name")] = False,
) -> None:
    """Add a LoRA adapter to a bundle (checked against the base model, checksummed into the manifest)."""
    checks.input_dir(bundle, "BUNDLE", "bundle directory")
    checks.input_dir(adapter_dir, "ADAPTER_DIR", "adapter directory")
    with manifest_lock(Path(bundle)):  # a second add at once reads the manifest this one writes
        _add(bundle, adapter_dir, name, force)


def _add(bundle: Path, adapter_dir: Path, name: str, force: bool) -> None:
    b = open_bundle(bundle)
    check_name(name)
    if b.manifest.lora is None:
        raise LinesideError(f"bundle {bundle} has no LoRA graphs; rebuild it with --max-lora-rank R (R: the largest "
                            "adapter rank to serve) before adding adapters")
    base = default_model_names(b.path, b.manifest.to_json_dict())
    if name in base:
        raise LinesideError(f"adapter name {name!r} is also a name of the base model (`serve` answers "
                            f"{', '.join(map(repr, base))} with it); choose another --name")
    if name in b.manifest.adapters and not force:
        raise LinesideError(f"bundle {bundle} already has an adapter {name!r}; choose another --name or pass --force")
    adapter = read_adapter(adapter_dir, b.config, name)
    check_fits(adapter, b.manifest.lora.max_rank, tuple(LoraTarget(t) for t in b.manifest.lora.targets),
               f"bundle {bundle}", rebuild=True)
    rel = f"adapters/{name}"
    dest = b.path / rel
    tmp = b.path / f"adapters/.{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = b.manifest
    try:
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            shutil.copyfile(Path(adapter_dir) / f, tmp / f)
        if name in manifest.adapters:
            # The manifest stops listing the adapter it replaces before its files change: an interruption or a
            # full disk from here on leaves the bundle without that adapter (`lora add` puts it back), never
            # listing a sha256 its files no longer have (which refuses the whole bundle).
            manifest = _without_adapter(b.path, manifest, name)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    r = adapter.record()
    entry = AdapterEntry(dir=rel, rank=r["rank"], lora_alpha=r["lora_alpha"], use_rslora=r["use_rslora"],
                         targets=tuple(r["targets"]), bytes=r["bytes"])
    add_to_manifest(b.path, replace(manifest, adapters={**manifest.adapters, name: entry}),
                    [f"{rel}/{f}" for f in (CONFIG_FILE, WEIGHTS_FILE)])
    size = sum((dest / f).stat().st_size for f in (CONFIG_FILE, WEIGHTS_FILE))
    print(f"{bundle}: adapter {name} added (rank {adapter.rank}, {','.join(r['targets'])}, {size / 1e6:.2f} MB)")


def _without_adapter(bundle: Path, manifest: Manifest, name: str) -> Manifest:
    """Save the manifest without adapter ``name`` and the files of its directory; returns what was saved."""
    prefix = manifest.adapters[name].dir.rstrip("/") + "/"
    kept = replace(manifest, adapters={k: v for k, v in manifest.adapters.items() if k != name},
                   files={rel: f for rel, f in manifest.files.items() if not rel.startswith(prefix)})
    return add_to_manifest(bundle, kept, [])


@lora_app.command("list")
def list_adapters(bundle: Annotated[Path, typer.Argument(help="bundle directory")]) -> None:
    """List the bundle's adapters (name, rank, alpha, adapted linears, bytes)."""
    checks.input_dir(bundle, "BUNDLE", "bundle directory")
    b = open_bundle(bundle)
    if b.manifest.lora is None:
        print(f"{bundle}: no LoRA graphs (build with --max-lora-rank R to serve adapters)")
        return
    lg = b.manifest.lora
    print(f"{bundle}: LoRA graphs adapt {','.join(lg.targets)}; slot rank {lg.max_rank}")
    if not b.manifest.adapters:
        print("no adapters (add one with `lineside lora add BUNDLE ADAPTER_DIR --name NAME`)")
    for name, e in sorted(b.manifest.adapters.items()):
        files = sum(m.size for rel, m in b.manifest.files.items() if rel.startswith(e.dir + "/"))
        print(f"{name}\trank {e.rank}\talpha {e.lora_alpha:g}{' rslora' if e.use_rslora else ''}\t"
              f"{','.join(e.targets)}\t{files / 1e6:.2f} MB")


def register(app: typer.Typer) -> None:
    app.add_typer(lora_app, name="lora")
