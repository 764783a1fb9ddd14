"""GGUF Q4_1 at accuracy level 4: one MatMulNBits with an integer zero point and the residual's digits over the
block sums (quant/q4_1.py), checked against the GGUF's own dequantized weights (gguf.quants)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lineside.build.graph.linear import emit_linear
from lineside.build.quant import q4_1
from lineside.build.quant.ggml import BLOCK, decode_blocks
from lineside.build.quant.spec import QuantSpec
from tests.build.quant.conftest import build_one, run_graph
from tests.build.quant.test_ggml import carried_offsets, make_blocks

# (out, in): SmolLM2's q (18 blocks: 14 padded sums per region, an odd count of blocks per row), down (48 sums),
# one block, 33 blocks (a second, nearly empty, block per region), an odd number of outputs
SHAPES = [(64, 576), (16, 1536), (7, 32), (33, 1056)]


def exact_int8_input(rng, rows: int, k: int) -> np.ndarray:
    """x whose every block of 32, and every block of its block sums, has max |v| = 127 with integer values: the
    kernel's int8 rounding of activations (scale max|v|/127) is then exact, and so is its output up to float32."""
    nb = k // BLOCK
    x = np.zeros((rows, nb, BLOCK), np.float32)
    sums = rng.integers(-126, 127, (rows, nb))
    sums[:, ::BLOCK] = 127  # one sum of 127 in each block of sums
    x[..., 0], x[..., 1], x[..., 2] = 127, -127, sums
    return rng.permuted(x, axis=-1).reshape(rows, k)


def within_offset_bound(dec, m: np.ndarray) -> bool:
    """Every carried offset within q4_1.MAX_OFFSET_ERROR grid steps of the GGUF's m (and not exactly it, in general)."""
    return bool(np.all(np.abs(m - dec.m.astype(np.float64)) <= q4_1.MAX_OFFSET_ERROR * dec.d.astype(np.float64)))


