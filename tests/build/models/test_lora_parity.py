"""LoRA graphs (both flavors) against transformers + peft in float32, prefill and decode, and mixed batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lineside.bundle import open_bundle
from lineside.lora import read_adapter
from lineside.runtime.backend import StepBatch
from lineside.runtime.generate import compute_logits
from lineside.runtime.lora_stack import LoraSlotsConfig
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from tests.conftest import LORA_ADAPTERS

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150, 61, 12]
VARIANTS = ["llama-gqa", "qwen2-bias-tied"]
NAMES = sorted(LORA_ADAPTERS)


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def lora_bundle(tiny_bundles):
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = open_bundle(tiny_bundles(variant=variant, quant="fp32", flavors=("cpu", "trt"),
                                                      max_seq_len=64, accuracy_level=0, max_lora_rank=8))
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def peft_logits(tiny_dense, peft_adapter):
    """(variant, adapter) -> transformers + peft float32 logits of IDS."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(variant, name):
        if (variant, name) not in cache:
            base = AutoModelForCausalLM.from_pretrained(tiny_dense(variant), dtype=torch.float32).eval()
            model = PeftModel.from_pretrained(base, peft_adapter(variant, name)).eval()
            with torch.no_grad():
                cache[(variant, name)] = model(torch.tensor([IDS])).logits[0].numpy()
        return cache[(variant, name)]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_logits_match_peft(lora_bundle, peft_adapter, peft_logits, tiny_dense, variant):
    """Each adapter in a slot of its own (slot 2 of 3) gives peft's logits; slot 0 gives the base model's."""
    from tests.build.models.test_dense_parity import reference_logits

    bundle = lora_bundle(variant)
    base_ref = reference_logits(tiny_dense(variant), IDS)
    for flavor in ("cpu", "trt"):
        be = OnnxRuntimeBackend(bundle, flavor=flavor, accuracy_level=0, lora=LoraSlotsConfig(3, 8))
        for name in NAMES:
            ref = peft_logits(variant, name)
            assert rel_err(ref, base_ref) > 0.05, name  # the adapter really changes the model
            be.load_adapter(2, read_adapter(peft_adapter(variant, name), bundle.config, name))
            for mode in ("prefill", "decode"):
                out = compute_logits(be, IDS, mode, adapter=2)
                assert rel_err(out, ref) < 1e-4, (flavor, name, mode, rel_err(out, ref))
        for mode in ("prefill", "decode"):
            assert rel_err(compute_logits(be, IDS, mode, adapter=0), base_ref) < 1e-4, (flavor, mode)


@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_mixed_batch_equals_each_row_alone(lora_bundle, peft_adapter, flavor):
    """Three adapters and the base model in one decode step (and, trt, one padded prefill step) equal each
    row run alone."""
    variant = "llama-gqa"
    bundle = lora_bundle(variant)
    be = OnnxRuntimeBackend(bundle, num_slots=4, flavor=flavor, accuracy_level=0, lora=LoraSlotsConfig(3, 8))
    for slot, name in enumerate(NAMES, start=1):
        be.load_adapter(slot, read_adapter(peft_adapter(variant, name), bundle.config, name))
    prompts = [IDS[:5], IDS[2:9], IDS[1:4], IDS[4:12]]
    adapters = np.array([1, 2, 3, 0])
    nxt = [7, 9, 11, 13]
    alone = []
    for r, p in enumerate(prompts):  # each row alone: prompt + next token in one prefill
        alone.append(compute_logits(be, p + [nxt[r]], "prefill", adapter=int(adapters[r])))
    for r, p in enumerate(prompts):
        be.reset_slot(r)
        be.forward(StepBatch.single(r, p, 0, adapter=int(adapters[r])))
    step = StepBatch(slots=[0, 1, 2, 3], input_ids=np.array(nxt)[:, None],
                     past_lengths=np.array([len(p) for p in prompts]), new_lengths=np.ones(4, np.int64),
                     logits_positions=np.zeros((4, 1), np.int64), adapters=adapters)
    both = be.forward(step)[:, 0]
    for r in range(4):
        assert rel_err(both[r], alone[r][-1]) < 1e-4, (flavor, r, rel_err(both[r], alone[r][-1]))
    if flavor == "trt":  # rows of different lengths right-padded into one prefill step
        width = max(len(p) for p in prompts)
        ids = np.zeros((4, width), np.int64)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = p
        lens = np.array([len(p) for p in prompts])
        for r in range(4):
            be.reset_slot(r)
        pre = be.forward(StepBatch(slots=[0, 1, 2, 3], input_ids=ids, past_lengths=np.zeros(4, np.int64),
                                   new_lengths=lens, logits_positions=(lens - 1)[:, None], adapters=adapters))[:, 0]
        for r in range(4):
            assert rel_err(pre[r], alone[r][-2]) < 1e-4, ("prefill", r)


