"""onnxruntime session settings the backend chooses: intra-op spinning is on unless LINESIDE_ORT_SPIN=0 or spin=False."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.bundle import open_bundle
from lineside.runtime.onnxruntime_backend import SPIN_ENV, OnnxRuntimeBackend


def _spin(be: OnnxRuntimeBackend) -> str:
    return be.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.parametrize("env,arg,want", [(None, None, "1"), ("0", None, "0"), ("0", True, "1"), (None, False, "0")])
def test_spinning(tiny_bundle, monkeypatch, env, arg, want):
    if env is None:
        monkeypatch.delenv(SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(SPIN_ENV, env)
    be = OnnxRuntimeBackend(open_bundle(tiny_bundle), spin=arg)
    assert _spin(be) == want and be.spinning == (want == "1")


def test_a_trt_only_w4a16_bundle_runs_exact_on_onnxruntime(tiny_bundles):
    """onnxruntime fuses the trt graph's fp16 DequantizeLinear+MatMul into MatMulNBits at its own default accuracy
    level 4 unless told otherwise (SmolLM2's trt-only bundle then answered all-zero logits); the backend runs the
    trt flavor at level 0, so its default logits are those of an explicit level 0."""
    from lineside.runtime.generate import compute_logits

    b = open_bundle(tiny_bundles(quant="w4a16", flavors=("trt",), max_seq_len=64, group_size=64))
    ids = [3, 17, 5, 42, 9, 11]
    default = OnnxRuntimeBackend(b)
    level0 = OnnxRuntimeBackend(b, accuracy_level=0)
    level4 = OnnxRuntimeBackend(b, accuracy_level=4)
    got, want, fused4 = (compute_logits(x, ids) for x in (default, level0, level4))
    assert default.accuracy_level == 0
    assert np.abs(got).max() > 0 and np.allclose(got, want, atol=1e-5, rtol=0)
    assert not np.allclose(fused4, want, atol=1e-5, rtol=0)  # what the default was: level 4 differs
