"""Tiny trt bundles for the TensorRT tests that the build pipeline cannot make yet."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.errors import CheckpointError


def v4_bundle(tmp_path: Path, quant: str = "fp16") -> Path:
    """A tiny V4 trt bundle: through the build pipeline, or (until V4 is wired there) from the V4 emitter."""
    from tests.build.deepseek_v4.helpers import MAX_SEQ, make_model, save_model

    ck = save_model(make_model("a"), tmp_path / "v4ck")
    out = tmp_path / "v4b"
    try:
        build_bundle(ck, out, BuildOptions(quant=quant, flavors=("trt",), max_seq_len=MAX_SEQ, group_size=64,
                                           accuracy_level=0))
    except CheckpointError:
        from lineside.build.checkpoint import open_checkpoint
        from lineside.build.models import deepseek_v4 as v4
        from lineside.build.quant.spec import QuantSpec
        from lineside.bundle import Manifest, write_manifest
        from lineside.config import ModelConfig

        reader = open_checkpoint(ck)
        cfg = ModelConfig.from_hf_dict(reader.hf_config)
        out.mkdir(exist_ok=True)
        entry = v4.emit_graph(cfg, reader, QuantSpec(scheme=quant, group_size=64), "trt",
                              out / "graphs/trt/model.onnx", MAX_SEQ)
        (out / "config.json").write_text(cfg.to_json())
        write_manifest(out, Manifest(architecture="deepseek_v4", config="config.json", max_seq_len=MAX_SEQ,
                                     flavors={"trt": replace(entry, graph="graphs/trt/model.onnx")}))
    return out


def fake_engine_bundle(trt_bundle, monkeypatch, tmp_path: Path, *, num_slots: int) -> tuple:
    """A copy of the tiny fp16 trt bundle with its engine built over the strict fake (installed here): (the opened
    bundle, the fake's device), as the TensorRT backend tests start from."""
    import shutil

    from lineside.build.tensorrt.builder import BuildOptions as EngineOptions
    from lineside.build.tensorrt.builder import build_engine
    from lineside.bundle import open_bundle
    from tests.runtime.tensorrt import fake_trt

    dst = tmp_path / "bundle"
    shutil.copytree(trt_bundle("fp16").path, dst)
    dev = fake_trt.install(monkeypatch)
    build_engine(dst, EngineOptions(num_slots=num_slots, max_prefill=16, first_bucket=8, bucket_step=16))
    return open_bundle(dst), dev
