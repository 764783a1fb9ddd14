"""The TensorRT backend with LoRA slots on CPU against the strict fake (fake_trt.py): the LoRA graph's engine
(its own profiles and engine.json), adapters equal the onnxruntime backend, and one captured decode graph per
bucket replays for any mix of adapters (ids are a graph input; loading an adapter captures nothing new)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from lineside.build.tensorrt.builder import BuildOptions, build_engine
from lineside.bundle import open_bundle
from lineside.errors import BundleError
from lineside.lora import read_adapter
from lineside.runtime.backend import StepBatch
from lineside.runtime.generate import compute_logits
from lineside.runtime.lora_stack import LoraSlotsConfig
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.tensorrt.key import ENGINE_JSON
from tests.conftest import LORA_ADAPTERS
from tests.runtime.tensorrt import fake_trt

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150, 61, 12]
NAMES = sorted(LORA_ADAPTERS)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture
def lora_engine_bundle(tiny_bundles, peft_adapter, monkeypatch, tmp_path):
    src = tiny_bundles(quant="fp32", flavors=("trt",), max_seq_len=64, group_size=64, accuracy_level=0,
                       max_lora_rank=8)
    dst = tmp_path / "bundle"
    shutil.copytree(src, dst)
    dev = fake_trt.install(monkeypatch)
    build_engine(dst, BuildOptions(num_slots=4, max_prefill=16, first_bucket=8, bucket_step=16, max_loras=3))
    b = open_bundle(dst)
    adapters = {n: read_adapter(peft_adapter("llama-gqa", n), b.config, n) for n in NAMES}
    return b, dev, adapters


def test_lora_engine_matches_onnxruntime_and_replays_for_any_mix(lora_engine_bundle):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, dev, adapters = lora_engine_bundle
    [d] = [p for p in (b.path / "engines").iterdir() if p.name.endswith("-lora3x8")]
    meta = json.loads((d / ENGINE_JSON).read_text())
    assert meta["lora"] == {"max_loras": 3, "max_rank": 8}
    assert meta["graph_sha256"] == b.manifest.files[b.flavor("trt").lora_graph].sha256
    decode = next(p for p in meta["profiles"] if p["name"] == "decode")["shapes"]
    assert decode["lora_slots"] == [[1], [4], [4]] and decode["lora_cols.3"] == [[3 * 8 * 3]] * 3

    slots = LoraSlotsConfig(3, 8)
    ref_be = OnnxRuntimeBackend(b, num_slots=4, flavor="trt", accuracy_level=0, lora=slots)
    be = TensorRTBackend(b, num_slots=4, lora=slots)
    captured = be.stats["captured"]
    for slot, name in enumerate(NAMES, start=1):
        ref_be.load_adapter(slot, adapters[name])
        be.load_adapter(slot, adapters[name])
    assert be.stats["captured"] == captured  # loading adapters re-captures nothing
    for a in (0, 1, 2, 3):
        ref = compute_logits(ref_be, IDS, "prefill", adapter=a)
        assert rel(compute_logits(be, IDS, "prefill", adapter=a), ref) < 1e-4, a
        assert rel(compute_logits(be, IDS, "decode", adapter=a), ref) < 1e-4, a
    # four rows, every mix of adapters and none, through the one captured batch-4 graph
    prompts = [IDS[:5], IDS[2:9], IDS[1:4], IDS[4:12]]
    replays, captured = be.stats["replay"], be.stats["captured"]
    for mix in ([1, 2, 3, 0], [0, 0, 0, 0], [3, 3, 1, 2]):
        adapters_row = np.array(mix)
        for r, p in enumerate(prompts):
            for x in (be, ref_be):
                x.reset_slot(r)
                x.forward(StepBatch.single(r, p, 0, adapter=mix[r]))
        step = StepBatch(slots=[0, 1, 2, 3], input_ids=np.array([[7], [9], [11], [13]]),
                         past_lengths=np.array([len(p) for p in prompts]), new_lengths=np.ones(4, np.int64),
                         logits_positions=np.zeros((4, 1), np.int64), adapters=adapters_row)
        assert rel(be.forward(step), ref_be.forward(step)) < 1e-4, mix
    # the first mix's shape (batch 4 at this length bucket) was captured once; the other mixes replay it
    assert be.stats["captured"] - captured <= 1 and be.stats["replay"] - replays >= 2
    assert (be.stats["captured"] - captured) + (be.stats["replay"] - replays) == 3
    be.close()


def test_lora_engine_is_looked_up_by_its_slots(lora_engine_bundle):
    from lineside.runtime.tensorrt.backend import TensorRTBackend

    b, _, _ = lora_engine_bundle
    with pytest.raises(BundleError, match="--max-loras 2 --max-lora-rank 8"):
        TensorRTBackend(b, num_slots=4, lora=LoraSlotsConfig(2, 8))
    with pytest.raises(BundleError, match="no TensorRT engine"):  # the base engine was never built
        TensorRTBackend(b, num_slots=4)
