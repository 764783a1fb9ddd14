"""Representations of the GGUF Q4_1 offsets on MatMulNBits, measured side by side on the demo model.

Q4_1 stores ``w = d*u + m`` per block of 32 (u in 0..15, d and m float16). MatMulNBits computes
``s*(u - z)`` with an integer zero point z (onnxruntime's x86 int8 kernel folds ``-s*z`` into a float32
per-block sum it reads anyway, so z itself costs nothing per token), so the fractional part of ``-m/d`` has to
travel some other way. Variants (``zp+digits`` is what lineside builds at accuracy level 4, ``fp32-offset`` what it
builds below; the others are emitted here, by patching the builder's Q4_1 emitter, to measure them):

- ``zp+digits`` (lineside, lineside/build/quant/q4_1.py): ``zp+digitsD`` with the fewest D (2..4) that lands every
  block's m within half an ulp of the GGUF's float16 value (3 for every layer of the demo model).
- ``fp32-offset`` (lineside below accuracy level 4; emitted here at level 4): default zero point 8, plus
  ``blocksum(x) @ (8d + m)`` in float32 (exact).
- ``zp+fp32``: the nearest integer zero point (uint8, 4 bits) plus the residual ``r = m + z*d`` in float32.
- ``zp+fp16``: the same residual in float16, where it is exact (it is a multiple of the smaller ulp of d and m,
  and ``|r| <= d/2``); onnxruntime has no float16 MatMul on x86 and casts the constant to float32 every call.
- ``zp+int8``: the residual as an 8-bit MatMulNBits over the block sums (scale per 16 blocks).
- ``zp+digitsD`` (D = 2, 3, 4): the residual folded into the same MatMulNBits by extending K: x' = Concat(x, S, S, ..)
  with S the block sums of x (padded to whole blocks of 32), one region per digit; region i of a row holds 4-bit
  signed digits of what regions 0..i-1 left of r, with its own scale per 32 blocks (greedy, ``max|e|/7``). One
  MatMulNBits per linear, no MatMul/Add; a block-sum MatMul + Concat per activation.
- ``zp-only``: the nearest integer zero point, no residual (the offsets rounded to the grid: not the GGUF's).
- ``VARIANT/head4``: the same with a 4-bit LM head (RTN, blocks of 32) re-quantized from the GGUF's Q8_0 head.

For each: weight bytes, graph nodes, how far the offsets land from the GGUF's (in half-ulps of its float16 m;
``fp32-offset``'s are read back from the built graph), perplexity (benchmarks/quality_smollm2.py's text) and
in-process decode, interleaved rounds. Kernel time per op of the same bundles (``--work DIR`` keeps them):
``benchmarks/cpu_per_token.py --bundle DIR/fp32-offset --bundle DIR/zp_fp16 ... --ops --threads 1``.

  python benchmarks/q4_1_carry.py [--threads 2] [--rounds 5] [--variants fp32-offset,zp+int8,...] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lineside.build.graph.linear as linear  # noqa: E402
from benchmarks.cpu_side_by_side import copy_bandwidth, load_lineside, short_ids, weight_bytes  # noqa: E402
from benchmarks.quality_smollm2 import eval_text, lineside_logits_fn, perplexity, smollm2_gguf  # noqa: E402
from lineside.build.graph.builder import MS_DOMAIN  # noqa: E402
from lineside.build.pipeline import BuildOptions, build_bundle  # noqa: E402
from lineside.build.quant import q4_1  # noqa: E402
from lineside.build.quant.ggml import BLOCK, decode_blocks  # noqa: E402
from lineside.build.quant.pack import pack_matmulnbits  # noqa: E402
from lineside.build.tensors import GGMLBlocks  # noqa: E402
from lineside.bundle import open_bundle  # noqa: E402
from lineside.runtime.tokenizer import Tokenizer  # noqa: E402

RESIDUAL_BLOCK = 16
OFFSET_ERRORS: dict[str, list[np.ndarray]] = {}
EMITTED: list[tuple[str, object]] = []


def _zero_points(dec) -> tuple[np.ndarray, np.ndarray]:
    """(z uint8 [N, K/32] nearest to -m/d, residual m + z*d float32)."""
    z, r = q4_1.zero_points(dec.d, dec.m)
    return z, r.astype(np.float32)


_pack_zp = q4_1.pack_zero_points


def _int8_rows(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """r [N, B] -> (uint8 codes [N, B'] (+128), scales [N, B'/16], dequantized [N, B]) in blocks of 16."""
    n, b = r.shape
    nb = -(-b // RESIDUAL_BLOCK)
    rp = np.zeros((n, nb * RESIDUAL_BLOCK), np.float32)
    rp[:, :b] = r
    blocks = rp.reshape(n, nb, RESIDUAL_BLOCK)
    s = np.abs(blocks).max(-1) / 127
    s[s == 0] = 1
    q = np.clip(np.rint(blocks / s[..., None]), -127, 127)
    return (q + 128).astype(np.uint8).reshape(n, -1), s.astype(np.float32), (q * s[..., None]).reshape(n, -1)[:, :b]


def _half_ulps(dec, m_carried: np.ndarray) -> np.ndarray:
    return q4_1.half_ulps(dec.m, m_carried).ravel()


def _emitter(variant: str) -> Callable:
    original = linear._emit_ggml_cpu

    def emit(gb, x, name, weight, spec, bias, share):
        if weight.ggml_type != "Q4_1":
            return original(gb, x, name, weight, spec, bias, share)
        dec = decode_blocks(weight, name)
        if variant == "zp+digits":  # what build emits (at accuracy level 4)
            OFFSET_ERRORS[variant].append(_half_ulps(dec, q4_1.carry_q4_1(dec).m))
            return original(gb, x, name, weight, spec, bias, share)
        n, k = dec.codes.shape
        if variant == "fp32-offset":  # what build emits below level 4; its offsets are read back from the graph
            EMITTED.append((name, dec))
            y = linear._matmulnbits4(gb, x, name, dec.codes, dec.d, BLOCK, spec.accuracy_level, bias)
            corr = np.ascontiguousarray((np.float32(8) * dec.d + dec.m).T)
            c = gb.op("MatMul", [linear.blocksum(gb, x, k, BLOCK), gb.weight(f"{name}.block_offset", corr)],
                      name=f"{name}/q4_1_offset")
            return gb.op("Add", [y, c], name=f"{name}/q4_1_add")
        if variant.startswith("zp+digits"):
            nd = int(variant.removeprefix("zp+digits"))
            z, r = q4_1.zero_points(dec.d, dec.m)
            dcodes, dscales, rc = q4_1.residual_digits(r, nd)
            OFFSET_ERRORS[variant].append(_half_ulps(dec, rc - z * dec.d.astype(np.float64)))
            kx = k + dcodes.shape[1]
            zx = np.concatenate([z, np.full((n, dscales.shape[1]), 8, np.uint8)], axis=1)
            inputs = [linear.with_block_sums(gb, x, k, nd),
                      gb.weight(f"{name}.qweight", pack_matmulnbits(np.concatenate([dec.codes, dcodes], axis=1), 4, BLOCK)),
                      gb.weight(f"{name}.scales", np.ascontiguousarray(np.concatenate([dec.d, dscales], axis=1),
                                                                         dtype=np.float32)),
                      gb.weight(f"{name}.zero_points", _pack_zp(zx))]
            if bias is not None:
                inputs += ["", gb.weight(f"{name}.bias", bias)]
            return gb.op("MatMulNBits", inputs, domain=MS_DOMAIN, name=f"{name}/MatMulNBits", K=kx, N=n, bits=4,
                         block_size=BLOCK, accuracy_level=spec.accuracy_level)
        inputs = [x, gb.weight(f"{name}.qweight", pack_matmulnbits(dec.codes, 4, BLOCK)),
                  gb.weight(f"{name}.scales", np.ascontiguousarray(dec.d, dtype=np.float32))]
        z, r = _zero_points(dec)
        inputs.append(gb.weight(f"{name}.zero_points", _pack_zp(z)))
        if bias is not None:
            inputs += ["", gb.weight(f"{name}.bias", bias)]
        y = gb.op("MatMulNBits", inputs, domain=MS_DOMAIN, name=f"{name}/MatMulNBits", K=k, N=n, bits=4,
                  block_size=BLOCK, accuracy_level=spec.accuracy_level)
        if variant == "zp-only":
            OFFSET_ERRORS[variant].append(_half_ulps(dec, -z.astype(np.float32) * dec.d))
            return y
        sums = linear.blocksum(gb, x, k, BLOCK)
        if variant == "zp+fp32":
            OFFSET_ERRORS[variant].append(_half_ulps(dec, -z.astype(np.float32) * dec.d + r))
            c = gb.op("MatMul", [sums, gb.weight(f"{name}.block_residual", np.ascontiguousarray(r.T))],
                      name=f"{name}/q4_1_residual")
        elif variant == "zp+fp16":
            # r = m + z*d is a multiple of the smaller ulp of d, m below 2^11 of them: exact in float16. The graph
            # says Cast(sums) -> float16 MatMul -> Cast; onnxruntime's CPU provider (no float16 MatMul) runs it in
            # float32, its two activation casts removed and a Cast of the float16 constant added to every call.
            r16 = r.astype(np.float16)
            OFFSET_ERRORS[variant].append(_half_ulps(dec, -z.astype(np.float32) * dec.d + r16.astype(np.float32)))
            c16 = gb.op("MatMul", [linear.cast_fp16(gb, sums), gb.weight(f"{name}.block_residual", np.ascontiguousarray(r16.T))],
                        name=f"{name}/q4_1_residual")
            c = gb.op("Cast", [c16], to=onnx.TensorProto.FLOAT, name=f"{name}/q4_1_residual_fp32")
        else:  # zp+int8
            codes, scales, rq = _int8_rows(r)
            OFFSET_ERRORS[variant].append(_half_ulps(dec, -z.astype(np.float32) * dec.d + rq))
            c = gb.op("MatMulNBits", [sums, gb.weight(f"{name}.residual_q", pack_matmulnbits(codes, 8, RESIDUAL_BLOCK)),
                                      gb.weight(f"{name}.residual_scales", scales)], domain=MS_DOMAIN,
                      name=f"{name}/q4_1_residual", K=k // BLOCK, N=n, bits=8, block_size=RESIDUAL_BLOCK,
                      accuracy_level=spec.accuracy_level)
        return gb.op("Add", [y, c], name=f"{name}/q4_1_add")

    return emit


def _emitted_errors(bundle: Path) -> list[np.ndarray]:
    """Half-ulps of m for the offsets lineside's own build wrote (its float32 8d + m, read back, less 8d)."""
    from onnx import numpy_helper

    graphs = bundle / "graphs" / "cpu"
    inits = {t.name: t for t in onnx.load(str(graphs / "model.onnx"), load_external_data=False).graph.initializer}

    def array(name: str) -> np.ndarray:  # inline or from the external data beside the graph
        return numpy_helper.to_array(inits[name], base_dir=str(graphs)).astype(np.float64)

    out = [_half_ulps(dec, array(f"{name}.block_offset").T - 8 * array(f"{name}.scales")) for name, dec in EMITTED]
    EMITTED.clear()
    return out


