"""The rows kernel (runtime/rows_kernel.py, kernels/rows.c): onnxruntime's own 4-bit MatMulNBits is the reference
(same int8 rounding of activations, so within float rounding of it), each row independent of the others, only the
nodes it computes as onnxruntime does moved to it, and a clear line where it cannot be built."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from lineside.bundle import open_bundle
from lineside.errors import LinesideError
from lineside.runtime import rows_kernel
from lineside.runtime.backend import StepBatch
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from tests.runtime.test_decode_graph_int8 import decode_step, prompts_then_one_batched_step


@pytest.fixture(scope="module")
def library():
    path = rows_kernel.library()
    if path is None:
        why = rows_kernel.host_ok() or "not built (scripts/setup.sh builds it: python -m lineside.runtime.rows_kernel)"
        pytest.skip(f"rows kernel unavailable: {why}")
    return path


def matmul_graph(domain: str, k: int, n: int, block: int, *, zero_points: bool, bias: bool, bits: int = 4,
                 seed: int = 0, **attrs) -> bytes:
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    zp_bytes = (blocks + 1) // 2 if bits == 4 else blocks
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8), "B"),
             numpy_helper.from_array((rng.random(n * blocks, dtype=np.float32) * 0.02 + 1e-3), "S")]
    inputs = ["x", "B", "S"]
    if zero_points:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, n * zp_bytes, dtype=np.uint8), "Z"))
        inputs.append("Z")
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias"))
        inputs += [""] * (5 - len(inputs)) + ["bias"]
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain=domain, K=k, N=n, bits=bits, block_size=block,
                            **{"accuracy_level": 4, **attrs})
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
              helper.make_opsetid(rows_kernel.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def session(model: bytes, library=None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


SHAPES = [  # (K, N, block, zero points, bias, bits): the demo model's fused shapes and 8-bit LM head, a ragged K, a
    # ragged N, wider blocks
    (640, 960, 32, True, False, 4), (1664, 576, 32, True, False, 4), (100, 40, 32, True, True, 4),
    (576, 577, 64, False, True, 4), (1000, 100, 128, True, False, 4), (512, 48, 256, False, False, 4),
    (576, 1000, 32, False, False, 8), (100, 33, 64, True, True, 8), (256, 64, 128, True, False, 8)]


@pytest.fixture(params=["avx512", "avxvnni", "avx2"])
def kernel_isa(request, library, monkeypatch):
    """Each path the library has, where this CPU can run it: AVX-512 VNNI, AVX-VNNI and AVX2 (the narrower ones
    forced by LINESIDE_ROWS_ISA on a CPU with more)."""
    if request.param != "avx512":
        monkeypatch.setenv(rows_kernel.ISA_ENV, request.param)
    got = rows_kernel.isa(library)
    if got != request.param:
        pytest.skip(f"this CPU runs the rows kernel's {got} path, not {request.param}")
    return got


@pytest.mark.parametrize("k,n,block,zero_points,bias,bits", SHAPES)
def test_matches_onnxruntime_and_rows_are_independent(library, kernel_isa, k, n, block, zero_points, bias, bits):
    if bits not in rows_kernel.bits_for(kernel_isa):
        with pytest.raises(Exception, match="only 4-bit weights on AVX2"):  # never moved there: rewrite's bits
            session(matmul_graph(rows_kernel.DOMAIN, k, n, block, zero_points=zero_points, bias=bias, bits=bits),
                    library).run(None, {"x": np.zeros((1, 1, k), np.float32)})
        return
    ours = session(matmul_graph(rows_kernel.DOMAIN, k, n, block, zero_points=zero_points, bias=bias, bits=bits),
                   library)
    ref = session(matmul_graph("com.microsoft", k, n, block, zero_points=zero_points, bias=bias, bits=bits))
    rng = np.random.default_rng(1)
    for rows in (1, 3, 8, 11, 40):
        x = (rng.standard_normal((rows, 1, k)) * rng.choice([0.01, 1.0, 30.0], (rows, 1, 1))).astype(np.float32)
        x[0, 0, : min(k, 37)] = 0.0  # an all-zero block: step 0, not a division by zero
        y = ours.run(None, {"x": x})[0]
        want = ref.run(None, {"x": x})[0]
        assert y.shape == want.shape == (rows, 1, n)
        scale = np.abs(want).max(axis=-1, keepdims=True)
        assert float(np.abs(y - want).max() / scale.max()) < 1e-5
        alone = np.concatenate([ours.run(None, {"x": x[i:i + 1]})[0] for i in range(rows)])
        np.testing.assert_array_equal(alone, y)  # bit for bit: a stream's tokens never depend on its batch


@pytest.mark.parametrize("narrower", ["avxvnni", "avx2"])
@pytest.mark.parametrize("k,n,block,zero_points,bias,bits", SHAPES)
def test_every_path_agrees_with_avx512_bit_for_bit(library, monkeypatch, narrower, k, n, block, zero_points, bias,
                                                   bits):
    """The same float operations per column on every path: a bundle gives the same tokens on any of these CPUs."""
    if rows_kernel.isa(library) != "avx512":
        pytest.skip("this CPU has no AVX-512 VNNI path to compare with")
    model = matmul_graph(rows_kernel.DOMAIN, k, n, block, zero_points=zero_points, bias=bias, bits=bits)
    wide = session(model, library)
    monkeypatch.setenv(rows_kernel.ISA_ENV, narrower)
    if rows_kernel.isa(library) != narrower:
        pytest.skip(f"this CPU has no {narrower} path")
    if bits not in rows_kernel.bits_for(narrower):
        return  # never moved there (test_matches_onnxruntime_and_rows_are_independent checks the refusal)
    narrow = session(model, library)
    x = np.random.default_rng(2).standard_normal((11, 1, k)).astype(np.float32)
    np.testing.assert_array_equal(narrow.run(None, {"x": x})[0], wide.run(None, {"x": x})[0])


def test_inputs_of_other_sizes_are_an_error_not_a_read_past_their_end(library):
    """The kernel reads as many bytes as K, N and the block say: a B, scales, zero points or bias of another size
    (a graph made by hand, a truncated initializer) is refused in one line at the run."""
    rng = np.random.default_rng(0)

    def graph(b_shape, s_count, zp_count=None, bias_count=None, **attrs):
        inits = [numpy_helper.from_array(rng.integers(0, 256, b_shape, dtype=np.uint8), "B"),
                 numpy_helper.from_array(np.ones(s_count, np.float32), "S")]
        inputs = ["x", "B", "S"]
        if zp_count is not None:
            inits.append(numpy_helper.from_array(np.zeros(zp_count, np.uint8), "Z"))
            inputs.append("Z")
        if bias_count is not None:
            inits.append(numpy_helper.from_array(np.zeros(bias_count, np.float32), "bias"))
            inputs += [""] * (5 - len(inputs)) + ["bias"]
        node = helper.make_node("MatMulNBits", inputs, ["y"], domain=rows_kernel.DOMAIN,
                                **{"K": 64, "N": 32, "block_size": 32, "accuracy_level": 4, **attrs})
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(rows_kernel.DOMAIN, 1)]).SerializeToString()

    x = {"x": np.ones((1, 64), np.float32)}
    assert session(graph((32, 2, 16), 64), library).run(None, x)[0].shape == (1, 32)  # no bits attribute: 4
    for bad, name in [(graph((32, 1, 16), 64), "B"), (graph((32, 2, 16), 63), "scales"),
                      (graph((32, 2, 16), 64, zp_count=31), "zero_points"),
                      (graph((32, 2, 16), 64, bias_count=33), "bias"), (graph((0, 2, 16), 0), "B")]:
        with pytest.raises(Exception, match=f"lineside rows: {name} holds"):
            session(bad, library).run(None, x)


def test_a_graph_the_kernel_cannot_take_runs_on_onnxruntimes_kernel(library, tiny_bundles, monkeypatch, caplog):
    """Whatever makes a rewritten graph fail to load (a node the rules let through by mistake, an onnxruntime the
    library cannot register with), the bundle still opens, on onnxruntime's kernel, and says so."""
    bundle = open_bundle(tiny_bundles(variant="llama-gqa", quant="w4a16", group_size=32, max_seq_len=64))
    monkeypatch.setenv("LINESIDE_ORT_CACHE", "0")
    monkeypatch.setattr(rows_kernel, "rewritten", lambda graph, bits: b"not a model")
    with caplog.at_level("WARNING", logger="lineside.runtime"):
        be = OnnxRuntimeBackend(bundle, num_slots=2)
    assert any("the rows kernel could not run graphs/cpu/model.onnx" in r.getMessage() for r in caplog.records)
    be.reset_slot(0)
    assert np.isfinite(be.forward(StepBatch.single(0, [1, 2, 3], 0))).all()