def reference(x: np.ndarray, blocks, m: np.ndarray | None = None) -> np.ndarray:
    """x @ W^T in float64 for the GGUF's dequantized weight (gguf.quants), or with its offsets m replaced."""
    w = blocks.dequantize().astype(np.float64)
    if m is not None:
        n, k = w.shape
        w += np.repeat(m - decode_blocks(blocks).m, BLOCK, axis=1)
    return x.astype(np.float64) @ w.T


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("shift", [0.0, 0.03, -0.2])
def test_carried_m_rounds_to_the_ggufs(rng, n, k, shift):
    dec = decode_blocks(make_blocks(rng, "Q4_1", n=n, k=k, shift=shift))  # -0.2: every z clipped at 15
    carry = q4_1.carry_q4_1(dec)
    assert carry.k == k + carry.digits * q4_1.sum_width(k) and carry.k % BLOCK == 0
    assert carry.codes.max() <= 15 and carry.scales.shape == carry.zero_points.shape == (n, carry.k // BLOCK)
    assert within_offset_bound(dec, carry.m)


def test_digits_grow_for_clipped_blocks_and_stay_bounded(rng):
    # every weight positive: z = 0 and r = m everywhere, far beyond d/2; the most digits, each block's error
    # within half of its last region's scale
    dec = decode_blocks(make_blocks(rng, "Q4_1", n=33, k=1056, shift=0.2))
    carry = q4_1.carry_q4_1(dec)
    assert carry.digits > q4_1.MIN_DIGITS  # the fewest digits were not enough for r = m
    last = carry.scales[:, -q4_1.sum_width(1056) // BLOCK:]
    bound = np.repeat(last, BLOCK, axis=1)[:, : 1056 // BLOCK] / 2
    assert np.all(np.abs(carry.m - dec.m) <= bound * (1 + 1e-6))
    assert within_offset_bound(dec, carry.m)


def test_a_block_with_a_zero_scale_takes_zero_point_0_without_a_warning():
    """A block of equal weights (d = 0: zero-padded rows) divided 0 by 0: `lineside build` printed numpy's
    RuntimeWarnings (invalid value in divide, in cast: NaN to uint8, undefined in C). Its zero point is 0 and its
    residual its m, whatever d."""
    import warnings

    d = np.array([[0.0, 0.0, 0.5]], np.float16)
    m = np.array([[0.0, 0.25, -1.0]], np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z, r = q4_1.zero_points(d, m)
    assert z.tolist() == [[0, 0, 2]] and r.tolist() == [[0.0, 0.25, 0.0]]


@pytest.mark.parametrize("n,k", SHAPES)
def test_operands_times_block_sums_are_the_ggufs_weight(rng, n, k):
    # the numpy reference of what MatMulNBits computes: (codes - zero point) * scale over x' = [x, S, .., S]
    blocks = make_blocks(rng, "Q4_1", n=n, k=k, shift=0.03)
    carry = q4_1.carry_q4_1(decode_blocks(blocks))
    w = (carry.codes.astype(np.float64) - np.repeat(carry.zero_points, BLOCK, axis=1)) * np.repeat(
        carry.scales.astype(np.float64), BLOCK, axis=1)
    x = rng.standard_normal((5, k))
    s = np.zeros((5, q4_1.sum_width(k)))
    s[:, : k // BLOCK] = x.reshape(5, -1, BLOCK).sum(-1)
    y = np.concatenate([x] + [s] * carry.digits, axis=1) @ w.T
    np.testing.assert_allclose(y, reference(x, blocks, carry.m), rtol=0, atol=1e-9)
    ref = reference(x, blocks)  # off by at most the offsets' bound times each block's |sum|
    d = decode_blocks(blocks).d.astype(np.float64)
    assert np.all(np.abs(y - ref) <= np.abs(s[:, : k // BLOCK]) @ (q4_1.MAX_OFFSET_ERROR * d).T * (1 + 1e-9) + 1e-12)


@pytest.mark.parametrize("n,k", SHAPES)
def test_one_matmulnbits_matches_the_ggufs_weight(tmp_path, rng, n, k):
    blocks = make_blocks(rng, "Q4_1", n=n, k=k, shift=0.03)
    bias = rng.standard_normal(n).astype(np.float32)
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", blocks, QuantSpec(), "cpu", bias=bias), k,
                     ["t", n], in_shape=["t", k])
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    assert [nd.op_type for nd in nodes] == ["MatMul", "Concat", "MatMulNBits", "Identity"]
    attrs = {a.name: a.i for a in nodes[2].attribute}
    carry = q4_1.carry_q4_1(decode_blocks(blocks))
    assert attrs["K"] == carry.k and attrs["accuracy_level"] == 4 and len(nodes[2].input) == 6  # zero points, bias
    m = carried_offsets(path, "l", k)
    assert within_offset_bound(decode_blocks(blocks), m)
    x = exact_int8_input(rng, 4, k)
    ref = reference(x, blocks, m) + bias  # the graph's own offsets: what remains is float32 rounding
    y = run_graph(path, {"x": x})
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5
    # a row's output does not depend on the rows beside it
    np.testing.assert_array_equal(np.concatenate([run_graph(path, {"x": x[i : i + 1]}) for i in range(4)]), y)


def test_layers_reading_one_input_share_its_block_sums(tmp_path, rng):
    ws = [make_blocks(rng, "Q4_1", shift=0.02) for _ in range(3)]

    def emit(gb, x):
        return gb.op("Sum", [emit_linear(gb, x, f"l{i}", w, QuantSpec(), "cpu") for i, w in enumerate(ws)])

    path = build_one(tmp_path, emit, 576, ["t", 64], in_shape=["t", 576])
    ops = [nd.op_type for nd in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops.count("MatMul") == 1 and ops.count("Concat") == 1 and ops.count("MatMulNBits") == 3
    x = exact_int8_input(rng, 3, 576)
    ref = sum(reference(x, w, carried_offsets(path, f"l{i}", 576)) for i, w in enumerate(ws))
    assert np.abs(run_graph(path, {"x": x}) - ref).max() / np.abs(ref).max() < 1e-5


def q4_1_bytes(d: np.ndarray, m: np.ndarray, codes: np.ndarray):
    """GGMLBlocks of Q4_1 blocks written byte by byte (float16 d and m ``[N, K/32]``, codes 0..15 ``[N, K]``), for
    blocks gguf's quantize never makes."""
    from lineside.build.tensors import GGMLBlocks

    n, k = codes.shape
    out = np.zeros((n, k // BLOCK, 20), np.uint8)
    out[..., 0:2] = np.asarray(d, np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = np.asarray(m, np.float16)[..., None].view(np.uint8)
    c = codes.reshape(n, k // BLOCK, BLOCK).astype(np.uint8)
    out[..., 4:] = c[..., :16] | (c[..., 16:] << 4)
    return GGMLBlocks("Q4_1", (n, k), out.reshape(n, -1))


@pytest.mark.parametrize("d", [3e-7, 1e-5, 0.0])
def test_digit_regions_with_nothing_to_carry_add_nothing(tmp_path, rng, d):
    """Blocks whose m is exactly -z*d (a Q4_0 grid written as Q4_1: m = -8d; all-zero rows: d = m = 0) leave every
    digit zero. Those regions had scale 1.0, and onnxruntime's int8 kernel, which takes the zero point's share from
    each block's input sum apart from the int8 dot product, left float32 cancellation noise of about
    1e-7 * 8 * |S| * 32 per output: 70% of a layer whose d is float16-subnormal (3e-7), and a zero weight's output
    not zero. A region with nothing to carry has scale 0."""
    n, k = 8, 4864  # 152 blocks: 5 blocks of sums per region
    d16 = np.full((n, k // BLOCK), d, np.float16)
    blocks = q4_1_bytes(d16, -8 * d16, rng.integers(0, 16, (n, k)))  # -8d: exact in float16
    carry = q4_1.carry_q4_1(decode_blocks(blocks))
    assert not carry.scales[:, k // BLOCK:].any()
    path = build_one(tmp_path, lambda gb, x: emit_linear(gb, x, "l", blocks, QuantSpec(), "cpu"), k, ["t", n],
                     in_shape=["t", k])
    x = rng.standard_normal((3, k)).astype(np.float32)
    y, ref = run_graph(path, {"x": x}), reference(x, blocks)
    if d == 0:
        assert not y.any()
    else:
        assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-2  # int8 activations, as the other level-4 tests
