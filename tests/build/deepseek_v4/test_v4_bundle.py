"""End to end: `lineside build` → bundle → the runtime's onnxruntime backend (`lineside logits`) and `generate`.

Skips while the build pipeline does not yet dispatch DeepSeek-V4 checkpoints (the names on disk are
official-style, so the generic HF-name presence check reports every tensor missing).
"""

from __future__ import annotations

import numpy as np
import pytest

from lineside.errors import CheckpointError
from tests.build.deepseek_v4.helpers import rel_err
from tests.cli.cli_run import run_cli


@pytest.fixture(scope="module")
def bundles(v4, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle

    out = tmp_path_factory.mktemp("v4b")
    made = {}
    for name, src, quant in (("fp32", v4.hf_dir("b"), "fp32"), ("w4a16", v4.official_dir("a", "ue8m0", True), "w4a16")):
        try:
            made[name] = build_bundle(src, out / name, BuildOptions(quant=quant, group_size=64, flavors=("cpu", "trt"),
                                                                    max_seq_len=32))
        except CheckpointError as e:
            if "is missing (and" in str(e):
                pytest.skip(f"build pipeline does not dispatch DeepSeek-V4 naming yet: {e}")
            raise
    return made


@pytest.mark.parametrize("flavor", ["cpu", "trt"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_bundle_logits_match_transformers(v4, bundles, flavor, mode):
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import compute_logits
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    ids, ref, _ = v4.ref("b")
    be = OnnxRuntimeBackend(open_bundle(bundles["fp32"]), num_slots=1, flavor=flavor, threads=2,
                            accuracy_level=0 if flavor == "trt" else None)
    out = compute_logits(be, [int(i) for i in ids], mode)
    err = rel_err(out, ref)
    print(f"bundle {mode}/{flavor}: max rel err {err:.2e}")
    assert err < 1e-4


def test_w4a16_bundle_from_fp8_mxfp4_generates(bundles):
    proc = run_cli("generate", bundles["w4a16"], "--prompt", "hello", "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() != "" or proc.stderr == ""


def test_w4a16_bundle_logits_bounded(v4, bundles):
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import compute_logits
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    ids, ref, _ = v4.ref("a")
    be = OnnxRuntimeBackend(open_bundle(bundles["w4a16"]), num_slots=1, flavor="cpu", threads=2)
    out = compute_logits(be, [int(i) for i in ids], "decode")
    assert np.isfinite(out).all() and rel_err(out, ref) < 1.5
