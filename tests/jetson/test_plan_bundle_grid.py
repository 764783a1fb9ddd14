"""`jetson plan BUNDLE` sizes the bundle as it was built: its real quantization grid (a carried GGUF Q4_1 grid
is blocks of 32 with an fp16 scale and minimum each) and at most its max_seq_len of context."""

from __future__ import annotations

import json

import pytest

from lineside.bundle import FlavorEntry, Manifest, write_manifest
from lineside.config import ModelConfig
from lineside.jetson.planner import CONFIGS_DIR, bundle_grid, plan
from lineside.jetson.sizes import DENSE_LINEAR_NAMES, Grid, linear_bytes
from tests.cli.cli_run import run_cli

RAW = json.loads((CONFIGS_DIR / "DeepSeek-R1-Distill-Qwen-1.5B" / "config.json").read_text())
LINEARS = [(1536, 1536), (1536, 256), (1536, 256), (1536, 1536), (1536, 8960), (1536, 8960), (8960, 1536)]


def _bundle(tmp_path, quantization, max_seq_len=2048, flavors=None):
    b = tmp_path / "bundle"
    b.mkdir()
    (b / "config.json").write_text(ModelConfig.from_hf_dict(RAW, name="r1-1.5b").to_json())
    write_manifest(b, _manifest(quantization, flavors, max_seq_len))
    return b


def _manifest(quantization, flavors=None, max_seq_len=2048) -> Manifest:
    return Manifest(architecture="qwen2", config="config.json", max_seq_len=max_seq_len,
                    flavors={f: FlavorEntry(inputs=[], state=[], graph=f"graphs/{f}/model.onnx") for f in flavors or ("cpu",)},
                    quantization=quantization)


# every linear of the 28 layers carried (a linear not listed was quantized at build, in group_size's groups)
Q4_1_CARRIED = {f"model.layers.{i}.{n}.weight": "Q4_1" for i in range(28) for n in DENSE_LINEAR_NAMES}


@pytest.mark.parametrize(("quantization", "flavors", "grid"), [
    # built now: the grid is recorded
    ({"scheme": "w4a16", "group_size": 32, "grid": {"source": "GGUF Q4_1", "block_size": 32,
                                                    "per_block": "fp16 scale + fp16 minimum"}}, None, (32, 2)),
    # built before the grid was recorded (group_size said 128): read from carried_from_source
    ({"scheme": "w4a16", "group_size": 128, "carried_from_source": Q4_1_CARRIED}, None, (32, 2)),
    ({"scheme": "w4a16", "group_size": 128, "carried_from_source": {"model.layers.0.mlp.up_proj.weight": "Q4_0"}},
     None, (32, 1)),
    # TensorRT runs the trt flavor's grid, whatever the cpu flavor carried
    ({"scheme": "w4a16", "group_size": 64, "carried_from_source": Q4_1_CARRIED}, ("cpu", "trt"), (64, 1)),
    ({"scheme": "w4a16", "group_size": 64}, None, (64, 1)),
])
def test_bundle_grid(tmp_path, quantization, flavors, grid):
    g = bundle_grid(_manifest(quantization, flavors))
    assert (g.group_size, g.fp16_per_group) == grid


def test_plan_uses_the_carried_grid_and_the_bundles_context(tmp_path):
    b = _bundle(tmp_path, {"scheme": "w4a16", "group_size": 128, "carried_from_source": Q4_1_CARRIED})
    p = plan(str(b), "agx-orin-64")
    # Hand rule for Q4_1: 4 bits per weight + 2 fp16 (scale, minimum) per 32 input rows.
    per_layer = sum(k * n // 2 + (k // 32) * n * 4 for k, n in LINEARS)
    assert p.weights_breakdown["linear"] == per_layer * 28
    assert per_layer == sum(linear_bytes(k, n, "w4a16", Grid(32, 2)) for k, n in LINEARS)
    assert any("fp16 scale + fp16 minimum per 32 weights" in n for n in p.notes), p.notes
    assert not any("per 128" in n for n in p.notes)
    assert p.ctx == 2048 and p.max_context_at_batch == 2048 and p.model_max_context == 2048 and p.fits
    over = plan(str(b), "agx-orin-64", ctx=8192)
    assert not over.fits and any("max_seq_len 2048" in n and "--max-seq-len" in n for n in over.notes)
    # an explicit --group-size still wins (a what-if)
    assert plan(str(b), "agx-orin-64", group_size=128).weights_breakdown["linear"] < p.weights_breakdown["linear"]


def test_plan_cli_on_a_bundle(tmp_path):
    b = _bundle(tmp_path, {"scheme": "w4a16", "group_size": 32, "grid": {"source": "GGUF Q4_1", "block_size": 32,
                                                                         "per_block": "fp16 scale + fp16 minimum"}})
    proc = run_cli("jetson", "plan", b, "--device", "orin-nano-8")
    assert proc.returncode == 0, proc.stderr
    assert "per 32 weights" in proc.stdout and "largest context at batch 1: 2048" in proc.stdout
    assert "ctx 2048 x batch 1" in proc.stdout


def test_built_gguf_bundle_records_its_grid(smollm2_path, tmp_path):
    """The manifest of a bundle that carried SmolLM2's Q4_1 grid says blocks of 32, not --group-size's 128."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    out = build_bundle(smollm2_path, tmp_path / "b", BuildOptions(quant="w4a16", max_seq_len=64))
    q = json.loads((out / "manifest.json").read_text())["quantization"]
    assert q["group_size"] == 32 and q["grid"]["block_size"] == 32 and "minimum" in q["grid"]["per_block"]
    assert q["symmetric"] is False
    p = plan(str(out), "orin-nano-8")
    assert p.model_max_context == 64 and any("per 32 weights" in n for n in p.notes)


def test_plan_uses_the_bundles_kv_cache_dtype(tmp_path):
    """A bundle built with --kv-dtype int8 was planned with an fp16 cache unless --kv-dtype said it again (the
    header read "KV fp16"): twice its cache bytes, and a "DOES NOT FIT" where it fits."""
    b = _bundle(tmp_path, {"scheme": "w4a16", "group_size": 128, "kv_cache": {"dtype": "int8", "flavors": ["trt"]}},
                max_seq_len=16384, flavors=("trt",))
    p = plan(str(b), "orin-nano-8", ctx=16384)
    assert p.kv_dtype == "int8"
    assert p.kv_cache_bytes == plan(str(b), "orin-nano-8", ctx=16384, kv_dtype="int8").kv_cache_bytes
    assert p.kv_cache_bytes < plan(str(b), "orin-nano-8", ctx=16384, kv_dtype="fp16").kv_cache_bytes  # a what-if
    assert plan("DeepSeek-R1-Distill-Qwen-1.5B", "orin-nano-8").kv_dtype == "fp16"  # no bundle: fp16
    cli = run_cli("jetson", "plan", b, "--device", "orin-nano-8", "--json")
    assert cli.returncode == 0 and json.loads(cli.stdout)["kv_dtype"] == "int8", cli.stderr
