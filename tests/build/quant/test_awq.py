"""AWQ: the searched scale beats RTN on activations with outlier channels, and emit_linear applies it."""

from __future__ import annotations

import numpy as np
import pytest

from lineside.build.graph.linear import emit_linear
from lineside.build.quant.awq import awq_search
from lineside.build.quant.rtn import fake_quantize
from lineside.build.quant.spec import QuantSpec
from lineside.errors import LinesideError
from tests.build.quant.conftest import build_one, run_graph

N, K = 128, 256


def outlier_activations(rng, n: int) -> np.ndarray:
    x = rng.standard_normal((n, K)).astype(np.float32)
    x[:, [3, 50, 77, 130, 200, 201, 250]] *= 40.0  # a few channels carry most of the activation energy
    return x


def output_err(x, w, w_eff) -> float:
    return float(np.linalg.norm(x @ (w - w_eff).T) / np.linalg.norm(x @ w.T))


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 128), (8, 128)])
def test_awq_beats_rtn(rng, bits, group):
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.02
    x = outlier_activations(rng, 256)
    s, err_rtn, err_awq = awq_search(w, x, group, bits)
    assert s.shape == (K,) and s.dtype == np.float32 and np.all(s > 0)
    assert err_awq <= err_rtn
    if bits == 4:
        assert err_awq < 0.9 * err_rtn
    # the reported errors are what the quantized layers really do, on the calibration set
    assert err_rtn == pytest.approx(output_err(x, w, fake_quantize(w, bits, group)), rel=1e-3)
    assert err_awq == pytest.approx(output_err(x, w, fake_quantize(w * s, bits, group) / s), rel=1e-3)
    # and the gain holds on held-out activations of the same distribution
    xt = outlier_activations(rng, 64)
    assert output_err(xt, w, fake_quantize(w * s, bits, group) / s) < output_err(xt, w, fake_quantize(w, bits, group))


def test_uniform_activations_never_worse_than_rtn(rng):
    """With flat activations only the weight-side (duo) scaling can help; a scale is kept only if it does."""
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = np.ones((8, K), np.float32)
    s, err_rtn, err_awq = awq_search(w, x, 64, 4)
    assert err_awq <= err_rtn
    assert np.allclose(s, 1.0) or err_awq < err_rtn


@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_emit_with_awq_scale(tmp_path, rng, flavor):
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.02
    s, _, err_awq = awq_search(w, outlier_activations(rng, 128), 64, 4)
    spec = QuantSpec("w4a16", 64, method="awq", accuracy_level=0)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", w, spec, flavor, awq_scale=s), K, ["b", "t", N])
    x = outlier_activations(rng, 6).reshape(2, 3, K)
    y = run_graph(path, {"x": x})
    sdt = np.float16 if flavor == "trt" else np.float32
    ref = x @ (fake_quantize(w * s, 4, 64, sdt) / s).T
    assert np.abs(y - ref).max() / np.abs(ref).max() < (3e-3 if flavor == "trt" else 1e-5)


def test_awq_bad_calibration_is_one_line(rng):
    w = rng.standard_normal((N, K)).astype(np.float32)
    for x in (np.zeros((0, K), np.float32), np.zeros((4, K + 1), np.float32)):
        with pytest.raises(LinesideError) as e:
            awq_search(w, x, 64, 4)
        assert "\n" not in str(e.value)


def test_calibration_ids_spread_over_a_long_text():
    from lineside.build.quant.calibrate import SEQ_LEN, calibration_ids

    text = " ".join(str(i) for i in range(SEQ_LEN * 10))  # one token per word: 10 sequences
    ids = calibration_ids(lambda t: [int(w) for w in t.split()], text, max_seqs=4)
    assert ids.shape == (4, SEQ_LEN) and ids[:, 0].tolist() == [0, 3 * SEQ_LEN, 6 * SEQ_LEN, 9 * SEQ_LEN]
    short = calibration_ids(lambda t: [int(w) for w in t.split()], "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17")
    assert short.shape == (1, 17)
    with pytest.raises(LinesideError):
        calibration_ids(lambda t: [int(w) for w in t.split()], "1 2 3")
    # not strict (the prefill graph's statistics on the shipped text): what the text gives, or nothing
    assert calibration_ids(lambda t: [int(w) for w in t.split()], "1 2 3 1", strict=False).tolist() == [[1, 2, 3, 1]]
    assert calibration_ids(lambda t: [], "anything", strict=False).shape == (0, 0)


def test_awq_guard_holds_out_every_third_sequence():
    """AWQ is judged on sequences its scale search never saw (on SmolLM2 the in-sample loss kept an AWQ
    that was worse elsewhere); a text of one or two sequences falls back to judging in-sample."""
    from lineside.build.quant.calibrate import split_held_out

    ids = np.arange(6)[:, None] * np.ones((1, 4), dtype=np.int64)
    fit, held = split_held_out(ids)
    assert fit[:, 0].tolist() == [0, 1, 3, 4] and held[:, 0].tolist() == [2, 5]
    two = ids[:2]
    fit, held = split_held_out(two)
    assert fit is two and held is two


def test_degenerate_or_binary_calibration_is_refused(tmp_path):
    """A text that is one token repeated, or a binary file read as text (replacement characters), gives AWQ/GPTQ
    statistics of nothing like real input, and their guards judge on the same text: refused in one line."""
    from lineside.build.quant.calibrate import calibration_ids, read_calibration_text

    with pytest.raises(LinesideError, match="distinct") as e:
        calibration_ids(lambda t: [int(w) for w in t.split()], "7 " * 600)
    assert "\n" not in str(e.value)
    blob = tmp_path / "model.bin"
    blob.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    with pytest.raises(LinesideError, match="text") as e:
        read_calibration_text(blob)
    assert "\n" not in str(e.value)
    latin1 = tmp_path / "fr.txt"  # a few undecodable bytes in real text are read, as before
    latin1.write_bytes("Le café est prêt à côté du thé. ".encode("latin-1") * 50)
    assert read_calibration_text(latin1).startswith("Le caf\ufffd")
