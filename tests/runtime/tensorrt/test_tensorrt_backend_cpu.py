"""The TensorRT builder and backend end to end on CPU, with tensorrt / cuda-python / the kernels faked
(tests/runtime/tensorrt/fake_trt.py): engine.json and profiles, addresses, re-layouts, append kernels, graph replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lineside.build.tensorrt.builder import BuildOptions, build_engine
from lineside.cli import main
from lineside.errors import BundleError, LinesideError
from lineside.runtime.backend import StepBatch
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.tensorrt.key import ENGINE_JSON, TIMING_CACHE
from tests.runtime.tensorrt import fake_trt
from tests.runtime.tensorrt.bundles import fake_engine_bundle

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150, 61, 12, 200, 33, 7, 9, 11, 13, 21, 4, 70, 71, 72, 73, 74, 75,
       76, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 100, 101,
       102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114]  # 63 tokens: crosses every bucket


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture
def engine_bundle(trt_bundle, monkeypatch, tmp_path):
    return fake_engine_bundle(trt_bundle, monkeypatch, tmp_path, num_slots=4)


def test_engine_build_writes_engine_json_and_timing_cache(engine_bundle):
    b, _ = engine_bundle
    [d] = list((b.path / "engines").iterdir())
    assert d.name == "fake-gpu-sm87-trt10.3.0-cuda12.6"
    meta = json.loads((d / ENGINE_JSON).read_text())
    assert meta["gpu_name"] == "Fake GPU" and meta["compute_capability"] == "8.7" and meta["tensorrt"] == "10.3.0"
    assert meta["cuda"] == "12.6" and [p["name"] for p in meta["profiles"]] == ["decode", "prefill"]
    assert meta["limits"]["max_batch"] == 4 and meta["limits"]["max_prefill"] == 16
    assert (d / TIMING_CACHE).read_bytes() == b"timing" and meta["fp16"]
    assert "engines/" not in json.dumps(b.manifest.to_json_dict()["files"])  # engines stay out of the checksummed files


def test_logits_equal_onnxruntime_prefill_decode_and_replay(engine_bundle):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = engine_bundle
    ref = compute_logits(OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0), IDS, "prefill")
    be = TensorRTBackend(b, num_slots=4)
    assert be.stats["captured"] == 3  # warm-up captured batch buckets 1, 2, 4 at pitch 8
    from tests.runtime.tensorrt.trt_api import unwrap

    # prefill and decode share one activation block (USER_MANAGED), not one each
    assert {unwrap(c).memory for c in be.contexts.values()} == {(int(be.context_memory), be.context_memory_bytes)}
    assert be.layout.length_buckets == [8, 16, 32, 48, 64]
    pre = compute_logits(be, IDS, "prefill")  # 63 tokens in chunks of 16
    dec = compute_logits(be, IDS, "decode")
    assert rel(pre, ref) < 1e-4 and rel(dec, ref) < 1e-4
    assert be.stats["replay"] > 40 and be.stats["relayouts"] >= 1 and dev.launched_graphs == be.stats["replay"]
    be.close()


def test_capture_failure_falls_back_to_eager(engine_bundle, monkeypatch):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = engine_bundle
    dev.capture_ok = False
    be = TensorRTBackend(b, num_slots=2)
    dec = compute_logits(be, IDS[:10], "decode")
    ref = compute_logits(OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0), IDS[:10], "prefill")
    assert rel(dec, ref) < 1e-4
    assert be.stats["replay"] == 0 and be.graphs.failed and dev.launched_graphs == 0
    be.close()


def test_batched_decode_copy_and_reset(engine_bundle):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = engine_bundle
    ort_be = OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0)
    a, c = IDS[:9], IDS[20:25]
    ref_a = compute_logits(ort_be, a + [5, 6], "prefill")[-2:]
    ref_c = compute_logits(ort_be, c + [7, 8], "prefill")[-2:]
    be = TensorRTBackend(b, num_slots=4)
    be.forward(StepBatch.single(3, a, 0))
    be.forward(StepBatch.single(1, c, 0))
    be.copy_slot(3, 0, len(a))  # prefix reuse: slot 0 continues a's sequence
    be.reset_slot(3)
    got = []
    for i, (ta, tc) in enumerate(((5, 7), (6, 8))):
        out = be.forward(StepBatch(slots=[1, 0], input_ids=np.array([[tc], [ta]]),
                                   past_lengths=np.array([len(c) + i, len(a) + i]), new_lengths=np.ones(2, np.int64),
                                   logits_positions=np.zeros((2, 1), np.int64)))
        got.append(out[:, 0])
    assert rel(np.stack([g[1] for g in got]), ref_a) < 1e-4
    assert rel(np.stack([g[0] for g in got]), ref_c) < 1e-4
    with pytest.raises(LinesideError, match="cannot copy"):
        be.copy_slot(3, 2, 4)
    be.close()


def test_refuses_engine_of_another_machine(engine_bundle, monkeypatch):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = engine_bundle
    fake_trt.install(monkeypatch, gpu="NVIDIA H200", trt_version="10.15.1")
    with pytest.raises(BundleError) as e:
        TensorRTBackend(b, num_slots=1)
    msg = str(e.value)
    assert "GPU Fake GPU (engine) vs NVIDIA H200 (here)" in msg and "TensorRT 10.3.0 (engine) vs 10.15.1" in msg
    assert f"lineside engine {b.path}" in msg
    with pytest.raises(LinesideError, match="at most 4 slots"):
        fake_trt.install(monkeypatch)
        TensorRTBackend(b, num_slots=8)


def test_cli_engine_and_auto_backend(trt_bundle, monkeypatch, tmp_path, capsys):
    import shutil

    from lineside.bundle import open_bundle
    from lineside.runtime.select import choose_backend

    dst = tmp_path / "b"
    shutil.copytree(trt_bundle("fp16").path, dst)
    fake_trt.install(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["engine", str(dst), "--slots", "2", "--max-prefill", "8", "--workspace-gb", "1"])
    assert e.value.code == 0 and "engine written to" in capsys.readouterr().out
    said = []
    be = choose_backend(open_bundle(dst), "auto", num_slots=2, say=said.append)
    assert be.name == "tensorrt" and said[0].startswith("backend: tensorrt (engine fake-gpu-sm87")
    be.close()
    # generate / chat pick the backend the same way, and say which on stderr
    outs = {}
    for backend in ("auto", "onnxruntime"):
        with pytest.raises(SystemExit) as e:
            main(["generate", str(dst), "--prompt", "hello", "--max-tokens", "6", "--backend", backend])
        cap = capsys.readouterr()
        assert e.value.code == 0, cap.err
        outs[backend] = cap.out
        assert ("backend: tensorrt (engine fake-gpu-sm87" in cap.err) == (backend == "auto")
    assert outs["auto"] == outs["onnxruntime"] and outs["auto"].strip()


def test_v4_replace_state_graph(monkeypatch, tmp_path):
    from lineside.bundle import open_bundle
    from lineside.runtime.tensorrt.backend import TensorRTBackend
    from tests.build.deepseek_v4.helpers import token_ids
    from tests.runtime.tensorrt.bundles import v4_bundle

    p = v4_bundle(tmp_path, "fp16")
    dev = fake_trt.install(monkeypatch)
    build_engine(p, BuildOptions(num_slots=2, max_prefill=8))
    b = open_bundle(p)
    ids = [int(t) for t in token_ids(n=14)]
    ref = compute_logits(OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0), ids, "decode")
    be = TensorRTBackend(b, num_slots=2)
    pre = compute_logits(be, ids, "prefill")  # chunks of 8 carry the replace state across
    dec = compute_logits(be, ids, "decode", slot=1)
    assert rel(pre, ref) < 1e-4 and rel(dec, ref) < 1e-4
    assert be.stats["replay"] > 0 and dev.launched_graphs > 0
    # no append state: graphs per (batch bucket, tokens per row, logits per row), never per length bucket
    assert {k[3] for k in be.graphs.graphs} == {0} and {(1, 1, 1, 0), (2, 1, 1, 0)} <= set(be.graphs.graphs)
    # no attention mask: rows of different new lengths run by length (test_tensorrt_v4_speculative_cpu checks them)
    be.close()


def test_build_failures_are_one_line(trt_bundle, monkeypatch, tmp_path):
    import shutil
    import sys

    from lineside.build.tensorrt.builder import EngineBuildError

    dst = tmp_path / "b"
    shutil.copytree(trt_bundle("w4a16").path, dst)
    fake_trt.install(monkeypatch)
    trt = sys.modules["tensorrt"]
    trt.fail = "parse"
    with pytest.raises(EngineBuildError) as e:
        build_engine(dst, BuildOptions(num_slots=1))
    assert str(e.value).startswith("TensorRT could not parse model.onnx: node embed_tokens/gather_codes (Gather)")
    assert "+1 more" in str(e.value)
    trt.fail = "build"
    with pytest.raises(EngineBuildError, match="built no engine for Fake GPU .*--backend onnxruntime"):
        build_engine(dst, BuildOptions(num_slots=1))
    trt.fail = None
    import io

    from rich.console import Console

    from lineside.build.tensorrt import builder
    from lineside.build.tensorrt.check import CheckReport, Offender

    rep = CheckReport("10.3", "model.onnx", nodes=1, offenders=[Offender("embed_tokens/gather_codes", "Gather", "INT8",
                                                                        "INT8 only through DequantizeLinear")])
    monkeypatch.setattr(builder, "check_bundle", lambda *a: rep)
    buf = io.StringIO()
    build_engine(dst, BuildOptions(num_slots=1), Console(file=buf, width=300))  # pre-check only warns
    assert "warning: node embed_tokens/gather_codes" in buf.getvalue()


def test_serving_engine_leaves_slot_moves_to_the_arena_layout(engine_bundle):
    """The serving engine on TensorRT: the scheduler never moves a sequence (the backend does not need
    contiguous slots), ArenaLayout swaps rows when finished requests leave holes, and batched greedy
    requests get the tokens they get one at a time."""
    import asyncio

    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.request import GenerationRequest
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = engine_bundle
    prompts = [IDS[:5], IDS[:9] + [40], IDS[10:13], IDS[:9] + [41, 42]]  # two share a 9-token prefix
    lengths = [3, 9, 5, 7]  # unequal: early finishers leave holes in the decode batch

    async def serve(slots, together):
        be = TensorRTBackend(b, num_slots=slots)
        eng = LLMEngine(b, backend=be, num_slots=slots, kv_block_size=4)
        move = eng.arena.move
        eng.arena.move = lambda src, dst: (moved.append((src, dst)), move(src, dst))
        await eng.start()
        reqs = [GenerationRequest(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
        if together:
            outs = await asyncio.gather(*(eng.submit(r).result() for r in reqs))
        else:
            outs = [await eng.submit(r).result() for r in reqs]
        await eng.stop()
        return [o[1] for o in outs], be.stats

    moved = []
    batched, stats = asyncio.run(asyncio.wait_for(serve(3, True), timeout=60))
    solo, _ = asyncio.run(asyncio.wait_for(serve(1, False), timeout=60))
    assert batched == solo and [len(ids) for ids in batched] == lengths
    assert moved == [] and stats["swaps"] > 0


@pytest.mark.parametrize("kv,other", [("int8", "fp16"), ("int4", "int8")])
def test_quantized_kv_arena_capture_copy_and_mismatch(tiny_bundles, monkeypatch, tmp_path, kv, other):
    """An int8/int4-KV bundle: the arena holds uint8 values (int4: two per byte) and fp16 scales (half / a quarter
    of the bytes per token, plus 2 per scale), replayed graphs and copy_slot give onnxruntime's logits, and an
    engine of another KV dtype is refused."""
    import shutil

    from lineside.bundle import open_bundle
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    src = tiny_bundles(quant="fp16", flavors=("trt",), max_seq_len=64, group_size=64, accuracy_level=0,
                       kv_dtype=kv)
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst)
    fake_trt.install(monkeypatch)
    build_engine(dst, BuildOptions(num_slots=2, max_prefill=16, first_bucket=8, bucket_step=16))
    b = open_bundle(dst)
    ref = compute_logits(OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0), IDS, "prefill")
    be = TensorRTBackend(b, num_slots=2)
    arena = {n: s for n, s in be.plan.buffers.items() if s.role == "arena"}
    cfg = b.config
    assert arena["past_key.0"].dtype == np.uint8 and arena["past_key_scale.0"].dtype == np.float16
    sinks = [n for n in arena if n.startswith("past_sink.")]  # int4: fp16 first 4 entries, once per slot
    assert len(sinks) == (cfg.num_layers if kv == "int4" else 0)
    assert all(arena[n].dtype == np.float16 and arena[n].shape == (2, 2 * cfg.num_kv_heads * 4 * cfg.head_dim)
               for n in sinks)
    per_token = sum(s.nbytes for n, s in arena.items() if n not in sinks) // (2 * b.max_seq_len)
    # int4: an fp16 (scale, minimum) pair per 16 channels
    stored, scales = (cfg.head_dim, 1) if kv == "int8" else (cfg.head_dim // 2, 2 * -(-cfg.head_dim // 16))
    assert per_token == 2 * cfg.num_layers * cfg.num_kv_heads * (stored + 2 * scales)
    dec = compute_logits(be, IDS, "decode")
    assert rel(dec, ref) < 1e-4 and be.stats["replay"] > 40
    be.forward(StepBatch.single(0, IDS[:9], 0))
    be.copy_slot(0, 1, 9)
    out = be.forward(StepBatch.single(1, IDS[9:10], 9))
    assert rel(out[0], compute_logits(OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0), IDS[:10],
                                      "prefill")[-1:]) < 1e-4
    be.close()
    [edir] = list((dst / "engines").iterdir())
    meta = json.loads((edir / ENGINE_JSON).read_text())
    assert meta["kv_dtype"] == kv
    (edir / ENGINE_JSON).write_text(json.dumps({**meta, "kv_dtype": other}))
    with pytest.raises(BundleError, match=f"built for a {other} KV cache but the bundle's trt graph stores {kv}"):
        TensorRTBackend(open_bundle(dst), num_slots=2)


def test_int4_sink_entries_in_a_bucket_with_a_dummy_row_short_copy_and_rejected_draft(tiny_bundles, monkeypatch,
                                                                                     tmp_path):
    """int4's fp16 sink state (manifest update 'prefix') on the TensorRT backend: a 3-row step in a 4-row bucket
    (rows around the first 4 positions) leaves the dummy row's slot as it was, a 2-token prefix copies (a prefix
    state copies whole; replace states refuse it), and drafts at 1..3 rejected then re-fed give a fresh run."""
    import shutil

    from lineside.bundle import open_bundle
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    src = tiny_bundles(quant="fp16", flavors=("trt",), max_seq_len=64, group_size=64, accuracy_level=0,
                       kv_dtype="int4")
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst)
    fake_trt.install(monkeypatch)
    build_engine(dst, BuildOptions(num_slots=4, max_prefill=16, first_bucket=8, bucket_step=16))
    b = open_bundle(dst)
    ref = OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0).forward(StepBatch.single(0, IDS[:10], 0,
                                                                                        all_logits=True))[0]
    from tests.kv_sink_cases import POSITIONS, prime_sink_boundary, sink_boundary_batch

    be = TensorRTBackend(b, num_slots=4)
    prime_sink_boundary(be, IDS)
    be.forward(StepBatch.single(3, [5, 5, 5, 5, 5], 0))  # the bucket's dummy row lands on slot 3
    got = be.forward(sink_boundary_batch(IDS))
    for r, p in enumerate(POSITIONS):
        assert rel(got[r, 0], ref[p]) < 1e-4
    alone = OnnxRuntimeBackend(b, num_slots=1, flavor="trt", accuracy_level=0)
    alone.forward(StepBatch.single(0, [5, 5, 5, 5, 5], 0))
    assert rel(be.forward(StepBatch.single(3, [5], 5))[0, 0], alone.forward(StepBatch.single(0, [5], 5))[0, 0]) < 1e-4
    be.copy_slot(1, 3, 2)
    assert rel(be.forward(StepBatch.single(3, IDS[2:8], 2, all_logits=True))[0], ref[2:8]) < 1e-4
    be.reset_slot(0)
    be.forward(StepBatch.single(0, IDS[:1], 0))
    be.forward(StepBatch.single(0, [250, 251, 252], 1, all_logits=True))
    assert rel(be.forward(StepBatch.single(0, IDS[1:8], 1, all_logits=True))[0], ref[1:8]) < 1e-4
    be.close()


def test_a_rebuild_that_fails_after_writing_the_engine_leaves_no_stale_engine_json(trt_bundle, monkeypatch, tmp_path):
    """`lineside engine` rebuilding over an engine wrote the new model.engine, then the timing cache, then
    engine.json: a full disk (or a Ctrl-C) after the first left the old engine.json — the old slots, prefill
    limit and profiles — beside the new engine, which the backend then loaded as a matching pair and drove
    with shapes outside the engine's profiles. Now there is no engine.json until the engine it describes is
    complete, and the backend asks for a rebuild."""
    import errno
    import shutil

    import lineside.build.tensorrt.builder as builder
    from lineside.bundle import open_bundle
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    dst = tmp_path / "b"
    shutil.copytree(trt_bundle("fp16").path, dst)
    fake_trt.install(monkeypatch)
    build_engine(dst, BuildOptions(num_slots=4, max_prefill=16, first_bucket=8, bucket_step=16))
    write = builder._atomic_write

    def full_after_the_engine(path, data):
        if path.name == TIMING_CACHE:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(path, data)

    monkeypatch.setattr(builder, "_atomic_write", full_after_the_engine)
    with pytest.raises(OSError):
        build_engine(dst, BuildOptions(num_slots=1, max_prefill=8, first_bucket=8, bucket_step=16))
    with pytest.raises(BundleError, match="lineside engine"):
        TensorRTBackend(open_bundle(dst), num_slots=4)


def test_ctrl_c_during_the_engine_build_is_an_interrupt_not_a_failed_build(trt_bundle, monkeypatch, tmp_path, capsys):
    """TensorRT calls the progress monitor's Python methods during build_serialized_network; its pybind trampoline
    swallows what they raise and a failing step_complete cancels the build. So a Ctrl-C (or SIGTERM, which the CLI
    raises as an interrupt) landing in a callback came back as 'built no engine ... often no INT4 weight-only
    tactic: rebuild the bundle with --quant w8a16' and exit 1. It is an interrupt (exit 130), the progress bars
    are stopped, and nothing is written."""
    import shutil

    from lineside.build.tensorrt import progress

    dst = tmp_path / "b"
    shutil.copytree(trt_bundle("w4a16").path, dst)
    fake_trt.install(monkeypatch)
    made = []
    init = progress.PhaseBars.__init__
    monkeypatch.setattr(progress.PhaseBars, "__init__", lambda self, *a: (made.append(self), init(self, *a))[1])

    def ctrl_c(self, phase, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(progress.PhaseBars, "step", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        build_engine(dst, BuildOptions(num_slots=1))
    assert made and not made[0].progress.live.is_started  # the bars TensorRT left mid-phase are stopped
    assert not list(dst.glob("engines/*/engine.json")) and not list(dst.glob("engines/*/model.engine"))
    with pytest.raises(SystemExit) as e:
        main(["engine", str(dst), "--slots", "1"])
    assert e.value.code == 130
    assert "built no engine" not in capsys.readouterr().err

