"""What the int8 prefill graph would compute on an x86 CPU without VNNI, emulated here on any CPU.

onnxruntime's MLAS multiplies the graph's uint8 activations (+128) by its int8 weights with ``vpmaddubsw`` on AVX2
(and AVX-512 without VNNI): products of neighbouring elements (k = 2j, 2j+1) are added into int16 with saturation.
This runs a bundle's prefill graph on a prompt, reads each ``MatMulIntegerToFloat``'s quantized activations, and
compares the exact int32 product with the saturating one: how many pairs saturate and the relative error of each
linear's integer output. It is why the runtime keeps prompts on the 4-bit graph on such CPUs
(lineside/runtime/cpu_features.py).

  python benchmarks/int8_saturation.py --bundle B [--tokens 256] [--text FILE]

Numbers only: no pass/fail.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lineside.bundle import open_bundle  # noqa: E402
from lineside.runtime.cpu_features import host_int8_gemm_exact  # noqa: E402
from lineside.runtime.tokenizer import Tokenizer  # noqa: E402

INT16_MIN, INT16_MAX = -32768, 32767


def pair_sums(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``[rows, K/2, N]`` int32: a[:, 2j] * w[2j] + a[:, 2j+1] * w[2j+1], the int16 sums vpmaddubsw makes."""
    if a.shape[1] % 2:
        a, w = np.pad(a, ((0, 0), (0, 1))), np.pad(w, ((0, 1), (0, 0)))
    return a[:, 0::2, None] * w[None, 0::2, :] + a[:, 1::2, None] * w[None, 1::2, :]


def main() -> None:
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    args = ap.parse_args()
    bundle = open_bundle(args.bundle)
    entry = bundle.flavor("cpu")
    if not entry.prefill_graph:
        raise SystemExit(f"{args.bundle} has no prefill graph (built with --no-prefill-graph or an older lineside)")
    model = onnx.load(str(bundle.file(entry.prefill_graph)))
    weights = {t.name: t for t in model.graph.initializer}
    linears = [n for n in model.graph.node if n.op_type == "MatMulIntegerToFloat"]
    for n in linears:  # the quantized activations of each linear, as extra outputs
        model.graph.output.append(helper.make_tensor_value_info(n.input[0], onnx.TensorProto.UINT8, None))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = Tokenizer.from_bundle(bundle).encode(args.text.read_text(errors="replace"))[:args.tokens]
    s = len(ids)
    feeds = {"input_ids": np.array([ids], np.int64), "logits_positions": np.array([[s - 1]], np.int64),
             "seqlens_k": np.array([s - 1], np.int32), "total_sequence_length": np.array(s, np.int32)}
    for i in sess.get_inputs():
        if i.name not in feeds:  # the past cache: empty
            feeds[i.name] = np.zeros([1 if d == "batch" else s if isinstance(d, str) else d for d in i.shape],
                                     np.float32)
    outs = dict(zip((o.name for o in sess.get_outputs()), sess.run(None, feeds), strict=True))
    total = saturated = 0
    rows = []
    for n in linears:
        a = outs[n.input[0]].reshape(-1, outs[n.input[0]].shape[-1]).astype(np.int32)
        w = numpy_helper.to_array(weights[n.input[1]]).astype(np.int32)
        pairs = pair_sums(a, w)
        clipped = np.clip(pairs, INT16_MIN, INT16_MAX)
        exact = (a - 128) @ w  # what the graph means: activations centred on their zero point
        err = np.linalg.norm(clipped.sum(axis=1) - pairs.sum(axis=1)) / max(float(np.linalg.norm(exact)), 1e-9)
        hit = int((pairs != clipped).sum())
        total, saturated = total + pairs.size, saturated + hit
        rows.append((err, n.name.split("/")[0], hit))
    rows.sort(reverse=True)
    print(f"{args.bundle}: {s}-token prompt, {len(linears)} int8 linears; this CPU's int8 product is "
          f"{'exact' if host_int8_gemm_exact() else 'saturating'} (lineside/runtime/cpu_features.py)")
    print(f"pairs saturated without VNNI: {saturated} of {total} ({saturated / max(total, 1):.2e}); "
          f"linears with any: {sum(1 for r in rows if r[2])} of {len(rows)}")
    print(f"{'linear':48s} {'relative error':>14s} {'saturated pairs':>16s}")
    for err, name, hit in rows[:10]:
        print(f"{name:48s} {err:14.2e} {hit:16d}")


if __name__ == "__main__":
    main()