def _nodes(bundle: Path) -> int:
    return len(onnx.load(str(bundle / "graphs" / "cpu" / "model.onnx"), load_external_data=False).graph.node)


@contextmanager
def head4():
    """``--lm-head-bits 4`` for the GGUF's Q8_0 head: build carries a GGUF head as it is (8 bits) whatever that
    option says, so here the head is re-quantized from the GGUF's values (RTN 4-bit, the build's group size);
    the tied embedding keeps its Q8_0 table (gathered rows only)."""
    original = linear.emit_lm_head

    def emit(gb, x, weight, spec, flavor, name="lm_head", bias=None, keep_8bit=True):
        if not keep_8bit and isinstance(weight, GGMLBlocks):
            weight = weight.dequantize()
        return original(gb, x, weight, spec, flavor, name=name, bias=bias, keep_8bit=keep_8bit)

    linear.emit_lm_head = emit
    try:
        yield
    finally:
        linear.emit_lm_head = original


@contextmanager
def patched(variant: str):
    original = linear._emit_ggml_cpu
    OFFSET_ERRORS[variant] = []
    linear._emit_ggml_cpu = _emitter(variant)
    try:
        yield OFFSET_ERRORS[variant]
    finally:
        linear._emit_ggml_cpu = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="fp32-offset,zp+digits,zp+digits2,zp-only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=None, help="keep the bundles here (default: a temp dir)")
    args = ap.parse_args()
    gguf = smollm2_gguf()
    work = args.work or Path(tempfile.mkdtemp(prefix="q41-carry-"))
    bundles: dict[str, Path] = {}
    offset_errors: dict[str, list[np.ndarray]] = {}
    for v in args.variants.split(","):
        carry, _, head = v.partition("/")
        with patched(carry) as errors, head4() if head == "head4" else nullcontext():
            bundles[v] = build_bundle(gguf, work / v.replace("+", "_").replace("/", "-"),
                                      BuildOptions(quant="w4a16", flavors=("cpu",), max_seq_len=2048, group_size=32,
                                                   lm_head_bits=4 if head == "head4" else 8))
        offset_errors[v] = errors if carry != "fp32-offset" else _emitted_errors(bundles[v])
    tok = Tokenizer.from_bundle(open_bundle(bundles[next(iter(bundles))]))
    ids = tok.encode(eval_text(), add_special=False)[: args.ppl_tokens]
    ppl = {v: perplexity(lineside_logits_fn(open_bundle(b)), ids, 512) for v, b in bundles.items()}
    tj = bundles[next(iter(bundles))] / "tokenizer" / "tokenizer.json"
    short = short_ids(tj)
    runners = {v: load_lineside(b, args.threads, short, [], args.decode_tokens) for v, b in bundles.items()}
    for _, decode_once, _ in runners.values():
        decode_once()
    dec: dict[str, list[float]] = {v: [] for v in runners}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for v, (_, decode_once, _) in runners.items():
            dec[v].append(decode_once())
            time.sleep(0.1)
    bw = copy_bandwidth(args.threads)
    print(f"threads {args.threads}; {args.rounds} interleaved rounds; load {load0:.1f} -> {os.getloadavg()[0]:.1f}; "
          f"numpy copy {bw / 1e9:.1f} GB/s; perplexity on {len(ids)} tokens")
    print(f"{'variant':<18} {'weights MB':>10} {'nodes':>5} {'offset err (half-ulps of m) p50/p99/max':>40} "
          f"{'>1':>7} {'ppl':>7} {'decode tok/s':>12} {'of floor':>8}")
    for v, b in bundles.items():
        wb = weight_bytes([b / "graphs" / "cpu"])
        e = np.concatenate(offset_errors[v]) if offset_errors[v] else np.zeros(1)
        d = statistics.median(dec[v])
        print(f"{v:<18} {wb / 1e6:>10.1f} {_nodes(b):>5} {np.median(e):>18.2f} / {np.quantile(e, .99):.2f} / "
              f"{e.max():<10.2f} {np.mean(e > 1):>7.2%} {ppl.get(v, float('nan')):>7.3f} {d:>12.1f} "
              f"{d / (bw / wb):>8.0%}")
    print("decode tok/s per round: " + "; ".join(f"{v} " + " ".join(f"{t:.1f}" for t in dec[v]) for v in dec))


if __name__ == "__main__":
    main()