def test_empty_batch_and_other_ranks(library):
    ours = session(matmul_graph(rows_kernel.DOMAIN, 64, 32, 32, zero_points=True, bias=False), library)
    assert ours.run(None, {"x": np.zeros((0, 1, 64), np.float32)})[0].shape == (0, 1, 32)
    y = ours.run(None, {"x": np.ones((2, 3, 64), np.float32)})[0]
    assert y.shape == (2, 3, 32) and np.isfinite(y).all()


def test_unknown_dimensions_stay_unknown_downstream(library):
    """A V4 graph reshapes a linear's output by its own Shape: an unnamed unknown dimension given out as -1 made
    that Reshape's target hold two -1s, and onnxruntime refused the graph."""
    k, n = 64, 32
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, 2, 16), dtype=np.uint8), "B"),
             numpy_helper.from_array(np.full(n * 2, 0.01, np.float32), "S"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([2], np.int64), "two"),
             numpy_helper.from_array(np.array([-1, 8], np.int64), "tail")]
    nodes = [helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain=rows_kernel.DOMAIN, K=k, N=n, bits=4,
                              block_size=32, accuracy_level=4),
             helper.make_node("Shape", ["y"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "two"], ["lead"]),
             helper.make_node("Concat", ["lead", "tail"], ["target"], axis=0),
             helper.make_node("Reshape", ["y", "target"], ["z"])]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    x_info.type.tensor_type.shape.dim.add()  # unknown, unnamed
    x_info.type.tensor_type.shape.dim.add()
    x_info.type.tensor_type.shape.dim.add().dim_value = k
    graph = helper.make_graph(nodes, "g", [x_info], [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(rows_kernel.DOMAIN, 1)])
    z = session(model.SerializeToString(), library).run(None, {"x": np.ones((2, 3, k), np.float32)})[0]
    assert z.shape == (2, 3, 4, 8)


