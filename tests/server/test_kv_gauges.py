"""The /metrics KV gauges read the arena's real allocation: bytes per token, capacity and bytes in use, by dtype."""

from __future__ import annotations

import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from lineside.bundle import open_bundle
from lineside.runtime.engine import LLMEngine
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.server.metrics import ServerMetrics

TRT = dict(quant="fp16", flavors=("trt",), max_seq_len=64, group_size=64)  # as the planner's emitter test
# (bundle options, graph flavor, dtype label, bytes per head-vector position: values + scale)
CASES = [(dict(), "cpu", "fp32", lambda d: 4 * d),
         (dict(TRT, kv_dtype="fp16"), "trt", "fp16", lambda d: 2 * d),
         (dict(TRT, kv_dtype="int8"), "trt", "int8", lambda d: d + 2),
         (dict(TRT, kv_dtype="int4"), "trt", "int4", lambda d: d // 2 + 2 * 2 * max(1, d // 16))]


def _buildable(options: dict) -> None:
    """Skip a KV dtype the builder does not store yet (int4 until it lands)."""
    from lineside.build.quant.kv import check_kv_flavors, parse_kv_dtype
    from lineside.errors import LinesideError

    try:
        check_kv_flavors(parse_kv_dtype(options.get("kv_dtype", "fp16")), options.get("flavors", ("cpu",)))
    except LinesideError as e:
        pytest.skip(f"the builder refuses it: {e}")


def _gauges(text: str) -> dict[str, tuple[str, float]]:
    out = {}
    for name, dtype, value in re.findall(r'^(lineside_kv_cache_\w+)\{dtype="(\w+)"\} (\S+)$', text, re.M):
        out[name] = (dtype, float(value))
    return out


def _sink_bytes(label: str, cfg) -> int:
    """int4: each slot's first 4 K and V entries once more in fp16, every layer (quant/kv.py SINK)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * 4 * 2 * cfg.head_dim if label == "int4" else 0


@pytest.mark.parametrize(("options", "flavor", "label", "vector"), CASES, ids=[c[2] for c in CASES])
def test_kv_gauges_are_the_arena_buffers(tiny_bundles, options, flavor, label, vector):
    _buildable(options)
    bundle = open_bundle(tiny_bundles(**options))
    cfg = bundle.config
    backend = OnnxRuntimeBackend(bundle, num_slots=2, flavor=flavor, threads=1)
    eng = LLMEngine(bundle, backend=backend, num_slots=2)
    try:
        slot, _ = eng.arena.allocate("held", [1, 2, 3, 4, 5], reserve_tokens=8, max_reuse=0)
        eng.arena.append(slot, [1, 2, 3, 4, 5])
        metrics = ServerMetrics()
        metrics.update_engine(eng.stats())
        text = metrics.render().decode()
    finally:
        eng.close()
    capacity = sum(a.nbytes for a in backend.arena.values())  # what the backend allocated
    positions = 2 * backend.max_seq_len
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * vector(cfg.head_dim)  # K and V, every layer
    assert capacity == positions * per_token + 2 * _sink_bytes(label, cfg)
    g = _gauges(text)
    assert g == {"lineside_kv_cache_bytes_per_token": (label, per_token),
                 "lineside_kv_cache_capacity_bytes": (label, capacity),
                 "lineside_kv_cache_used_bytes": (label, 5 * per_token + _sink_bytes(label, cfg))}  # 1 slot held
    promtool = shutil.which("promtool")
    if promtool is not None:  # the exposition stays lint-clean
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize(("options", "flavor", "label", "vector"), CASES[1:], ids=[c[2] for c in CASES[1:]])
def test_tensorrt_backend_reports_its_arena_buffers(tiny_bundles, options, flavor, label, vector):
    """The TensorRT backend's numbers come from its buffer plan's arena role (no GPU needed to read them)."""
    from lineside.runtime.tensorrt.backend import TensorRTBackend
    from lineside.runtime.tensorrt.buffers import plan_buffers

    _buildable(options)
    b = open_bundle(tiny_bundles(**options))
    fl, cfg = b.flavor(flavor), b.config
    plan = plan_buffers(fl.state, cfg, num_slots=3, max_seq=64, max_prefill=8, max_logits=1,
                        vocab=cfg.vocab_size, input_names=list(fl.inputs))
    fake = SimpleNamespace(plan=plan, bundle=b, num_slots=3, max_seq_len=64)
    got = TensorRTBackend.kv_arena_bytes(fake)  # type: ignore[arg-type]
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * vector(cfg.head_dim)
    assert (got.dtype, got.capacity_bytes, got.bytes_per_token) == \
        (label, 3 * 64 * per_token + 3 * _sink_bytes(label, cfg), per_token)
    assert got.capacity_bytes == sum(s.nbytes for s in plan.buffers.values() if s.role == "arena")
