"""Decode speed per KV-cache dtype on onnxruntime CPU, at a 2k and a short context, both flavors.

1. SmolLM2-135M W4A16 (group 64), one bundle per ``--kv-dtype`` the builder accepts, each with every flavor that
   can store it (the cpu flavor's float32 cache, the trt flavor's fp16 / int8 / int4 ...: asked of
   build/quant/kv.py, so a dtype the builder learns shows up here by itself); decode ``--tokens`` tokens after a
   ``--past``-token and a ``--short``-token prompt through OnnxRuntimeBackend (for the trt flavor: its CPU
   check). Rows are labelled with the arena's own dtype and bytes per token (what /metrics reports). The
   prompt is prefilled once into a spare slot and copied back (copy_slot) each round; rounds interleave the
   variants, same threads. The last lines compare each trt dtype with trt fp16 at both contexts.
2. onnxruntime's own GroupQueryAttention (the cpu flavor's attention) with a float32 cache against its
   int8 cache (``k_quant_type``/``v_quant_type`` PER_CHANNEL, ``kv_cache_bit_width`` 8, static scales):
   SmolLM2-135M's shape (9 heads, 3 KV heads, head_dim 64), one token after ``--past`` tokens, times 30 layers.

3. ``--short-side-by-side``: only the trt flavor, one bundle per KV dtype, decode at ``--short`` tokens of
   context, CPU time per step (``time.process_time``: less sensitive to other load than wall time) of the whole
   ``forward`` and of ``session.run`` alone, for each thread count in ``--threads-list`` and accuracy level in
   ``--levels`` (0: the trt flavor's CPU check, exact; 4: wrong logits on this graph, timing only, but its weights
   are not dequantized every step, so the cache's share shows), rounds interleaved, best of ``--rounds``;
   each dtype's figure is the median over ``--sessions`` sessions (two of one bundle can differ by ~10%);
   ``--profile`` adds onnxruntime's per-op-type time of the step (its profiler, median per node over the steps,
   minus ``--profile-overhead`` us per node: what a no-op Reshape costs under the profiler).

    python benchmarks/kv_dtype_cpu.py [--past 2048] [--short 128] [--tokens 32] [--rounds 3] [--threads 2]
                                      [--bundles DIR] [--no-model] [--no-gqa]
    python benchmarks/kv_dtype_cpu.py --short-side-by-side [--short 128] [--tokens 16] [--rounds 7] [--sessions 3]
                                      [--threads-list 1,2] [--levels 4,0] [--profile] [--bundles DIR]
                                      [--extra LABEL=BUNDLE ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def gqa_session(quantized: bool, max_seq: int, threads: int) -> ort.InferenceSession:
    kv_t = TensorProto.INT8 if quantized else TensorProto.FLOAT
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, 1, width]),
              helper.make_tensor_value_info("pk", kv_t, [1, KV_HEADS, max_seq, HEAD_DIM]),
              helper.make_tensor_value_info("pv", kv_t, [1, KV_HEADS, max_seq, HEAD_DIM]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    names = ["qkv", "", "", "pk", "pv", "seqlens_k", "total"]
    attrs: dict = dict(num_heads=HEADS, kv_num_heads=KV_HEADS)
    inits = []
    if quantized:
        scale = np.full((KV_HEADS, 1, HEAD_DIM), 0.02, np.float32)
        inits = [onnx.numpy_helper.from_array(scale, "k_scale"), onnx.numpy_helper.from_array(scale, "v_scale")]
        names += ["", "", "", "", "", "k_scale", "v_scale"]
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    node = helper.make_node("GroupQueryAttention", names, ["out", "pk_out", "pv_out"], domain="com.microsoft",
                            **attrs)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("pk_out", kv_t, None), helper.make_tensor_value_info("pv_out", kv_t, None)]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def gqa_step_seconds(sess: ort.InferenceSession, quantized: bool, past: int, max_seq: int, steps: int) -> float:
    """Seconds per decode step of one layer, the cache bound once (IO binding: no copy of the cache per step)."""
    rng = np.random.default_rng(0)
    dt = np.int8 if quantized else np.float32
    cache = {n: (rng.integers(-100, 100, (1, KV_HEADS, max_seq, HEAD_DIM)) if quantized else
                 rng.standard_normal((1, KV_HEADS, max_seq, HEAD_DIM))).astype(dt) for n in ("pk", "pv")}
    io = sess.io_binding()
    io.bind_cpu_input("qkv", rng.standard_normal((1, 1, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32))
    io.bind_cpu_input("seqlens_k", np.array([past], np.int32))
    io.bind_cpu_input("total", np.array(past + 1, np.int32))
    for n in ("pk", "pv"):
        v = ort.OrtValue.ortvalue_from_numpy(cache[n])
        io.bind_ortvalue_input(n, v)
        io.bind_ortvalue_output(n + "_out", v)  # in place, as the cpu flavor shares past and present
    io.bind_output("out")
    sess.run_with_iobinding(io)
    t0 = time.perf_counter()
    for _ in range(steps):
        sess.run_with_iobinding(io)
    return (time.perf_counter() - t0) / steps


def model_decode_tok_s(backend, prompt: list[int], tokens: int) -> float:
    """Decode ``tokens`` greedy tokens after ``prompt``, whose KV slot 1 holds (copied into slot 0 first)."""
    from lineside.runtime.backend import StepBatch

    backend.copy_slot(1, 0, len(prompt) - 1)
    lg = backend.forward(StepBatch.single(0, prompt[-1:], len(prompt) - 1))
    tok, t0 = int(np.argmax(lg[0, -1])), time.perf_counter()
    for i in range(tokens):
        lg = backend.forward(StepBatch.single(0, [tok], len(prompt) + i))
        tok = int(np.argmax(lg[0, -1]))
    return tokens / (time.perf_counter() - t0)


def buildable(flavors: tuple[str, ...] = ("cpu", "trt")) -> dict[str, tuple[str, ...]]:
    """--kv-dtype -> the flavors the builder stores it in (the dtypes no flavor takes are printed and left out)."""
    from lineside.build.quant.kv import KvDtype, check_kv_flavors
    from lineside.errors import LinesideError

    out = {}
    for kv in KvDtype:
        ok, refused = [], {}
        for f in flavors:
            try:
                check_kv_flavors(kv, (f,))
                ok.append(f)
            except LinesideError as e:
                refused.setdefault(str(e), []).append(f)
        for why, fs in refused.items():
            print(f"  not built: --kv-dtype {kv} for the {'/'.join(fs)} flavor ({why})")
        if ok:
            out[kv.value] = tuple(ok)
    return out


def run_models(a: argparse.Namespace, max_seq: int) -> None:
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import MANIFEST, open_bundle
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quality_smollm2 import smollm2_gguf

    with tempfile.TemporaryDirectory() as td:
        root = Path(a.bundles or td)
        backends: dict[str, OnnxRuntimeBackend] = {}
        for kv, flavors in buildable().items():
            out = root / f"smollm2-w4a16-kv{kv}-{max_seq}"
            if not (out / MANIFEST).is_file():
                build_bundle(smollm2_gguf(), out, BuildOptions(quant="w4a16", requantize=True, group_size=64,
                                                               flavors=flavors, max_seq_len=max_seq, kv_dtype=kv))
            b = open_bundle(out)
            for f in flavors:
                be = OnnxRuntimeBackend(b, num_slots=2, flavor=f, threads=a.threads)
                arena = be.kv_arena_bytes()
                backends[f"{f} {arena.dtype} ({arena.bytes_per_token / 1024:.1f} KiB/token)"] = be
        rng = np.random.default_rng(1)
        prompts = {n: [int(t) for t in rng.integers(100, 40000, n)] for n in (a.past, a.short)}
        from lineside.runtime.backend import StepBatch

        speed: dict[tuple[str, int], list[float]] = {}
        for n, prompt in prompts.items():
            for be in backends.values():  # each variant's prompt KV, prefilled once into slot 1
                be.reset_slot(1)
                be.forward(StepBatch.single(1, prompt[:-1], 0))
            for _ in range(a.rounds):
                for name, be in backends.items():
                    speed.setdefault((name, n), []).append(model_decode_tok_s(be, prompt, a.tokens))
        print(f"SmolLM2-135M W4A16 g64 on onnxruntime CPU, {a.tokens} decode tokens, {a.threads} threads "
              f"(best of {a.rounds}, rounds interleaved):")
        for name in backends:
            cells = "   ".join(f"ctx {n:5d}: {max(speed[name, n]):7.1f} tok/s" for n in prompts)
            print(f"  {name:34s} {cells}")
        base = next((k for k in backends if k.startswith("trt fp16")), None)
        for name in backends:
            if base is None or not name.startswith("trt ") or name == base:
                continue
            ratios = ", ".join(f"ctx {n}: {max(speed[name, n]) / max(speed[base, n]):.3f}x" for n in prompts)
            print(f"  {name.split(' (')[0]} vs trt fp16: {ratios}")


def trt_bundles(root: Path, max_seq: int) -> dict[str, Path]:
    """--kv-dtype -> a SmolLM2 W4A16 g64 bundle with only the trt flavor (built once under ``root``)."""
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import MANIFEST

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quality_smollm2 import smollm2_gguf

    out = {}
    for kv, flavors in buildable().items():
        if "trt" not in flavors:
            continue
        path = root / f"smollm2-w4a16-trt-kv{kv}-{max_seq}"
        if not (path / MANIFEST).is_file():
            build_bundle(smollm2_gguf(), path, BuildOptions(quant="w4a16", requantize=True, group_size=64,
                                                           flavors=("trt",), max_seq_len=max_seq, kv_dtype=kv))
        out[kv] = path
    return out


class _RunClock:
    """CPU seconds spent inside ``session.run_with_iobinding`` (wraps the backend's session method)."""

    def __init__(self, backend) -> None:
        self.seconds, real = 0.0, backend.session.run_with_iobinding

        def timed(io, *args):
            t0 = time.process_time()
            try:
                return real(io, *args)
            finally:
                self.seconds += time.process_time() - t0

        backend.session.run_with_iobinding = timed


def short_side_by_side(a: argparse.Namespace) -> None:
    """trt flavor fp16 / int8 / int4 KV at a short context: CPU ms per decode step, side by side."""
    from lineside.bundle import open_bundle
    from lineside.runtime.backend import StepBatch
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    max_seq = a.short + a.tokens + 8
    with tempfile.TemporaryDirectory() as td:
        bundles = trt_bundles(Path(a.bundles or td), max_seq)
        for extra in a.extra:  # another build of a dtype (an older graph): timed in the same interleaved rounds
            label, _, path = extra.partition("=")
            bundles[label] = Path(path)
        rng = np.random.default_rng(1)
        prompt = [int(t) for t in rng.integers(100, 40000, a.short)]
        for threads in (int(t) for t in a.threads_list.split(",")):
            for level in (int(v) for v in a.levels.split(",")):
                # --sessions per dtype: two sessions of the same bundle can differ by ~10% (memory placement), so
                # each dtype's figure is the median over its sessions of each session's best round
                backends, clocks = {}, {}
                for kv, path in bundles.items():
                    for n in range(a.sessions):
                        be = OnnxRuntimeBackend(open_bundle(path), num_slots=2, flavor="trt", threads=threads,
                                                accuracy_level=level, spin=False)
                        be.forward(StepBatch.single(1, prompt[:-1], 0))  # the prompt's KV, in the spare slot
                        backends[kv, n], clocks[kv, n] = be, _RunClock(be)
                fw: dict[tuple[str, int], list[float]] = {key: [] for key in backends}
                run: dict[tuple[str, int], list[float]] = {key: [] for key in backends}
                wall: dict[tuple[str, int], list[float]] = {key: [] for key in backends}
                for r in range(a.rounds):
                    for key in (list(backends) if r % 2 == 0 else list(backends)[::-1]):
                        be, clock = backends[key], clocks[key]
                        be.copy_slot(1, 0, a.short - 1)
                        be.forward(StepBatch.single(0, prompt[-1:], a.short - 1))
                        clock.seconds, c0, w0 = 0.0, time.process_time(), time.perf_counter()
                        for i in range(a.tokens):
                            be.forward(StepBatch.single(0, [5 + i], a.short + i))
                        fw[key].append((time.process_time() - c0) / a.tokens * 1e3)
                        wall[key].append((time.perf_counter() - w0) / a.tokens * 1e3)
                        run[key].append(clock.seconds / a.tokens * 1e3)

                def per_kv(series: dict[tuple[str, int], list[float]], pick=min) -> dict[str, float]:
                    return {kv: float(np.median([pick(series[kv, n]) for n in range(a.sessions)])) for kv in bundles}

                best_fw, med_fw, best_run, best_wall = per_kv(fw), per_kv(fw, np.median), per_kv(run), per_kv(wall)
                print(f"trt flavor, SmolLM2 W4A16 g64, context {a.short}, {a.tokens} decode tokens, {threads} thread(s), "
                      f"accuracy level {level}, best of {a.rounds} interleaved rounds, median over {a.sessions} "
                      f"session(s) per dtype (load {os.getloadavg()[0]:.2f}):")
                print(f"  {'KV':8s} {'CPU ms/step':>12s} {'session.run':>12s} {'outside':>8s} {'wall ms':>8s} "
                      f"{'CPU vs fp16':>12s} {'(medians)':>10s}")
                for kv in bundles:
                    best = best_fw[kv] / best_fw["fp16"] if "fp16" in bundles else float("nan")
                    med = med_fw[kv] / med_fw["fp16"] if "fp16" in bundles else float("nan")
                    print(f"  {kv:8s} {best_fw[kv]:12.2f} {best_run[kv]:12.2f} {best_fw[kv] - best_run[kv]:8.2f} "
                          f"{best_wall[kv]:8.2f} {best:11.3f}x {med:9.3f}x")
        if a.profile:
            profile_table(bundles, prompt, a)


def profile_table(bundles: dict[str, Path], prompt: list[int], a: argparse.Namespace) -> None:
    """onnxruntime's per-op-type time of a decode step, each KV dtype side by side (1 thread, level 4)."""
    import collections
    import json

    import lineside.runtime.onnxruntime_backend as ob
    from lineside.bundle import open_bundle
    from lineside.runtime.backend import StepBatch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_per_token import step_kernels

    real_open = ob.open_session
    stats: dict[str, tuple[dict[str, float], dict[str, int]]] = {}
    with tempfile.TemporaryDirectory() as td:
        backends = {}
        for kv, path in bundles.items():
            def profiled(ort_, graph, sha, make_options, settings, providers, kv=kv):
                def options():
                    so = make_options()
                    so.enable_profiling, so.profile_file_prefix = True, f"{td}/{kv}"
                    return so
                return real_open(ort_, graph, None, options, settings, providers)  # no cache: a fresh session

            ob.open_session = profiled
            try:
                be = ob.OnnxRuntimeBackend(open_bundle(path), num_slots=1, flavor="trt", threads=1, accuracy_level=4,
                                           spin=False)
            finally:
                ob.open_session = real_open
            be.forward(StepBatch.single(0, prompt, 0))
            backends[kv] = be
        for i in range(4 + a.tokens):  # steps interleaved: a change of load hits every dtype alike
            for be in backends.values():
                be.forward(StepBatch.single(0, [5 + i], len(prompt) + i))
        for kv, be in backends.items():
            per_node: dict[str, list[float]] = collections.defaultdict(list)
            op_of: dict[str, str] = {}
            for e in step_kernels(json.loads(Path(be.session.end_profiling()).read_text()), a.tokens)[1]:
                per_node[e["name"]].append(e["dur"])
                op_of[e["name"]] = e["args"].get("op_name", "?")
            us: dict[str, float] = collections.Counter()
            count: dict[str, int] = collections.Counter()
            for name, durs in per_node.items():
                us[op_of[name]] += float(np.median(durs)) - a.profile_overhead
                count[op_of[name]] += 1
            stats[kv] = (us, count)
    kvs = list(stats)
    ops = sorted(set().union(*(u for u, _ in stats.values())), key=lambda o: -max(stats[k][0].get(o, 0) for k in kvs))
    print(f"onnxruntime per-op time of a decode step at context {len(prompt)}, 1 thread, level 4, us per step "
          f"(median per node over {a.tokens} interleaved steps, minus {a.profile_overhead} us per node) / nodes "
          f"(load {os.getloadavg()[0]:.2f}):")
    print(f"  {'op':16s}" + "".join(f"{kv:>16s}" for kv in kvs) + "".join(f"{kv + ' - fp16':>14s}" for kv in kvs[1:]))
    for op in ops + ["TOTAL"]:
        cells = {kv: (sum(stats[kv][0].values()), sum(stats[kv][1].values())) if op == "TOTAL"
                 else (stats[kv][0].get(op, 0.0), stats[kv][1].get(op, 0)) for kv in kvs}
        print(f"  {op:16s}" + "".join(f"{cells[kv][0]:9.0f} /{cells[kv][1]:5d}" for kv in kvs)
              + "".join(f"{cells[kv][0] - cells[kvs[0]][0]:+14.0f}" for kv in kvs[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--past", type=int, default=2048, help="the long context (prompt tokens)")
    ap.add_argument("--short", type=int, default=128, help="the short context (prompt tokens)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bundles", help="keep (and reuse) the SmolLM2 bundles here instead of a temp dir")
    ap.add_argument("--no-model", action="store_true", help="only the GroupQueryAttention measurement")
    ap.add_argument("--no-gqa", action="store_true", help="only the model measurement")
    ap.add_argument("--short-side-by-side", action="store_true",
                    help="only the trt flavor's fp16/int8/int4 caches at --short tokens of context (see 3. above)")
    ap.add_argument("--threads-list", default="1,2", help="--short-side-by-side: thread counts")
    ap.add_argument("--levels", default="4,0", help="--short-side-by-side: MatMulNBits accuracy levels")
    ap.add_argument("--sessions", type=int, default=3, help="--short-side-by-side: sessions per KV dtype")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=BUNDLE",
                    help="--short-side-by-side: also this trt bundle (e.g. int4-old=DIR, built by an older checkout), "
                         "in the same rounds")
    ap.add_argument("--profile", action="store_true", help="--short-side-by-side: also the per-op-type table")
    ap.add_argument("--profile-overhead", type=float, default=3.0, help="us per node the profiler adds")
    a = ap.parse_args()
    if a.short_side_by_side:
        short_side_by_side(a)
        return
    max_seq = max(a.past, a.short) + a.tokens + 8
    if not a.no_model:
        run_models(a, max_seq)
    if a.no_gqa:
        return
    sessions = {q: gqa_session(q, max_seq, a.threads) for q in (False, True)}
    gqa: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(a.rounds):
        for q in (False, True):
            gqa[q].append(gqa_step_seconds(sessions[q], q, a.past, max_seq, 200))
    print(f"onnxruntime {ort.__version__} GroupQueryAttention, SmolLM2 shape, past {a.past}, {a.threads} threads "
          f"(best of {a.rounds}):")
    for q, label in ((False, "float32 KV"), (True, "int8 KV (PER_CHANNEL)")):
        best = min(gqa[q])
        kv_mb = 2 * LAYERS * KV_HEADS * HEAD_DIM * (1 if q else 4) * a.past / 2**20
        print(f"  {label:24s} {best * 1e6:8.1f} us/layer  x{LAYERS} = {best * LAYERS * 1e3:6.2f} ms/token "
              f"attention   cache {kv_mb:6.1f} MiB")


if __name__ == "__main__":
    main()