def model_of(nodes, inits, k=64):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info(nd.output[0], TensorProto.FLOAT, None) for nd in nodes],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def test_rewrite_moves_only_what_it_computes_as_onnxruntime_does(tmp_path):
    import onnx

    b = numpy_helper.from_array(np.zeros((8, 2, 16), np.uint8), "B")
    s = numpy_helper.from_array(np.ones(16, np.float32), "S")
    z = numpy_helper.from_array(np.zeros(8, np.uint8), "Z")
    zf = numpy_helper.from_array(np.zeros(16, np.float32), "ZF")

    def mm(out, inputs, **attrs):
        return helper.make_node("MatMulNBits", inputs, [out], domain="com.microsoft",
                                **{"K": 64, "N": 8, "bits": 4, "block_size": 32, "accuracy_level": 4, **attrs})

    s16 = numpy_helper.from_array(np.ones(16, np.float16), "S16")
    short = numpy_helper.from_array(np.zeros((8, 1, 16), np.uint8), "Bshort")
    empty = numpy_helper.from_array(np.zeros((0, 2, 16), np.uint8), "B0")
    s0 = numpy_helper.from_array(np.ones(0, np.float32), "S0")
    over = numpy_helper.from_array(np.zeros((8, 2, 16), np.uint8), "Bover")
    nodes = [mm("moved", ["x", "B", "S", "Z"]), mm("moved_no_zp", ["x", "B", "S"]),
             mm("level0", ["x", "B", "S"], accuracy_level=0), mm("bits2", ["x", "B", "S"], bits=2),
             mm("block16", ["x", "B", "S"], block_size=16), mm("float_zp", ["x", "B", "S", "ZF"]),
             mm("g_idx", ["x", "B", "S", "", "x"]), mm("weights_in", ["x", "x", "S"]),
             mm("fp16", ["x", "B", "S16"]),  # fp16 activations and scales: the kernel is float32 only
             mm("short_b", ["x", "Bshort", "S"]),  # B smaller than K, N and the block say
             mm("omitted", ["x", "B0", "S0"], N=0),  # the schema's omitted projection (N = 0)
             mm("overridable", ["x", "Bover", "S"])]  # also a graph input: a run may replace it
    path = tmp_path / "m.onnx"
    model_in = model_of(nodes, [b, s, z, zf, s16, short, empty, s0, over])
    model_in.graph.input.append(helper.make_tensor_value_info("Bover", TensorProto.UINT8, [8, 2, 16]))
    onnx.save(model_in, str(path))
    raw, moved = rows_kernel.rewrite(path)
    model = onnx.load_from_string(raw)
    assert moved == 2
    assert {nd.output[0] for nd in model.graph.node if nd.domain == rows_kernel.DOMAIN} == {"moved", "moved_no_zp"}
    assert any(o.domain == rows_kernel.DOMAIN for o in model.opset_import)
    assert rows_kernel.rewritten(path) == raw
    onnx.save(model_of([nodes[2]], [b, s]), str(path))
    assert rows_kernel.rewritten(path) is None  # nothing to move: the graph is opened as it is


