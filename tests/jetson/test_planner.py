"""Planner numbers against hand-computed values for the shipped configs, and against transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lineside.bundle import Manifest, write_manifest
from lineside.config import ModelConfig
from lineside.errors import LinesideError
from lineside.jetson.devices import DEVICES, device_for_board
from lineside.jetson.planner import CONFIGS_DIR, fit_table, load_model, plan, shipped_configs
from lineside.jetson.sizes import check_kv_dtype, dense_weights
from lineside.jetson.sizes_v4 import V4Shape, v4_kv, v4_weights

GIB = 1 << 30


def lin4(k: int, n: int) -> int:
    """Hand rule: 4 bits per weight + one fp16 scale per 128 input rows."""
    return k * n // 2 + (k // 128) * n * 2


# Hand-computed weights (bytes). Linears per layer: q (h x H*hd), k, v (h x KV*hd), o, gate, up (h x I),
# down (I x h); Qwen2 adds q/k/v biases (fp16); norms 2h per layer + h; embedding vocab x h fp16; the
# LM head vocab x h fp16 in fp16 builds (untied) but INT8 + one fp16 scale per row in W4A16/W8A16
# builds (what the builder keeps). E.g. R1-Distill-Qwen-1.5B w4a16:
#   per layer: lin4(1536,1536)*2 + lin4(1536,256)*2 + lin4(1536,8960)*2 + lin4(8960,1536) = 24,127,488
#   x 28 = 675,569,664; biases (1536+512)*2*28 = 114,688; norms (2*1536*28+1536)*2 = 175,104;
#   embedding 151936*1536*2 = 466,747,392; head 151936*1536 + 151936*2 = 233,677,568;
#   total 1,376,284,416.
DENSE_WEIGHTS = {
    ("DeepSeek-R1-Distill-Qwen-1.5B", "w4a16"): 1_376_284_416,
    ("DeepSeek-R1-Distill-Qwen-1.5B", "fp16"): 3_554_176_000,
    ("DeepSeek-R1-Distill-Qwen-7B", "w4a16"): 5_000_564_736,
    ("DeepSeek-R1-Distill-Qwen-14B", "w4a16"): 9_150_155_776,
    ("DeepSeek-R1-Distill-Qwen-32B", "w4a16"): 18_428_644_352,
    ("DeepSeek-R1-Distill-Qwen-32B", "w8a16"): 34_031_455_232,
    ("DeepSeek-R1-Distill-Llama-8B", "w4a16"): 5_175_511_552,
    ("DeepSeek-R1-Distill-Llama-8B", "fp16"): 16_060_522_496,  # 8.03B params x 2 bytes
}


def test_shipped_configs_are_the_seven_models():
    assert shipped_configs() == sorted([
        "DeepSeek-R1-Distill-Qwen-1.5B", "DeepSeek-R1-Distill-Qwen-7B", "DeepSeek-R1-Distill-Qwen-14B",
        "DeepSeek-R1-Distill-Qwen-32B", "DeepSeek-R1-Distill-Llama-8B", "DeepSeek-V4-Flash", "DeepSeek-V4-Pro",
    ])


@pytest.mark.parametrize(("model", "quant"), list(DENSE_WEIGHTS))
def test_dense_weights_match_hand_computation(model, quant):
    p = plan(model, "agx-orin-64", quant, ctx=4096, batch=1)
    assert p.weights_bytes == DENSE_WEIGHTS[(model, quant)]
    assert p.weights_breakdown["embedding"] + p.weights_breakdown["lm_head"] > 0  # fp16, said in notes
    assert any("stay fp16" in n for n in p.notes)


def test_dense_kv_formula():
    # 2 x layers x kv_heads x (head_dim x bytes + scale bytes) x ctx x batch
    assert plan("DeepSeek-R1-Distill-Qwen-1.5B", "orin-nano-8", ctx=4096).kv_cache_bytes == 2 * 28 * 2 * 128 * 2 * 4096
    p = plan("DeepSeek-R1-Distill-Qwen-32B", "h100-80", "w4a16", ctx=32768, batch=4, kv_dtype="int8")
    assert p.kv_cache_bytes == 2 * 64 * 8 * (128 * 1 + 2) * 32768 * 4  # one fp16 scale per (token, head)
    p = plan("DeepSeek-R1-Distill-Llama-8B", "h100-80", ctx=131072, kv_dtype="fp8")
    assert p.kv_cache_bytes == 2 * 32 * 8 * (128 * 1 + 2) * 131072
    with pytest.raises(LinesideError, match=r"AGX Orin.*has no FP8; use --kv-dtype int8"):
        plan("DeepSeek-R1-Distill-Llama-8B", "agx-orin-64", kv_dtype="fp8")
    with pytest.raises(LinesideError, match="DeepSeek-V4 graphs store no fp8 state"):
        plan("DeepSeek-V4-Flash", "h100-80", kv_dtype="fp8")
    p = plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", ctx=12288, kv_dtype="int4")  # two values per byte
    # + an fp16 scale and an fp16 minimum per 16 values: 96 bytes per head vector, 0.375x fp16's 256; and the
    # sequence's first 4 entries once more in fp16 (256 bytes per head vector, once per sequence)
    assert p.kv_cache_bytes == 2 * 28 * 4 * ((128 // 2 + 2 * 2 * 128 // 16) * 12288 + 4 * 2 * 128)
    from lineside.build.quant.kv import check_kv_flavors, parse_kv_dtype

    try:  # a plan the builder cannot make yet says so; once it can, no such note
        check_kv_flavors(parse_kv_dtype("int4"), ("trt",))
        buildable = True
    except LinesideError:
        buildable = False
    assert any("--kv-dtype int4` refuses this cache" in n for n in p.notes) is not buildable
    assert not any("refuses this cache" in n for n in plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8").notes)
    with pytest.raises(LinesideError, match="unknown KV dtype 'int4'; choose one of: fp16, int8, fp8"):
        check_kv_dtype("int4", external=True)  # no datacenter engine stores a 4-bit cache


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4"])
def test_planner_kv_bytes_are_the_emitters_state_bytes(tiny_bundles, kv):
    """Bytes per token of every append state the trt graph declares (the runtime's arena) == the planner's."""
    from lineside.build.quant.kv import check_kv_flavors, parse_kv_dtype
    from lineside.bundle import open_bundle
    from lineside.jetson.planner import _spec_from_config
    from lineside.runtime.tensorrt.buffers import plan_buffers

    try:
        check_kv_flavors(parse_kv_dtype(kv), ("trt",))
    except LinesideError as e:  # int4 until the builder emits it; then this ties the planner to it
        pytest.skip(f"the builder refuses --kv-dtype {kv}: {e}")

    b = open_bundle(tiny_bundles(quant="fp16", flavors=("trt",), max_seq_len=64, group_size=64, kv_dtype=kv))
    bp = plan_buffers(b.flavor("trt").state, b.config, num_slots=1, max_seq=64, max_prefill=8, max_logits=1,
                      vocab=b.config.vocab_size, input_names=list(b.flavor("trt").inputs))
    arena = sum(s.nbytes for s in bp.buffers.values() if s.role == "arena")
    spec = _spec_from_config(b.config)
    assert spec.kv(64, 1, check_kv_dtype(kv)).total == arena  # 64 positions of one sequence
    # and per state: the values (kv_layout's packed bytes per head vector) and the scales beside them, per token;
    # int4's fp16 first entries (K's heads and V's) once per sequence
    from lineside.graph_io import StateUpdate
    from lineside.kv_layout import KV_LAYOUTS

    lay, d = KV_LAYOUTS[kv], b.config.head_dim
    rows = {(st.dtype.name, st.inner * st.dtype.itemsize) for st in bp.states if st.update == StateUpdate.APPEND}
    assert rows == ({("float16", 2 * d)} if kv == "fp16" else
                    {("uint8", lay.value_bytes(d)), ("float16", lay.scales(d) * lay.scale_bytes)})
    sinks = {(st.dtype.name, st.inner * st.dtype.itemsize) for st in bp.states if st.update == StateUpdate.PREFIX}
    kvh = b.config.num_kv_heads
    assert sinks == ({("float16", 2 * kvh * lay.sink_bytes(d))} if lay.sink else set())
    assert len([st for st in bp.states if st.update == StateUpdate.PREFIX]) == (b.config.num_layers if lay.sink else 0)


def test_kv_layouts_are_the_builders_kv_formats():
    """The planner's and the gauges' table (kv_layout.py) == the builder's formats: bits per value and scales."""
    from lineside.build.quant.kv import FORMATS
    from lineside.kv_layout import KV_LAYOUTS

    assert FORMATS  # int8 at least
    for kv, fmt in FORMATS.items():
        lay = KV_LAYOUTS[kv.value]
        assert lay.value_bits == 8 // getattr(fmt, "pack", 1)
        assert lay.scale_group == getattr(fmt, "group", 0)
        assert lay.per_group == fmt.per_group
        assert lay.sink == fmt.sink
        assert lay.scale_bytes == np.dtype(fmt.scale_dtype).itemsize
        for d in (16, 64, 128, 512):  # the builder's scales per head vector, where it has the rule
            assert lay.scales(d) == fmt.scale_state_dim(d)


def test_v4_planner_int4_bytes_are_the_emitters_state_bytes():
    """As below for --kv-dtype int4, once the builder emits it (its format passed to the V4 state list)."""
    import math

    from lineside.build.models.deepseek_v4 import parse_config, state_tensors
    from lineside.build.quant.kv import FORMATS, KvDtype, check_kv_flavors
    from lineside.runtime.tensorrt.buffers import np_dtype

    try:
        check_kv_flavors(KvDtype.INT4, ("trt",))
    except LinesideError as e:
        pytest.skip(f"the builder refuses --kv-dtype int4: {e}")
    raw = json.loads((CONFIGS_DIR / "DeepSeek-V4-Flash" / "config.json").read_text())
    states = state_tensors(parse_config(raw), 8192, fmt=FORMATS[KvDtype.INT4])
    emitted = sum(math.prod(1 if d == "batch" else d for d in st.shape) * np_dtype(st.dtype).itemsize
                  for st in states)
    assert v4_kv(V4Shape.from_raw(raw), 8192, 1, check_kv_dtype("int4")).total == emitted


def test_v4_flash_weights_by_component():
    h, q_lora, heads, hd, og, ol, inter, experts, vocab = 4096, 1024, 64, 512, 8, 1024, 2048, 256, 129280
    base = lin4(h, q_lora) + lin4(q_lora, heads * hd) + lin4(h, hd) + og * lin4(heads * hd // og, ol) + lin4(og * ol, h)
    csa = 2 * lin4(h, 2 * hd) + 2 * lin4(h, 2 * 128) + lin4(q_lora, 64 * 128) + lin4(h, 64)
    hca = 2 * lin4(h, hd)
    p = plan("DeepSeek-V4-Flash", "h100-80", "w4a16", ctx=4096)
    b = p.weights_breakdown
    assert b["routed_experts"] == 43 * experts * (lin4(h, 2 * inter) + lin4(inter, h)) == 142_841_217_024
    assert b["shared_experts"] == 43 * (2 * lin4(h, inter) + lin4(inter, h))
    assert b["attention"] == 43 * base + 21 * csa + 20 * hca  # 2 sliding, 21 CSA, 20 HCA layers
    assert b["embedding"] == vocab * h * 2 and b["lm_head"] == vocab * h + vocab * 2  # INT8 head, fp16 scales
    assert b["router"] == 43 * experts * h * 2
    assert b["hash_tables"] == 3 * vocab * 6 * 4
    assert p.weights_bytes == 147_852_428_124  # ~138 GiB: no Jetson holds V4-Flash
    assert not p.fits and p.max_context_at_batch == 0


def test_v4_flash_kv_at_one_million_tokens():
    ctx = 1 << 20
    p = plan("DeepSeek-V4-Flash", "h100-80", "w4a16", ctx=ctx)
    kv = p.kv_breakdown
    # float32, as the V4 graph stores its state; +1: the open compressed window
    assert kv["window"] == 43 * 128 * 512 * 4  # every layer keeps a 128-token window, one KV head, K = V
    assert kv["compressed"] == 21 * (ctx // 4 + 1) * 512 * 4 + 20 * (ctx // 128 + 1) * 512 * 4
    assert kv["indexer_keys"] == 21 * (ctx // 4 + 1) * 128 * 4
    assert 13 * GIB < p.kv_cache_bytes < 14 * GIB  # 13.5 GiB for 1M tokens (a dense 8B model needs 128 GiB)
    q = plan("DeepSeek-V4-Flash", "h100-80", "w4a16", ctx=ctx, kv_dtype="int8").kv_breakdown
    assert q["window"] == 43 * 128 * (512 + 2) and q["indexer_keys"] == kv["indexer_keys"]


def test_v4_pro_layer_types_match_transformers():
    transformers = pytest.importorskip("transformers")
    for name in ("DeepSeek-V4-Flash", "DeepSeek-V4-Pro"):
        raw = json.loads((CONFIGS_DIR / name / "config.json").read_text())
        ref = transformers.DeepseekV4Config(**raw)
        s = V4Shape.from_raw(raw)
        assert s.layer_types == list(ref.layer_types)
        assert s.mlp_types == list(ref.mlp_layer_types)
        assert s.rates == dict(ref.compress_rates)


def _param_bytes(model, fp16_names=("embed_tokens", "lm_head", "mlp.gate.weight")) -> int:
    """Bytes of every parameter / persistent buffer with the planner's dtype rules in the fp32 scheme."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "rotary" in name or "inv_freq" in name:
            continue
        total += t.numel() * (2 if any(k in name for k in fp16_names) else 4)
    return total


def test_v4_weight_count_matches_transformers_module_tree():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 320,
           "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
           "head_dim": 32, "q_lora_rank": 48, "o_groups": 2, "o_lora_rank": 24, "n_routed_experts": 6,
           "num_experts_per_tok": 2, "index_n_heads": 3, "index_head_dim": 16, "index_topk": 4,
           "sliding_window": 8, "compress_ratios": [0, 4, 128, 4, 128], "num_hash_layers": 2}
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**raw))
    assert v4_weights(V4Shape.from_raw(raw), "fp32").total == _param_bytes(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_weight_count_matches_transformers(arch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = {"model_type": arch, "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
         "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    conf = transformers.LlamaConfig(**d) if arch == "llama" else transformers.Qwen2Config(**d)
    with torch.device("meta"):
        model = cls(conf)
    n = sum(t.numel() for name, t in model.named_parameters())
    assert dense_weights(ModelConfig.from_hf_dict(d), "fp16").total == 2 * n


def test_totals_and_max_context_are_consistent():
    p = plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", "w4a16", ctx=8192, batch=1, prefill_chunk=512)
    assert p.total_bytes == p.weights_bytes + p.kv_cache_bytes + p.activation_bytes + p.runtime_overhead_bytes
    assert p.device_bytes == DEVICES["orin-nano-8"].usable_bytes and p.unified_memory
    assert not p.fits and not p.prefill_chunk_picked and p.engine_args == "--slots 1 --max-prefill 512"
    best = p.max_context_at_batch
    assert 0 < best < 8192
    assert plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", ctx=best, prefill_chunk=512).fits
    assert not plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", ctx=best + 1, prefill_chunk=512).fits
    # int8 KV halves the cache and lets a longer context fit
    assert plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", ctx=8192, kv_dtype="int8",
                prefill_chunk=512).max_context_at_batch > best


def test_prefill_chunk_is_picked_when_not_pinned():
    """Unpinned, the plan takes the largest chunk of PREFILL_CHUNKS that fits and says how to build it."""
    from lineside.jetson.planner import PREFILL_CHUNKS

    p = plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", ctx=12288, kv_dtype="int8")  # issue 17's target
    assert p.fits and p.prefill_chunk_picked and p.prefill_chunk == 256
    assert p.engine_args == "--slots 1 --max-prefill 256"
    assert not plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", ctx=12288, kv_dtype="int8", prefill_chunk=512).fits
    assert p.to_dict() == plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", ctx=12288, kv_dtype="int8",
                               prefill_chunk=256).to_dict() | {"prefill_chunk_picked": True,
                                                               "max_context_at_batch": p.max_context_at_batch,
                                                               "max_batch_at_context": p.max_batch_at_context,
                                                               "notes": p.notes}
    # the largest context is the smallest chunk's, and the chunk picked there is named
    small = plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", ctx=12288, kv_dtype="int8",
                 prefill_chunk=PREFILL_CHUNKS[-1])
    assert p.max_context_at_batch == small.max_context_at_batch > 12288
    assert any(f"({p.max_context_at_batch}) is planned at prefill chunk" in n for n in p.notes)
    # short contexts keep the engine's default chunk (clipped to the context in the engine options)
    q = plan("DeepSeek-R1-Distill-Qwen-1.5B", "agx-orin-64", ctx=300)
    assert q.prefill_chunk == PREFILL_CHUNKS[0] and q.engine_args == "--slots 1 --max-prefill 300"
    # nothing fits: reported at the default chunk
    assert plan("DeepSeek-R1-Distill-Qwen-32B", "orin-nano-8").prefill_chunk == PREFILL_CHUNKS[0]


def test_logits_counted_as_the_tensorrt_backend_allocates_them():
    """The planner's logits term is the backend's float32 logits buffer at the engine's derived max_logits."""
    from lineside.build.tensorrt.profiles import derive_limits
    from lineside.config import ModelConfig
    from lineside.jetson.planner import CONFIGS_DIR
    from lineside.jetson.sizes import logits_buffer
    from lineside.runtime.tensorrt.buffers import plan_buffers

    cfg = ModelConfig.from_hf_dict(json.loads((CONFIGS_DIR / "DeepSeek-R1-Distill-Qwen-7B" / "config.json")
                                              .read_text()))
    for slots, chunk in ((1, 256), (1, 512), (4, 512)):
        lim = derive_limits(4096, cfg.vocab_size, slots, chunk)
        bp = plan_buffers([], cfg, num_slots=slots, max_seq=4096, max_prefill=lim.max_prefill,
                          max_logits=lim.max_logits, vocab=cfg.vocab_size, input_names=[])
        assert logits_buffer(slots, chunk, cfg.vocab_size) == bp.buffers["logits"].nbytes


def test_model_forms_checkpoint_bundle_and_config(tmp_path):
    raw = json.loads((CONFIGS_DIR / "DeepSeek-R1-Distill-Qwen-1.5B" / "config.json").read_text())
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(raw))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(ModelConfig.from_hf_dict(raw, name="r1-1.5b").to_json())
    write_manifest(bundle, Manifest(architecture="qwen2", config="config.json", max_seq_len=4096,
                                    flavors={}, quantization={"scheme": "w8a16"}))
    expected = plan("DeepSeek-R1-Distill-Qwen-1.5B", "l4-24", "w4a16").weights_bytes
    assert plan(str(ckpt), "l4-24", "w4a16").weights_bytes == expected
    assert plan(str(ckpt / "config.json"), "l4-24", "w4a16").weights_bytes == expected
    assert plan(str(bundle), "l4-24", "w4a16").weights_bytes == expected
    assert plan(str(bundle), "l4-24").quant == "w8a16"  # the bundle's own scheme by default
    # the bundle's manifest.json named instead of its directory: was read as a model config, a TypeError traceback
    assert plan(str(bundle / "manifest.json"), "l4-24").weights_bytes == plan(str(bundle), "l4-24").weights_bytes
    part = tmp_path / "part.json"  # a lineside config missing fields
    part.write_text(json.dumps({"architecture": "llama", "hidden_size": 64}))
    with pytest.raises(LinesideError, match=r"part.json: .*vocab_size") as e:
        plan(str(part), "l4-24")
    assert "\n" not in str(e.value)
    assert load_model("deepseek-ai/DeepSeek-V4-Flash").architecture == "deepseek_v4"
    v4 = json.loads((CONFIGS_DIR / "DeepSeek-V4-Flash" / "config.json").read_text())
    vb = tmp_path / "v4bundle"
    vb.mkdir()
    (vb / "config.json").write_text(ModelConfig.from_hf_dict(v4, name="v4").to_json())  # raw kept inside
    write_manifest(vb, Manifest(architecture="deepseek_v4", config="config.json", max_seq_len=4096, flavors={}))
    assert plan(str(vb), "h100-80", "w4a16").weights_bytes == 147_852_428_124


def test_user_errors_are_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    for call in (lambda: plan("no-such-model", "agx-orin-64"),
                 lambda: plan("DeepSeek-V4-Flash", "jetson-tx2"),
                 lambda: plan("DeepSeek-V4-Flash", "h100-80", "int3"),
                 lambda: plan("DeepSeek-V4-Flash", "h100-80", kv_dtype="bf8"),
                 lambda: plan(str(bad), "h100-80")):
        with pytest.raises(LinesideError) as e:
            call()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("group_size", [1, 7, 100, 100000])
def test_a_group_size_build_cannot_make_is_refused(group_size):
    # `build --group-size` takes a power of two >= 16; the planner sized any count (7: "FITS", a grid no bundle has)
    with pytest.raises(LinesideError, match=rf"--group-size {group_size}: .*power of two"):
        plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", group_size=group_size)
    assert plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8", group_size=32).fits


def test_fit_table_and_board_mapping():
    table = fit_table(["orin-nano-8", "agx-orin-64"])
    lines = table.splitlines()
    assert lines[0].startswith("| model |") and len(lines) == 2 + 7
    row = next(line for line in lines if line.startswith("| DeepSeek-R1-Distill-Qwen-1.5B |"))
    assert row.count("yes") == 2
    row = next(line for line in lines if line.startswith("| DeepSeek-V4-Flash |"))
    assert "yes" not in row
    assert device_for_board("NVIDIA Jetson AGX Orin Developer Kit", 64335836 * 1024) == "agx-orin-64"
    assert device_for_board("NVIDIA Jetson AGX Orin", 30 * GIB) == "agx-orin-32"
    assert device_for_board("NVIDIA Jetson Orin Nano Developer Kit", 7802756 * 1024) == "orin-nano-8"
    assert device_for_board("OptiPlex", 32 * GIB) is None
    with pytest.raises(LinesideError, match="the table names no device"):  # `--devices ""` was a traceback
        fit_table([])


def test_v4_kv_without_compression_is_window_only():
    s = V4Shape.from_raw({"num_hidden_layers": 2, "compress_ratios": [0, 0], "sliding_window": 16})
    assert v4_kv(s, 1000, 3, check_kv_dtype("fp16")).total == 3 * 2 * 16 * 512 * 4  # float32, as emitted
    assert v4_kv(s, 1000, 3, check_kv_dtype("int8")).total == 3 * 2 * 16 * (512 + 2)


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_v4_planner_bytes_are_the_emitters_state_bytes(kv):
    """V4-Flash's state tensors as the V4 emitter declares them (shapes and dtypes) == the planner's bytes."""
    import math

    from lineside.build.models.deepseek_v4 import parse_config, state_tensors
    from lineside.build.quant.kv import FORMATS, KvDtype
    from lineside.runtime.tensorrt.buffers import np_dtype

    raw = json.loads((CONFIGS_DIR / "DeepSeek-V4-Flash" / "config.json").read_text())
    states = state_tensors(parse_config(raw), 8192, fmt=FORMATS.get(KvDtype(kv)))
    emitted = sum(math.prod(1 if d == "batch" else d for d in st.shape) * np_dtype(st.dtype).itemsize
                  for st in states)
    assert {st.dtype for st in states} == ({"float32"} if kv == "fp16" else {"float32", "uint8", "float16"})
    assert v4_kv(V4Shape.from_raw(raw), 8192, 1, check_kv_dtype(kv)).total == emitted


def test_docs_tables_match_the_planner():
    import re
    from pathlib import Path

    from lineside.jetson.devices import TABLE_DEVICES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "jetson.md").read_text()
    tables = dict(re.findall(r"<!-- table:(\S+) -->\n(.*?)\n<!-- /table -->", doc, re.S))
    assert tables["w4a16-4096"] == fit_table(list(TABLE_DEVICES), "w4a16", 4096, 1, "fp16")
    assert tables["w4a16-32768-int8"] == fit_table(list(TABLE_DEVICES), "w4a16", 32768, 1, "int8")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = dict(re.findall(r"<!-- table:(\S+) -->\n(.*?)\n<!-- /table -->", readme, re.S))["readme"]
    assert table == fit_table(list(TABLE_DEVICES), "w4a16", 4096, 1, "fp16", [("orin-nano-8", "int8")])
    assert "`lineside jetson table --kv-columns orin-nano-8:int8`" in readme


def test_lm_head_counted_as_the_builder_stores_it():
    """8-bit head in quantized builds (even when tied: an INT8 copy beside the fp16 embedding); fp16 head
    (none when tied) in fp16 builds; Llama's o_proj / MLP biases counted when configured."""
    base = dict(architecture="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=64)
    tied, untied = ModelConfig(**base, tie_word_embeddings=True), ModelConfig(**base)
    for cfg in (tied, untied):
        assert dense_weights(cfg, "w4a16").breakdown["lm_head"] == 1000 * 256 + 1000 * 2
        assert dense_weights(cfg, "w8a16").breakdown["lm_head"] == 1000 * 256 + 1000 * 2
    assert dense_weights(tied, "fp16").breakdown["lm_head"] == 0
    assert dense_weights(untied, "fp16").breakdown["lm_head"] == 1000 * 256 * 2
    biased = ModelConfig(**base, o_proj_bias=True, mlp_bias=True)
    extra = dense_weights(biased, "w4a16").breakdown["norms_biases"] - dense_weights(untied, "w4a16").breakdown[
        "norms_biases"]
    assert extra == (256 + 2 * 512 + 256) * 2 * 2  # o_proj h + gate/up 2i + down h, fp16, 2 layers