def test_unloaded_slot_is_the_base_model(lora_bundle, peft_adapter, tiny_dense):
    """Unloading zeroes a slot: its rows compute the base model again (no trace of the adapter)."""
    from tests.build.models.test_dense_parity import reference_logits

    bundle = lora_bundle("llama-gqa")
    be = OnnxRuntimeBackend(bundle, flavor="cpu", accuracy_level=0, lora=LoraSlotsConfig(1, 8))
    be.load_adapter(1, read_adapter(peft_adapter("llama-gqa", "qv"), bundle.config, "qv"))
    be.unload_adapter(1)
    out = compute_logits(be, IDS, "prefill", adapter=1)
    assert rel_err(out, reference_logits(tiny_dense("llama-gqa"), IDS)) < 1e-4


def test_base_graph_is_unchanged_by_lora(lora_bundle, tiny_bundles):
    """--max-lora-rank adds a second graph beside the base one; the base graph is node for node the same."""
    import onnx

    with_lora = lora_bundle("llama-gqa")
    plain = open_bundle(tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu", "trt"), max_seq_len=64,
                                     accuracy_level=0))
    for flavor in ("cpu", "trt"):
        a = onnx.load(with_lora.file(with_lora.flavor(flavor).graph), load_external_data=False)
        b = onnx.load(plain.file(plain.flavor(flavor).graph), load_external_data=False)
        assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
        lora_graph = with_lora.flavor(flavor).lora_graph
        assert lora_graph is not None and lora_graph in with_lora.manifest.files
        assert plain.flavor(flavor).lora_graph is None
        # the LoRA graph stores no weights of its own: it reads the base graph's data file
        data = [f for f in with_lora.manifest.files if f.startswith(lora_graph + ".")]
        assert data == []


def test_packed_empty_slot_and_base_only_steps(lora_bundle, peft_adapter):
    """Adapters of ranks 4 and 8 packed with the slot between them empty equal TensorRT's padded layout; a step
    where no row names an adapter runs the base graph on the same KV (after adapter steps: the base backend's
    logits), and an adapter row after it runs the LoRA graph again at the right width."""
    from lineside.runtime.lora_stack import LoraStack

    bundle = lora_bundle("llama-gqa")
    slots = LoraSlotsConfig(3, 8)
    packed = OnnxRuntimeBackend(bundle, num_slots=3, flavor="cpu", accuracy_level=0, lora=slots)
    padded = OnnxRuntimeBackend(bundle, num_slots=3, flavor="cpu", accuracy_level=0, lora=slots)
    padded.lora = LoraStack(bundle.config, packed.lora.targets, slots, packed=False)
    plain = OnnxRuntimeBackend(bundle, num_slots=3, flavor="cpu", accuracy_level=0)
    for be in (packed, padded):
        for slot, name in ((1, "qv"), (3, "all-rslora")):  # ranks 4 and 8; slot 2 empty
            be.load_adapter(slot, read_adapter(peft_adapter("llama-gqa", name), bundle.config, name))
    assert packed.lora.width == 12 and padded.lora.width == 24
    prompts, rows = [IDS[:5], IDS[2:9], IDS[1:4]], np.array([1, 0, 3])

    def decode(be, tokens, adapters):
        return be.forward(StepBatch(slots=[0, 1, 2], input_ids=np.array(tokens)[:, None],
                                    past_lengths=np.array(lengths), new_lengths=np.ones(3, np.int64),
                                    logits_positions=np.zeros((3, 1), np.int64), adapters=adapters))[:, 0]

    outs = {}
    for key, be in (("packed", packed), ("padded", padded)):
        lengths = [len(p) for p in prompts]
        for r, p in enumerate(prompts):
            be.reset_slot(r)
            be.forward(StepBatch.single(r, p, 0, adapter=int(rows[r])))
        with_adapters = decode(be, [7, 9, 11], rows)  # adapter rows: the LoRA graph
        lengths = [n + 1 for n in lengths]
        outs[key] = with_adapters, decode(be, [13, 15, 17], np.zeros(3, np.int64))  # no adapter row: the base graph
    assert not packed._uses_lora(StepBatch.single(0, [1], 0)) and packed._uses_lora(StepBatch.single(0, [1], 0, adapter=3))
    for step in (0, 1):
        for r in range(3):
            assert rel_err(outs["packed"][step][r], outs["padded"][step][r]) < 1e-4, (step, r)
    # row 1 never had an adapter: its LoRA-graph step then its base-graph step equal the plain backend's
    plain.reset_slot(0)
    plain.forward(StepBatch.single(0, prompts[1], 0))
    for step, token in enumerate((9, 15)):
        ref = plain.forward(StepBatch.single(0, [token], len(prompts[1]) + step))[0, -1]
        assert rel_err(outs["packed"][step][1], ref) < 1e-4, step
    packed.unload_adapter(1)
    packed.unload_adapter(3)
    assert packed.lora.width == 0 and not packed._uses_lora(StepBatch.single(0, [1], 0, adapter=1))
    assert rel_err(compute_logits(packed, IDS, "decode", adapter=1), compute_logits(plain, IDS, "decode")) < 1e-4



