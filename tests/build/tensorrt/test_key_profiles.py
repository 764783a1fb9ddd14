"""Engine key + refusal of a mismatched engine, profiles and buffer plan derived from a bundle, KV cost model."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from lineside.build.tensorrt.builder import BuildOptions, engine_meta, table_for
from lineside.build.tensorrt.profiles import LOGITS_BUDGET, derive_limits, derive_profiles
from lineside.build.tensorrt.progress import PhaseBars
from lineside.errors import BundleError, LinesideError
from lineside.graph_io import StateTensor
from lineside.runtime.tensorrt.buffers import ALIGN, plan_buffers
from lineside.runtime.tensorrt.graphs import batch_buckets, length_buckets, pick_bucket
from lineside.runtime.tensorrt.key import (
    ENGINE_FILE,
    ENGINE_JSON,
    MachineKey,
    differences,
    engine_dir,
    find_engine,
    has_engine_for,
)

ORIN = MachineKey("Orin", "8.7", "10.3.0", "12.6")
H200 = MachineKey("NVIDIA H200", "9.0", "10.15.1", "12.9")


def _fake_engine(bundle_path, key, sha="abc"):
    d = engine_dir(bundle_path, key)
    d.mkdir(parents=True)
    (d / ENGINE_FILE).write_bytes(b"plan")
    lim = derive_limits(64, 300, 2)
    meta = engine_meta(key, lim, [], BuildOptions(), sha, 1.0)
    (d / ENGINE_JSON).write_text(json.dumps(meta))
    return d


def test_key_format_and_differences():
    assert ORIN.key == "orin-sm87-trt10.3.0-cuda12.6"
    assert H200.key == "nvidia-h200-sm90-trt10.15.1-cuda12.9"
    diff = differences(ORIN, H200)
    assert len(diff) == 4 and diff[0].startswith("GPU Orin (engine) vs NVIDIA H200 (here)")
    assert table_for("10.3.0") == "10.3" and table_for("10.15.1") == "newest"


def test_find_engine_match_mismatch_missing(tmp_path):
    with pytest.raises(BundleError, match="no TensorRT engine .* `lineside engine "):
        find_engine(tmp_path, ORIN)
    d = _fake_engine(tmp_path, ORIN)
    got, meta = find_engine(tmp_path, ORIN, "abc")
    assert got == d and meta["compute_capability"] == "8.7" and meta["limits"]["max_batch"] == 2
    assert has_engine_for(tmp_path, ORIN) and not has_engine_for(tmp_path, H200)
    with pytest.raises(BundleError) as e:
        find_engine(tmp_path, H200)
    msg = str(e.value)
    assert "TensorRT 10.3.0 (engine) vs 10.15.1 (here)" in msg and "SM 8.7" in msg
    assert f"lineside engine {tmp_path}" in msg and "\n" not in msg
    with pytest.raises(BundleError, match="older trt graph"):
        find_engine(tmp_path, ORIN, "other-sha")
    (d / ENGINE_FILE).unlink()
    with pytest.raises(BundleError, match="missing"):
        find_engine(tmp_path, ORIN)


def test_junk_in_engines_dir_never_crashes_lookup(tmp_path):
    """A file where a directory goes, an empty dir, engine.json that is not an object or has a bad lora field:
    skipped, and the refusal still names the real engine's mismatch (not the junk)."""
    root = tmp_path / "engines"
    root.mkdir()
    (root / "a-file").write_text("x")
    (root / "b-empty").mkdir()
    for name, text in (("c-list", "[1, 2]"), ("d-badlora", json.dumps({"machine": ORIN.to_dict(),
                                                                         "lora": {"max_loras": "x"}})),
                       ("e-nomachine", "{}")):
        (root / name).mkdir()
        (root / name / ENGINE_JSON).write_text(text)
    with pytest.raises(BundleError, match="e-nomachine/engine.json is incomplete"):
        find_engine(tmp_path, ORIN)
    assert not has_engine_for(tmp_path, ORIN)
    _fake_engine(tmp_path, H200)
    with pytest.raises(BundleError, match="GPU NVIDIA H200 \\(engine\\) vs Orin \\(here\\)"):
        find_engine(tmp_path, ORIN)
    with pytest.raises(BundleError, match="no TensorRT engine for 2 LoRA slots"):
        find_engine(tmp_path, ORIN, lora=(2, 8))