def run_prompts(be):
    batched, last, pasts = prompts_then_one_batched_step(be)
    alone = [decode_step(be, [slot], [last[slot]], [pasts[slot]])[0] for slot in range(4)]
    return batched, np.stack(alone)


def test_the_backend_runs_4bit_steps_on_it_with_the_same_logits(library, kernel_isa, tiny_bundles, monkeypatch):
    bundle = open_bundle(tiny_bundles(variant="llama-gqa", quant="w4a16", group_size=32, max_seq_len=64))
    opened = []
    real = rows_kernel.rewrite
    monkeypatch.setattr(rows_kernel, "rewrite", lambda g, bits: opened.append((g.name, bits)) or real(g, bits))
    monkeypatch.setenv("LINESIDE_ORT_CACHE", "0")
    monkeypatch.setenv(rows_kernel.ENV, "1")
    fast = OnnxRuntimeBackend(bundle, num_slots=4)
    # the 8-bit LM head too on AVX-512 and AVX-VNNI; on AVX2 it stays onnxruntime's (its products would saturate)
    assert ("model.onnx", (4, 8) if kernel_isa in ("avx512", "avxvnni") else (4,)) in opened
    monkeypatch.setenv(rows_kernel.ENV, "0")
    plain = OnnxRuntimeBackend(bundle, num_slots=4)
    batched, alone = run_prompts(fast)
    np.testing.assert_array_equal(batched, alone)  # rows independent through the whole model
    ref_batched, _ = run_prompts(plain)
    # Each node is within float rounding of onnxruntime's (test above), but a 1e-7 difference upstream can move an
    # activation across an int8 rounding boundary downstream: one step of 1/127 of its block's largest value, so
    # logits agree to the int8 rounding's own scale, not to float rounding.
    assert float(np.abs(batched - ref_batched).max() / np.abs(ref_batched).max()) < 3e-2


def test_the_graph_cache_keeps_each_kernel_choice_apart(library, tiny_bundles, tmp_path, monkeypatch):
    import shutil

    src = tiny_bundles(variant="llama-gqa", quant="w4a16", group_size=32, max_seq_len=64)
    copy = tmp_path / "b"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.ort-opt.onnx"))
    bundle = open_bundle(copy)
    sources, caches = [], []
    for env in ("1", "1", "0", "0", "1"):
        monkeypatch.setenv(rows_kernel.ENV, env)
        sources.append(OnnxRuntimeBackend(bundle, num_slots=2).session_source)
        caches.append([p.name for p in (copy / "graphs" / "cpu").glob("model.onnx.*.ort-opt.onnx")])
    # a cache made with the kernel is never loaded without it (nor the reverse): each choice optimizes its own once,
    # and both are kept, so switching back (an A/B run) loads the first one again
    assert sources == ["saved", "cache", "saved", "cache", "cache"]
    assert len(caches[0]) == 1 and len(caches[2]) == 2 and caches[4] == caches[2]


def fake_deb(header: bytes) -> bytes:
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:xz") as tar:
        info = tarfile.TarInfo(rows_kernel.HEADER_MEMBER)
        info.size = len(header)
        tar.addfile(info, io.BytesIO(header))
    out = b"!<arch>\n"
    for name, body in ((b"debian-binary", b"2.0\n"), (b"control.tar.xz", b"x"), (b"data.tar.xz", tar_bytes.getvalue())):
        out += name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) + b"0".ljust(6) + b"100644".ljust(8) + \
            str(len(body)).encode().ljust(10) + b"`\n" + body + (b"\n" if len(body) % 2 else b"")
    return out