@pytest.mark.parametrize("lora", [
    # rank 1 on every linear, targets as peft's "all-linear", the file saved in fp16 (a half-precision run's save)
    dict(r=1, lora_alpha=3, target_modules="all-linear", fp16=True),
    # target_modules as one regular expression (peft full-matches it against module names): layer 1's q, v, down
    dict(r=4, lora_alpha=6, target_modules=r".*\.layers\.1\..*(q|v|down)_proj"),
    # layers_to_transform: only layer 0 is adapted
    dict(r=2, lora_alpha=8, target_modules=["k_proj", "gate_proj"], layers_to_transform=[0]),
    # an odd rank, alpha unrelated to it, targets as full module paths, per-module rank/alpha by regex, rsLoRA
    dict(r=3, lora_alpha=7, use_rslora=True, target_modules=["model.layers.0.self_attn.v_proj",
                                                             "model.layers.1.mlp.up_proj"],
         rank_pattern={r"layers\.1\..*": 5}, alpha_pattern={"v_proj": 2}),
    # fan_in_fan_out true in the file: peft turns it off on nn.Linear (a plain LoRA), so it was wrongly refused
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], fan_in_fan_out_in_file=True),
], ids=["r1-all-linear-fp16", "regex", "layers-to-transform", "r3-paths-patterns-rslora", "fan-in-fan-out"])
def test_adapter_configs_users_bring_match_peft(lora_bundle, tiny_dense, tmp_path, lora):
    """Other ways real adapters are made (what the reader must map to the same layers and scalings as peft)."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.conftest import make_peft_adapter

    fp16 = lora.pop("fp16", False)
    fifo = lora.pop("fan_in_fan_out_in_file", False)
    adapter = make_peft_adapter(tiny_dense("llama-gqa"), tmp_path / "adapter", seed=5, **lora)
    if fifo:
        conf = adapter / "adapter_config.json"
        conf.write_text(json.dumps({**json.loads(conf.read_text()), "fan_in_fan_out": True}))
    if fp16:
        weights = adapter / "adapter_model.safetensors"
        save_file({k: v.half() for k, v in load_file(str(weights)).items()}, str(weights))
    base = AutoModelForCausalLM.from_pretrained(tiny_dense("llama-gqa"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = PeftModel.from_pretrained(base, adapter).eval()(torch.tensor([IDS])).logits[0].numpy()
    bundle = lora_bundle("llama-gqa")
    be = OnnxRuntimeBackend(bundle, flavor="cpu", accuracy_level=0, lora=LoraSlotsConfig(1, 8))
    be.load_adapter(1, read_adapter(adapter, bundle.config, "a"))
    base_out = compute_logits(be, IDS, "prefill", adapter=0)
    assert rel_err(ref, base_out) > 0.05  # the adapter really changes the model
    assert rel_err(compute_logits(be, IDS, "prefill", adapter=1), ref) < 1e-4


def test_lora_graph_splits_name_their_sizes(lora_bundle):
    """A step with no adapter row binds the stack at width 0, and onnxruntime 1.20-1.23 refuse a Split by
    ``num_outputs`` of an empty dimension ('Invalid num_outputs value of 3. Size of dimension being split is 0'):
    every base-model request of `serve --lora-modules` failed there, on both flavors' LoRA graphs. Splits into
    sizes given as an input (the stack's width per part, computed once per step) take a width of 0 on every
    version."""
    import onnx

    bundle = lora_bundle("llama-gqa")
    for flavor in ("cpu", "trt"):
        g = onnx.load(bundle.file(bundle.flavor(flavor).lora_graph), load_external_data=False).graph
        splits = [n for n in g.node if n.op_type == "Split"]
        assert splits, flavor  # the fused q/k/v and gate/up sites
        for n in splits:
            assert len(n.input) == 2 and n.input[1] and not any(a.name == "num_outputs" for a in n.attribute), n.name
