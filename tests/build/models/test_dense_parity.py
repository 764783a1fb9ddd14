"""Dense graphs (cpu and trt flavors) against transformers in float32, prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lineside.bundle import open_bundle
from lineside.runtime.generate import compute_logits
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150, 61, 12, 200, 33]


def reference_logits(ckpt, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def built(tiny_bundles):
    cache = {}

    def get(variant, quant):
        key = (variant, quant)
        if key not in cache:
            cache[key] = open_bundle(tiny_bundles(variant=variant, quant=quant, flavors=("cpu", "trt"),
                                                  max_seq_len=64, group_size=64, accuracy_level=0))
        return cache[key]

    return get


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mqa-tied-llama3", "llama-headdim", "qwen2-bias-tied",
                                     "qwen2-yarn", "llama-bias"])
@pytest.mark.parametrize("quant,tol", [("fp32", 1e-4), ("fp16", 1e-2)])
def test_logits_match_transformers(built, tiny_dense, variant, quant, tol):
    ref = reference_logits(tiny_dense(variant), IDS)
    bundle = built(variant, quant)
    for flavor in ("cpu", "trt"):
        be = OnnxRuntimeBackend(bundle, flavor=flavor, accuracy_level=0)
        pre = compute_logits(be, IDS, "prefill")
        dec = compute_logits(be, IDS, "decode")
        assert pre.shape == ref.shape
        assert rel_err(pre, ref) < tol, (flavor, "prefill", rel_err(pre, ref))
        assert rel_err(dec, ref) < tol, (flavor, "decode", rel_err(dec, ref))
        assert rel_err(dec, pre) < max(tol, 1e-4), (flavor, "decode vs prefill")


def fake_quant_reference(ckpt, ids, group, flavor):
    """transformers with every linear fake-quantized to INT4, the head to int8 per channel, and the
    embedding table exactly as the graph stores it."""
    from transformers import AutoModelForCausalLM

    from lineside.build.graph.embedding import embedding_reference
    from lineside.build.quant.rtn import fake_quantize
    from lineside.build.quant.spec import QuantSpec

    spec = QuantSpec(scheme="w4a16", group_size=group)
    # The trt flavor stores fp16 scales (TensorRT computes in fp16); the cpu flavor float32 ones.
    sdt = np.float16 if flavor == "trt" else np.float32
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        head_w = model.lm_head.weight.detach().numpy().copy()
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight.copy_(torch.from_numpy(fake_quantize(mod.weight.numpy(), 4, group, sdt)))
        head_q = fake_quantize(head_w, 8, None, sdt)
        emb.copy_(torch.from_numpy(embedding_reference(emb.numpy().copy(), spec, flavor)))
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    return hidden @ head_q.T


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied", "llama-bias"])
def test_w4a16_graph_equals_fake_quantized_reference(built, tiny_dense, variant):
    """The INT4 graphs compute exactly what their quantized weights say, and drift from float is bounded."""
    ref = reference_logits(tiny_dense(variant), IDS)
    bundle = built(variant, "w4a16")
    for flavor in ("cpu", "trt"):
        ref_q = fake_quant_reference(tiny_dense(variant), IDS, group=64, flavor=flavor)
        be = OnnxRuntimeBackend(bundle, flavor=flavor, accuracy_level=0)
        out = compute_logits(be, IDS, "decode")
        assert rel_err(out, ref_q) < 2e-3, (flavor, rel_err(out, ref_q))
        assert rel_err(out, ref) < 0.35, (flavor, rel_err(out, ref))


def test_batched_decode_equals_single(built):
    """Two slots decoding different sequences in one batch match running them alone."""
    from lineside.runtime.backend import StepBatch

    bundle = built("llama-gqa", "fp32")
    for flavor in ("cpu", "trt"):
        be = OnnxRuntimeBackend(bundle, num_slots=3, flavor=flavor, accuracy_level=0)
        a, b = IDS[:6], IDS[3:12]
        be.forward(StepBatch.single(0, a, 0))
        be.forward(StepBatch.single(2, b, 0))
        step = StepBatch(slots=[0, 2], input_ids=np.array([[7], [9]]), past_lengths=np.array([len(a), len(b)]),
                         new_lengths=np.array([1, 1]), logits_positions=np.zeros((2, 1), dtype=np.int64))
        both = be.forward(step)[:, 0]
        single = OnnxRuntimeBackend(bundle, flavor=flavor, accuracy_level=0)
        ra = compute_logits(single, a + [7], "prefill")[-1]
        rb = compute_logits(single, b + [9], "prefill")[-1]
        assert rel_err(both[0], ra) < 1e-4 and rel_err(both[1], rb) < 1e-4, flavor


def test_chunked_prefill_equals_one_prefill(built):
    """Prefill in chunks through the cache (past > 0 and several new tokens) equals one prefill."""
    from lineside.runtime.backend import StepBatch

    bundle = built("qwen2-bias-tied", "fp32")
    for flavor in ("cpu", "trt"):
        be = OnnxRuntimeBackend(bundle, flavor=flavor, accuracy_level=0)
        ref = compute_logits(be, IDS, "prefill")
        be.reset_slot(0)
        parts = [be.forward(StepBatch.single(0, IDS[a:b], a, all_logits=True))[0]
                 for a, b in ((0, 5), (5, 6), (6, 14))]
        assert rel_err(np.concatenate(parts), ref) < 1e-5, flavor
