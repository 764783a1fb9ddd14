"""The TensorRT backend when the GPU fails, on the strict fake with its injected faults (fake_trt.Device.inject): a
sticky CUDA error is BackendLost (the engine fails at once), out of memory or a shape outside the profile fails only
its step, and a failed CUDA graph replay runs eagerly and captures again once."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lineside.errors import LinesideError
from lineside.runtime.backend import StepBatch
from lineside.runtime.engine_health import BackendLost
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from tests.runtime.tensorrt import fake_trt
from tests.runtime.tensorrt.bundles import fake_engine_bundle
from tests.runtime.tensorrt.fake_trt import Fault

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150]


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture
def engine_bundle(trt_bundle, monkeypatch, tmp_path):
    return fake_engine_bundle(trt_bundle, monkeypatch, tmp_path, num_slots=2)


def decode(slots, ids, past):
    n = len(slots)
    return StepBatch(slots=list(slots), input_ids=np.array(ids, dtype=np.int64).reshape(n, 1),
                     past_lengths=np.array(past, dtype=np.int64), new_lengths=np.ones(n, np.int64),
                     logits_positions=np.zeros((n, 1), np.int64))


@pytest.mark.parametrize("fault", fake_trt.STICKY_FAULTS, ids=lambda f: f.name)
def test_sticky_fault_is_backend_lost_with_one_line(engine_bundle, fault):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = engine_bundle
    be = TensorRTBackend(b, num_slots=2)
    be.forward(StepBatch.single(0, IDS[:5], 0))
    dev.inject(fault)
    with pytest.raises(BackendLost) as lost:  # the decode step replays its graph; the fault shows at the sync
        be.forward(decode([0], [IDS[5]], [5]))
    msg = str(lost.value)
    assert "\n" not in msg and f"CUDA context is lost ({fault.value.name} in " in msg and "restart" in msg
    with pytest.raises(BackendLost, match=fault.value.name):  # every later step: the context stays lost
        be.forward(StepBatch.single(1, IDS[:3], 0))
    be.close()


@pytest.mark.parametrize("fault", fake_trt.STICKY_FAULTS, ids=lambda f: f.name)
def test_execute_answering_false_after_a_sticky_error_is_backend_lost(engine_bundle, fault):
    """TensorRT's execute_async_v3 itself answers False: cudaGetLastError tells a lost context from a step's own."""
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = engine_bundle
    be = TensorRTBackend(b, num_slots=2)
    dev.inject(fault, at_enqueue=True)
    with pytest.raises(BackendLost, match=f"{fault.value.name} in TensorRT execute_async_v3"):
        be.forward(StepBatch.single(1, IDS[:3], 0))  # a prefill: eager
    be.close()


def test_out_of_memory_on_a_larger_batch_fails_only_that_step(engine_bundle):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = engine_bundle
    ref = compute_logits(OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0), IDS, "prefill")
    be = TensorRTBackend(b, num_slots=2)
    be.forward(StepBatch.single(0, IDS[:9], 0))
    be.forward(StepBatch.single(1, IDS[:9], 0))
    dev.inject(Fault.OUT_OF_MEMORY, above_batch=1)
    with pytest.raises(LinesideError) as failed:  # 2 rows past 9 positions: a new length bucket, run eagerly first
        be.forward(decode([0, 1], [IDS[9], IDS[9]], [9, 9]))
    assert not isinstance(failed.value, BackendLost)
    assert "cudaErrorMemoryAllocation" in str(failed.value) and "\n" not in str(failed.value)
    got = be.forward(decode([0], [IDS[9]], [9]))  # one row still runs, and right
    assert rel(got[0, 0], ref[9]) < 1e-4
    be.close()


def test_shape_outside_the_profile_fails_the_step_with_its_input(engine_bundle):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = engine_bundle
    be = TensorRTBackend(b, num_slots=2)
    with pytest.raises(LinesideError, match=r"input input_ids shape \(4, 1\) is outside the TensorRT engine's "
                                            r"profile .* rebuild with `lineside engine"):
        be._set_shapes(be.contexts["decode"], 4, 1, 8, 1)  # 4 rows on an engine built for 2
    be.close()


def test_failed_replay_recaptures_once_then_runs_eagerly(engine_bundle, caplog):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = engine_bundle
    ref = compute_logits(OnnxRuntimeBackend(b, flavor="trt", accuracy_level=0), IDS, "prefill")
    be = TensorRTBackend(b, num_slots=2)
    be.forward(StepBatch.single(0, IDS[:5], 0))
    dev.inject(Fault.GRAPH_REPLAY, count=1)
    with caplog.at_level(logging.WARNING, logger="lineside.tensorrt"):
        got = be.forward(decode([0], [IDS[5]], [5]))
    assert rel(got[0, 0], ref[5]) < 1e-4  # the step ran eagerly instead
    assert "replay for bucket (1, 1, 1, 8) failed (cudaErrorInvalidResourceHandle); running the step eagerly and " \
           "capturing the bucket again" in caplog.text
    assert (1, 1, 1, 8) in be.graphs.graphs  # captured again ...
    launched = dev.launched_graphs
    got = be.forward(decode([0], [IDS[6]], [6]))
    assert dev.launched_graphs == launched + 1 and rel(got[0, 0], ref[6]) < 1e-4  # ... and replayed
    caplog.clear()
    dev.inject(Fault.GRAPH_REPLAY, count=1)  # fails again: that bucket runs eagerly for good
    with caplog.at_level(logging.WARNING, logger="lineside.tensorrt"):
        got = be.forward(decode([0], [IDS[7]], [7]))
    assert rel(got[0, 0], ref[7]) < 1e-4 and "runs eagerly from now on" in caplog.text
    assert (1, 1, 1, 8) in be.graphs.failed and (1, 1, 1, 8) not in be.graphs.graphs
    be.forward(StepBatch.single(1, IDS[:5], 0))
    eager, launched = be.stats["eager"], dev.launched_graphs
    got = be.forward(decode([1], [IDS[5]], [5]))  # the same bucket, another sequence
    assert be.stats["eager"] == eager + 1 and dev.launched_graphs == launched and rel(got[0, 0], ref[5]) < 1e-4
    be.close()


def test_gpu_memory_too_small_for_the_kv_arena_is_one_line_before_allocating(engine_bundle):
    from lineside.errors import BackendUnavailable
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev = engine_bundle
    dev.free_mem = 4096  # the tiny model needs a few hundred KiB
    allocated = len(dev.keep)
    with pytest.raises(BackendUnavailable) as refused:
        TensorRTBackend(b, num_slots=2)
    msg = str(refused.value)
    assert "\n" not in msg and "GiB of GPU memory for --num-slots 2 (KV cache" in msg
    assert "for 2 x 64 positions" in msg and "GPU 0 has 0.00 GiB free of 16.00 GiB" in msg
    assert "lower --num-slots" in msg and "--max-seq-len" in msg
    assert len(dev.keep) == allocated  # refused before any device allocation


def test_an_integrated_gpu_counts_the_memory_the_kernel_would_give_back(engine_bundle, tmp_path, monkeypatch):
    """A Jetson's cudaMemGetInfo leaves page cache out of "free" (the bundle just read sits there): the host's
    MemAvailable counts on an integrated GPU, so the check does not refuse what the allocation would get."""
    from lineside.errors import BackendUnavailable
    from lineside.host_memory import available_memory_bytes
    from lineside.runtime.tensorrt import backend as trt_backend

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemFree:           1000 kB\nMemAvailable:   32000000 kB\n")
    assert available_memory_bytes(meminfo) == 32000000 * 1024
    monkeypatch.setattr(trt_backend, "available_memory_bytes", lambda: available_memory_bytes(meminfo))
    b, dev = engine_bundle
    dev.free_mem = 4096  # cudaMemGetInfo on a Jetson whose memory is page cache
    with pytest.raises(BackendUnavailable):  # a discrete GPU: its free memory is all there is
        trt_backend.TensorRTBackend(b, num_slots=2)
    dev.integrated = True
    trt_backend.TensorRTBackend(b, num_slots=2).close()


def test_cli_generate_on_too_small_a_gpu_exits_1_with_the_line(engine_bundle, capsys):
    from lineside.cli import main

    b, dev = engine_bundle
    dev.free_mem = 4096  # the tiny model needs a few hundred KiB
    with pytest.raises(SystemExit) as e:
        main(["generate", str(b.path), "--backend", "tensorrt", "--prompt", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error: the TensorRT backend needs ") and "\n" not in err


@pytest.mark.parametrize(("fail", "why"), [
    ("plan-version", "not compatible with this version of TensorRT, expecting library version 10.3.0.30 got 10.0.1.6"),
    ("plan-gpu", "generated on an incompatible device, expecting compute 8.7 got compute 8.9"),
    ("plan-corrupt", "Magic tag does not match"),
])
def test_engine_that_fails_to_deserialize_names_file_reason_and_rebuild(engine_bundle, fail, why):
    """engine.json matches this machine but the plan does not (copied from elsewhere, TensorRT updated in place, a
    torn write): TensorRT's own reason, caught from its log, in the one line."""
    import sys

    from lineside.errors import BackendUnavailable
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = engine_bundle
    sys.modules["tensorrt"].fail = fail
    with pytest.raises(BackendUnavailable) as refused:
        TensorRTBackend(b, num_slots=2)
    msg = str(refused.value)
    [plan] = (b.path / "engines").glob("*/model.engine")
    assert "\n" not in msg and f"TensorRT could not load the engine {plan} (" in msg and why in msg
    assert msg.endswith(f"rebuild it on this machine with `lineside engine {b.path}`")


def test_empty_engine_file_is_one_line(engine_bundle):
    from lineside.errors import BackendUnavailable
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _ = engine_bundle
    [plan] = (b.path / "engines").glob("*/model.engine")
    plan.write_bytes(b"")
    # engine.json seals the plan's size: an empty file is refused before TensorRT sees it
    with pytest.raises(BackendUnavailable, match=r"engine not loaded: .*model.engine has 0 bytes, .*engine.json says "
                                                 r"\d+ \(cut short or replaced\); rebuild it on this machine"):
        TensorRTBackend(b, num_slots=2)
