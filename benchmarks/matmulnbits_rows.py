"""Kernel time of SmolLM2's decode-step ops at 1..8 rows, from onnxruntime's own profile (no Python in the
figure): MatMulNBits at accuracy levels 0/1/2/4 and block sizes 32/64/128 for the model's linear shapes, the
GGUF Q4_1 carry's correction (block-sum MatMul + offset MatMul + Add) and GroupQueryAttention, each at
M = 1, 2, 4, 8 decode rows. Which kernel is cheap per row says where batch-8 decode goes.

    python benchmarks/matmulnbits_rows.py [--threads 2] [--m 1,2,4,8] [--levels 0,1,2,4] [--blocks 32,64,128]
        [--shapes 576x960,576x576,576x3072,1536x576] [--iters 400] [--rounds 3] [--attention24]

``--attention24`` also times ONNX's own Attention op with an in-place TensorScatter (opset 24) at the same rows
and past: the standard way to write GroupQueryAttention's decode step, had it been cheaper per row.

Kernel µs per call: the 10th percentile over ``--iters`` calls, the minimum over ``--rounds`` interleaved rounds
(on a shared machine the slow calls are the interrupted ones; ``--threads 1`` shows a kernel's own cost per row
without the pool's waits). Timing only: no pass/fail.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


def matmulnbits_graph(k: int, n: int, *, block: int, level: int, bits: int = 4, q4_1: bool = False) -> onnx.ModelProto:
    """x [M, K] -> MatMulNBits (random codes, float32 scales, no zero point); ``q4_1``: plus the carry's
    correction, y += (x @ ones[K, K/32]) @ C[K/32, N] as lineside's graph emits it."""
    rng = np.random.default_rng(0)
    nb = -(-k // block)
    qweight = rng.integers(0, 256, size=(n, nb, block * bits // 8), dtype=np.uint8)
    scales = (rng.random((n * nb,), dtype=np.float32) * 0.01 + 0.001).astype(np.float32)
    inits = [numpy_helper.from_array(qweight, "qw"), numpy_helper.from_array(scales, "sc")]
    nodes = [helper.make_node("MatMulNBits", ["x", "qw", "sc"], ["mm"], domain=MS, K=k, N=n, bits=bits,
                              block_size=block, accuracy_level=level, name="mnb")]
    if q4_1:
        ones = np.zeros((k, k // 32), np.float32)
        ones[np.arange(k), np.arange(k) // 32] = 1
        corr = (rng.standard_normal((k // 32, n)) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(ones, "ones"), numpy_helper.from_array(corr, "corr")]
        nodes += [helper.make_node("MatMul", ["x", "ones"], ["bs"], name="blocksum"),
                  helper.make_node("MatMul", ["bs", "corr"], ["off"], name="offset"),
                  helper.make_node("Add", ["mm", "off"], ["y"], name="add")]
    else:
        nodes.append(helper.make_node("Identity", ["mm"], ["y"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])


def gqa_graph(*, heads: int = 9, kv_heads: int = 3, head: int = 64, max_seq: int = 2048) -> onnx.ModelProto:
    """One GroupQueryAttention decode step on an in-place cache (past and present share the buffer)."""
    hidden = (heads + 2 * kv_heads) * head
    rng = np.random.default_rng(0)
    cos = rng.random((max_seq, head // 2), dtype=np.float32)
    sin = rng.random((max_seq, head // 2), dtype=np.float32)
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "seqlens_k", "total", "cos", "sin"],
                            ["y", "k_out", "v_out"], domain=MS, num_heads=heads, kv_num_heads=kv_heads,
                            do_rotary=1, scale=head ** -0.5, name="gqa")
    cache = ["b", kv_heads, max_seq, head]
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["b", 1, hidden]),
         helper.make_tensor_value_info("pk", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("pv", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
         helper.make_tensor_value_info("total", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 1, heads * head]),
         helper.make_tensor_value_info("k_out", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, cache)],
        [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])


def attention24_graph(*, heads: int = 9, kv_heads: int = 3, head: int = 64, max_seq: int = 2048) -> onnx.ModelProto:
    """The same decode step on ONNX's own ops (opset 24): TensorScatter writes the new K/V into the cache in place,
    Attention reads each row's first ``nonpad_kv_seqlen`` entries (no rotary: it would only add to its cost)."""
    cache = ["b", kv_heads, max_seq, head]
    nodes = [helper.make_node("TensorScatter", ["pk", "kn", "pos"], ["k_out"], axis=2, name="scatter_k"),
             helper.make_node("TensorScatter", ["pv", "vn", "pos"], ["v_out"], axis=2, name="scatter_v"),
             helper.make_node("Attention", ["q", "k_out", "v_out", "", "", "", "lens"], ["y"], scale=head ** -0.5,
                              name="attention")]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", heads, 1, head]),
         helper.make_tensor_value_info("kn", TensorProto.FLOAT, ["b", kv_heads, 1, head]),
         helper.make_tensor_value_info("vn", TensorProto.FLOAT, ["b", kv_heads, 1, head]),
         helper.make_tensor_value_info("pos", TensorProto.INT64, ["b"]),
         helper.make_tensor_value_info("lens", TensorProto.INT64, ["b"]),
         helper.make_tensor_value_info("pk", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("pv", TensorProto.FLOAT, cache)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", heads, 1, head]),
         helper.make_tensor_value_info("k_out", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, cache)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)])


def kernel_us(model: onnx.ModelProto, feeds: Callable[[], dict[str, np.ndarray]], threads: int, iters: int,
              tmp: Path, spin: bool = True, alias: dict[str, str] | None = None) -> dict[str, float]:
    """Kernel time per node name (10th percentile) (µs) over ``iters`` profiled runs after a warm-up; ``alias``: outputs
    bound to an input's memory (the in-place KV cache), by IOBinding."""
    path = tmp / "m.onnx"
    onnx.save(model, str(path))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the nodes as written
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp / "prof")
    f = feeds()

    def runner(sess: ort.InferenceSession) -> Callable[[], None]:
        if not alias:
            return lambda: sess.run(None, f)
        io = sess.io_binding()
        for name, arr in f.items():
            io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        for o in sess.get_outputs():
            if o.name in alias:
                arr = f[alias[o.name]]
                io.bind_output(o.name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            else:
                io.bind_output(o.name, "cpu")
        return lambda: sess.run_with_iobinding(io)

    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    run = runner(sess)
    for _ in range(30 + iters):  # the first 30 warm up; the profile's last ``iters`` calls are read
        run()
    trace = json.loads(Path(sess.end_profiling()).read_text())
    by: dict[str, list[float]] = {}
    for e in trace:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by.setdefault(e["name"][:-len("_kernel_time")], []).append(e["dur"])
    # the fastest tenth: on a shared machine the slow calls are the ones another process interrupted
    return {name: float(np.percentile(d[-iters:], 10)) for name, d in by.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--m", default="1,2,4,8")
    ap.add_argument("--levels", default="0,1,2,4")
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--shapes", default="576x960,576x576,576x3072,1536x576", help="KxN list (SmolLM2's linears)")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spin", type=int, default=1)
    ap.add_argument("--no-gqa", action="store_true")
    ap.add_argument("--attention24", action="store_true",
                    help="also time ONNX's own Attention + TensorScatter (opset 24) in GroupQueryAttention's place")
    a = ap.parse_args()
    ms = [int(v) for v in a.m.split(",")]
    tmp = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(1)
    print(f"onnxruntime {ort.__version__}, {a.threads} threads, spin {a.spin}; p10 kernel µs per call, "
          f"min of {a.rounds} rounds")
    cases: list[tuple[str, onnx.ModelProto, int, str]] = []
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for block in (int(b) for b in a.blocks.split(",")):
            for level in (int(v) for v in a.levels.split(",")):
                cases.append((f"{k}x{n} MatMulNBits b{block} acc{level}",
                              matmulnbits_graph(k, n, block=block, level=level), k, "mnb"))
        for level in (int(v) for v in a.levels.split(",")):
            model = matmulnbits_graph(k, n, block=32, level=level, q4_1=True)
            cases.append((f"{k}x{n} Q4_1 correction (acc{level} graph)", model, k, "blocksum+offset+add"))
    best: dict[tuple[str, int], float] = {}
    for _ in range(a.rounds):
        for label, model, k, node in cases:
            for m in ms:
                x = rng.standard_normal((m, k)).astype(np.float32)
                t = kernel_us(model, lambda x=x: {"x": x}, a.threads, a.iters, tmp, bool(a.spin))
                us = sum(t[nm] for nm in node.split("+"))
                best[(label, m)] = min(best.get((label, m), float("inf")), us)
    header = f"{'':46s}" + "".join(f"  M={m:<5d}" for m in ms) + f"  M={ms[-1]}/M={ms[0]}"
    print(header)
    for label, *_ in cases:
        row = [best[(label, m)] for m in ms]
        print(f"{label:46s}" + "".join(f"{v:9.1f}" for v in row) + f"{row[-1] / row[0]:9.2f}x")
    if not a.no_gqa:
        print("\nGroupQueryAttention (9 heads, 3 KV heads, 64 dims, in-place cache), past 128 tokens")
        model = gqa_graph()
        for b in ms:
            cache = np.zeros((b, 3, 2048, 64), np.float32)

            def feeds(b: int = b, cache: np.ndarray = cache) -> dict[str, np.ndarray]:
                return {"qkv": rng.standard_normal((b, 1, 960)).astype(np.float32), "pk": cache, "pv": cache.copy(),
                        "seqlens_k": np.full((b,), 128, np.int32), "total": np.array(129, np.int32)}
            us = min(kernel_us(model, feeds, a.threads, a.iters, tmp, bool(a.spin),
                               alias={"k_out": "pk", "v_out": "pv"})["gqa"] for _ in range(a.rounds))
            print(f"  batch {b}: {us:8.1f} µs  ({us / b:.1f} µs per row)")
        if a.attention24:
            print("ONNX Attention (opset 24) + TensorScatter in place, same shapes and past")
            model = attention24_graph()
            for b in ms:
                cache = np.zeros((b, 3, 2048, 64), np.float32)

                def feeds24(b: int = b, cache: np.ndarray = cache) -> dict[str, np.ndarray]:
                    return {"q": rng.standard_normal((b, 9, 1, 64)).astype(np.float32),
                            "kn": rng.standard_normal((b, 3, 1, 64)).astype(np.float32),
                            "vn": rng.standard_normal((b, 3, 1, 64)).astype(np.float32),
                            "pos": np.full((b,), 128, np.int64), "lens": np.full((b,), 129, np.int64),
                            "pk": cache, "pv": cache.copy()}
                us = min(sum(kernel_us(model, feeds24, a.threads, a.iters, tmp, bool(a.spin),
                                       alias={"k_out": "pk", "v_out": "pv"}).values()) for _ in range(a.rounds))
                print(f"  batch {b}: {us:8.1f} µs  ({us / b:.1f} µs per row)")


if __name__ == "__main__":
    main()