def test_the_header_comes_out_of_the_debian_package_and_a_wrong_one_is_refused(tmp_path, monkeypatch):
    deb = fake_deb(b"/* header */\n")
    assert rows_kernel._member(rows_kernel._deb_data(deb), rows_kernel.HEADER_MEMBER) == b"/* header */\n"
    with pytest.raises(LinesideError, match="not a .deb"):
        rows_kernel._deb_data(b"PK\x03\x04")

    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(rows_kernel.urllib.request, "urlopen", lambda url, timeout: Response(deb))
    with pytest.raises(LinesideError, match="sha256 mismatch") as e:
        rows_kernel._header(tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)  # one line, saying where a header may go
    assert not (tmp_path / "onnxruntime_c_api.h").exists()
    monkeypatch.setattr(rows_kernel, "HEADER_SHA256", __import__("hashlib").sha256(deb).hexdigest())
    assert rows_kernel._header(tmp_path).read_bytes() == b"/* header */\n"


def test_build_and_main_say_why_not_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(rows_kernel, "host_ok", lambda: "this CPU lacks avx2, fma")
    assert rows_kernel.main() == 0  # onnxruntime's kernel serves: nothing for the user to do
    assert capsys.readouterr().out.strip() == "rows kernel: not built, this CPU lacks avx2, fma (onnxruntime's " \
                                              "4-bit kernel serves)"
    with pytest.raises(LinesideError, match="not for this host"):
        rows_kernel.build()
    monkeypatch.setattr(rows_kernel, "host_ok", lambda: None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(rows_kernel.shutil, "which", lambda name: None)
    monkeypatch.setattr(rows_kernel, "_candidates", lambda: [tmp_path / "k" / "librows-x.so"])
    assert rows_kernel.main() == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("rows kernel: not built: no C compiler") and "\n" not in err


def test_turned_off_or_unsupported_means_onnxruntime_kernel(monkeypatch):
    monkeypatch.setenv(rows_kernel.ENV, "0")
    assert rows_kernel.library() is None
    monkeypatch.setenv(rows_kernel.ENV, "1")
    monkeypatch.setattr(rows_kernel.platform, "machine", lambda: "aarch64")
    rows_kernel._library_cached.cache_clear()
    try:
        assert rows_kernel.host_ok() == "it is written for x86-64 (AVX-512 VNNI or AVX2), not aarch64"
        assert rows_kernel.library() is None
    finally:
        rows_kernel._library_cached.cache_clear()


def test_an_avx2_cpu_runs_the_avx2_path(library):
    """qemu-user runs Python and onnxruntime as on a Haswell (AVX2 + FMA, no AVX-512): the library takes its AVX2
    path there by itself (cpuid, not /proc/cpuinfo, which is the host's under qemu) and matches onnxruntime."""
    import os
    import platform
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if platform.machine() != "x86_64" or shutil.which("qemu-x86_64") is None:
        pytest.skip("needs an x86_64 host and qemu-user (scripts/test.sh installs it)")
    root = Path(__file__).resolve().parents[2]
    code = f"""
import numpy as np
from pathlib import Path
from lineside.runtime import rows_kernel
from tests.runtime.test_rows_kernel import matmul_graph, session
lib = Path({str(library)!r})
print(rows_kernel.isa(lib))
ours = session(matmul_graph(rows_kernel.DOMAIN, 100, 40, 32, zero_points=True, bias=True), lib)
ref = session(matmul_graph("com.microsoft", 100, 40, 32, zero_points=True, bias=True))
x = np.random.default_rng(1).standard_normal((5, 1, 100)).astype(np.float32)
y, want = ours.run(None, {{"x": x}})[0], ref.run(None, {{"x": x}})[0]
alone = np.concatenate([ours.run(None, {{"x": x[i:i + 1]}})[0] for i in range(5)])
print(float(np.abs(y - want).max() / np.abs(want).max()) < 1e-5, bool((alone == y).all()))
"""
    run = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["avx2", "True", "True"]
