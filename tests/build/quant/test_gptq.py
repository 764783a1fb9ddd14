"""GPTQ: lower output error than RTN on correlated inputs, the RTN format, dead columns, act-order."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.build.graph.linear import concat_out_features, emit_linear
from lineside.build.quant.gptq import gptq_quantize, hessian
from lineside.build.quant.grid import Int4Grid
from lineside.build.quant.rtn import dequantize_rtn, fake_quantize, quantize_rtn
from lineside.build.quant.spec import QuantSpec
from lineside.errors import LinesideError
from tests.build.quant.conftest import build_one, run_graph

N, K = 96, 256


def correlated_inputs(rng: np.random.Generator, n: int, k: int = K) -> np.ndarray:
    """Activations with a few strong, correlated directions and uneven channel scales (like hidden states)."""
    mix = rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)
    mix[:8] *= 6.0  # a few latent directions dominate
    chan = np.exp(rng.standard_normal(k)).astype(np.float32)
    return ((rng.standard_normal((n, k)).astype(np.float32) @ mix) * chan).astype(np.float32)


def out_err(x: np.ndarray, w: np.ndarray, wq: np.ndarray) -> float:
    return float(np.linalg.norm(x @ (w - wq).T) / np.linalg.norm(x @ w.T))


@pytest.mark.parametrize("group", [64, 128])
def test_gptq_output_error_below_rtn(rng, group):
    state = np.random.default_rng(7)  # one fixed mixing matrix for calibration and held-out rows
    x_all = correlated_inputs(state, 1024)
    x, held = x_all[:768], x_all[768:]
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    codes, scales = gptq_quantize(w, hessian(x), group)
    wq = dequantize_rtn(codes, scales, group)
    w_rtn = fake_quantize(w, 4, group)
    assert out_err(x, w, wq) < 0.8 * out_err(x, w, w_rtn), (out_err(x, w, wq), out_err(x, w, w_rtn))
    assert out_err(held, w, wq) < out_err(held, w, w_rtn)  # not just fitted to the calibration rows


@pytest.mark.parametrize("k,group,sdt", [(K, 64, np.float32), (96, 64, np.float16), (200, 128, np.float32)])
def test_format_matches_rtn(rng, k, group, sdt):
    w = rng.standard_normal((N, k)).astype(np.float32)
    codes, scales = gptq_quantize(w, hessian(correlated_inputs(rng, 300, k)), group, scale_dtype=sdt)
    rc, rs = quantize_rtn(w, 4, group, sdt)
    assert codes.shape == rc.shape and codes.dtype == np.int8
    assert scales.shape == rs.shape == (N, -(-k // group)) and scales.dtype == np.dtype(sdt)
    assert codes.min() >= -8 and codes.max() <= 7 and np.all(scales > 0) and np.isfinite(scales).all()


def test_no_information_is_rtn(rng):
    """With H = 0 (every column dead) nothing propagates: GPTQ must reproduce RTN exactly."""
    w = rng.standard_normal((N, K)).astype(np.float32)
    codes, scales = gptq_quantize(w, np.zeros((K, K)), 64)
    rc, rs = quantize_rtn(w, 4, 64)
    np.testing.assert_array_equal(codes, rc)
    np.testing.assert_array_equal(scales, rs)


def test_dead_columns(rng):
    x = correlated_inputs(rng, 512)
    dead = [0, 5, 70, 255]
    x[:, dead] = 0
    w = rng.standard_normal((N, K)).astype(np.float32)
    codes, scales = gptq_quantize(w, hessian(x), 64)
    wq = dequantize_rtn(codes, scales, 64)
    assert np.isfinite(wq).all()
    # a dead column is plainly rounded on its group's scale, not zeroed (it may be live on other text)
    s = scales[:, np.asarray(dead) // 64]
    np.testing.assert_array_equal(codes[:, dead], np.clip(np.rint(w[:, dead] / s), -8, 7))
    assert out_err(x, w, wq) < out_err(x, w, fake_quantize(w, 4, 64))


def test_act_order_keeps_static_groups(rng):
    x = correlated_inputs(rng, 768)
    w = rng.standard_normal((N, K)).astype(np.float32)
    codes, scales = gptq_quantize(w, hessian(x), 64, act_order=True)
    np.testing.assert_array_equal(scales, quantize_rtn(w, 4, 64)[1])  # group j ↔ columns [64j, 64j+64)
    assert out_err(x, w, dequantize_rtn(codes, scales, 64)) < out_err(x, w, fake_quantize(w, 4, 64))


def test_bad_hessian_is_one_line(rng):
    w = rng.standard_normal((N, K)).astype(np.float32)
    for h in (np.eye(K + 1), np.full((K, K), np.nan)):
        with pytest.raises(LinesideError) as e:
            gptq_quantize(w, h, 64)
        assert "\n" not in str(e.value)
    with pytest.raises(LinesideError):
        hessian(np.zeros((0, K), np.float32))


@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_emitters_write_the_grid_as_it_is(tmp_path, rng, flavor):
    """q/k/v-style fusion keeps grids, and both flavors multiply by exactly codes * scales (odd N for trt)."""
    x_cal = correlated_inputs(rng, 256, 192)
    h = hessian(x_cal)
    sdt = np.float16 if flavor == "trt" else np.float32
    small = Int4Grid(rng.integers(-3, 4, (15, 192)).astype(np.int8), (0.01 + rng.random((15, 3))).astype(sdt), 64)
    parts = [Int4Grid(*gptq_quantize(rng.standard_normal((32, 192)).astype(np.float32), h, 64, scale_dtype=sdt), 64),
             small]  # codes within [-3, 3]: RTN of its float weight would pick another scale
    grid = concat_out_features(parts, "qkv")
    assert isinstance(grid, Int4Grid) and grid.shape == (47, 192)
    spec = QuantSpec("w4a16", 64, accuracy_level=0)
    bias = rng.standard_normal(47).astype(np.float32)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", grid, spec, flavor, bias=bias), 192,
                     ["b", "t", 47])
    x = x_cal[:6].reshape(2, 3, 192)
    y = run_graph(path, {"x": x})
    ref = x @ grid.dequantize().T + bias
    assert np.abs(y - ref).max() / np.abs(ref).max() < (2e-3 if flavor == "trt" else 1e-5)
    if flavor == "cpu":  # the grid is not re-rounded: RTN of the same float weight gives other outputs
        rtn = x @ fake_quantize(grid.dequantize(), 4, 64).T + bias
        assert np.abs(y - rtn).max() > 10 * np.abs(y - ref).max()


def test_grid_group_must_fit_the_trt_block(tmp_path, rng):
    w = rng.standard_normal((16, 192)).astype(np.float32)
    grid = Int4Grid(*quantize_rtn(w, 4, 32), 32)
    with pytest.raises(LinesideError) as e:
        build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", grid, QuantSpec("w4a16", 64), "trt"), 192,
                  ["b", "t", 16])
    assert "\n" not in str(e.value) and "groups of 32" in str(e.value)