def test_limits_and_profiles(trt_bundle):
    b = trt_bundle("fp16")
    lim = derive_limits(b.max_seq_len, b.config.vocab_size, num_slots=4)
    assert (lim.max_batch, lim.max_seq, lim.max_prefill) == (4, 64, 64)
    big = derive_limits(32768, 152064, num_slots=8, max_prefill=1024)
    assert big.max_logits * 8 * 152064 * 4 <= LOGITS_BUDGET and big.max_prefill == 1024
    with pytest.raises(LinesideError, match="--slots"):
        derive_limits(64, 300, 0)
    dec, pre = derive_profiles(b.flavor("trt"), b.config, lim)
    assert (dec.name, pre.name) == ("decode", "prefill")
    # decode: one token per row at the optimum, up to 1 + 16 drafts for speculative verification
    assert lim.max_verify == 17 and dec.shapes["input_ids"] == ((1, 1), (4, 1), (4, 17))
    assert dec.shapes["logits_positions"] == ((1, 1), (4, 1), (4, 17))
    assert dec.shapes["attention_mask"][2] == (4, 64 + 17)
    assert pre.shapes["input_ids"][2] == (4, 64)
    assert dec.shapes["past_key.0"][0] == (1, 2, lim.first_bucket, 16)
    assert dec.shapes["past_key.0"][2] == (4, 2, 64, 16)
    assert pre.shapes["attention_mask"][2] == (4, 64 + 64)
    for spec in (dec, pre):
        assert set(spec.shapes) == set(b.flavor("trt").inputs)
        for mn, op, mx in spec.shapes.values():
            assert all(a <= o <= c for a, o, c in zip(mn, op, mx, strict=True))
    json.dumps([dec.to_dict(), pre.to_dict()])


def test_profiles_reject_unknown_input(trt_bundle):
    b = trt_bundle("fp16")
    fl = replace(b.flavor("trt"), inputs=["input_ids", "seqlens_k"])
    with pytest.raises(LinesideError, match="seqlens_k"):
        derive_profiles(fl, b.config, derive_limits(64, 300, 1))


def test_buffer_plan(trt_bundle):
    b = trt_bundle("fp16")
    fl = b.flavor("trt")
    states = list(fl.state)
    plan = plan_buffers(states, b.config, num_slots=4, max_seq=64, max_prefill=32, max_logits=8, vocab=300,
                        input_names=fl.inputs)
    arena = plan.buffers["past_key.0"]
    assert arena.shape == (4, 2, 64, 16) and arena.nbytes == 4 * 2 * 64 * 16 * 2  # fp16 KV in non-fp32 builds
    assert plan.buffers["present_key.0"].shape == (4, 2, 32, 16)
    assert plan.buffers["logits"].shape == (4, 8, 300)
    assert plan.buffers["attention_mask"].shape == (4, 64 + 32)
    assert plan.buffers["scratch"].nbytes == arena.nbytes
    spans = sorted((s.offset, s.offset + s.nbytes) for s in plan.buffers.values())
    assert all(o % ALIGN == 0 for o, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert plan.total >= spans[-1][1] and plan.address(1 << 20, "past_key.0") == (1 << 20) + arena.offset
    assert plan.states[0].row_bytes(16) == 2 * 16 * 16 * 2
    bad = [StateTensor("s", "o", ["batch", "past_seq", 4], update="inplace")]
    with pytest.raises(BundleError, match="inplace"):
        plan_buffers(bad, b.config, num_slots=1, max_seq=8, max_prefill=4, max_logits=1, vocab=10, input_names=[])
    rep = [StateTensor("win", "win_out", ["batch", 8, "head_dim"], update="replace")]
    p2 = plan_buffers(rep, b.config, num_slots=2, max_seq=8, max_prefill=4, max_logits=1, vocab=10, input_names=[])
    assert p2.buffers["win"].shape == (2, 8 * 16) and p2.states[0].row_bytes(99) == 8 * 16 * 4


def test_buckets():
    assert batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(5) == [1, 2, 4, 5]
    lb = length_buckets(4096)
    assert lb[:5] == [64, 128, 256, 512, 1024] and lb[-1] == 4096 and all(b % 512 == 0 for b in lb[3:])
    assert pick_bucket(3, [1, 2, 4, 8]) == 4 and pick_bucket(4097, length_buckets(8192)) == 4608
    with pytest.raises(ValueError):
        pick_bucket(9, [1, 2, 4, 8])


def test_kv_bytes_moved_at_4k():
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from trt_kvcost import KvShape, kv_bytes_per_decode_step

    m = KvShape("llama-8b", 32, 8, 128)
    r = kv_bytes_per_decode_step(m, 4096, 32768)
    e = 32 * 2 * 8 * 128 * 2
    assert r["a_fixed_max_len"] == e * (32768 + 3)
    assert r["b_concat"] == e * (3 * 4096 + 2)
    assert r["b_scatternd"] == e * 3 * 32768
    assert r["c_bucket"] == 4608 and r["c_new_only_buckets"] == e * (4608 + 3 + 2 * 4096 / 512)
    assert r["c_new_only_buckets"] < min(r["a_fixed_max_len"], r["b_concat"], r["b_scatternd"])


def test_progress_bars_track_phases():
    bars = PhaseBars(Console(file=open("/dev/null", "w")))
    bars.start("Building engine", None, 3)
    bars.start("Tactic search", "Building engine", 10)
    assert bars.depth["Tactic search"] == 1 and bars.step("Tactic search", 4)
    bars.finish("Tactic search")
    bars.cancelled = True
    assert not bars.step("Building engine", 1)
    bars.finish("Building engine")
    assert bars.finished == ["Tactic search", "Building engine"] and not bars.tasks
