"""GGUF files: HF names, un-permuted q/k (floats and GGML blocks), config synthesis, truncation."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from lineside.build.checkpoint import open_checkpoint
from lineside.build.checkpoint.gguf_names import permute_rows, unpermute_rows
from lineside.build.tensors import GGMLBlocks
from lineside.config import ModelConfig
from lineside.errors import CheckpointError
from tests.build.checkpoint.ckpt_gguf_writer import llama_permute, write_model_gguf
from tests.build.checkpoint.ckpt_helpers import needs_smollm2, smollm2_gguf

QTYPES = {
    "model.layers.0.self_attn.q_proj.weight": "Q4_0",
    "model.layers.0.self_attn.k_proj.weight": "Q4_1",
    "model.layers.1.self_attn.q_proj.weight": "Q8_0",
    "model.layers.1.self_attn.k_proj.weight": "Q8_0",
    "model.layers.0.mlp.up_proj.weight": "Q4_1",
    "model.embed_tokens.weight": "Q8_0",
    "model.layers.1.mlp.down_proj.weight": "F16",
}


def _hf_cfg(path):
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def llama_gguf(tiny_llama, tmp_path_factory):
    path, state = tiny_llama
    out = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_model_gguf(out, "llama", _hf_cfg(path), state, QTYPES)
    return out, state


def _qdq(a: np.ndarray, q: str) -> np.ndarray:
    if q == "F16":
        return a.astype(np.float16).astype(np.float32)
    t = GGMLQuantizationType[q]
    return dequantize(quantize(a, t), t).reshape(a.shape)


def test_permute_roundtrip():
    x = np.arange(8 * 64 * 3).reshape(8 * 64, 3)
    for heads in (1, 2, 8):
        np.testing.assert_array_equal(unpermute_rows(permute_rows(x, heads), heads), x)
        np.testing.assert_array_equal(permute_rows(x, heads), llama_permute(x, heads, None))


def test_llama_gguf_equals_hf(llama_gguf, tiny_llama):
    path, state = llama_gguf
    ck = open_checkpoint(path)
    assert sorted(ck.names()) == sorted(state)
    for name, want in state.items():
        assert ck.shape(name) == want.shape, name
        got = ck.get(name)
        assert got.dtype == np.float32
        q = QTYPES.get(name)
        if q is None:
            np.testing.assert_array_equal(got, want, err_msg=name)  # F32: exact, so un-permute is exact
        else:
            np.testing.assert_array_equal(got, _qdq(want, q), err_msg=name)


def test_gguf_blocks_unpermuted(llama_gguf):
    path, state = llama_gguf
    ck = open_checkpoint(path)
    for name, q in QTYPES.items():
        raw = ck.get_raw(name)
        if q == "F16":
            assert isinstance(raw, np.ndarray) and raw.dtype == np.float32
            continue
        assert isinstance(raw, GGMLBlocks), name
        assert raw.ggml_type == q and raw.shape == state[name].shape
        assert raw.data.dtype == np.uint8 and raw.data.shape[0] == state[name].shape[0]
        # Blocks run along in_features: quantizing the HF-layout weight gives the same bytes.
        want = quantize(state[name], GGMLQuantizationType[q])
        np.testing.assert_array_equal(raw.data, want.reshape(raw.data.shape), err_msg=name)


def test_gguf_config(llama_gguf, tiny_llama):
    path, _ = llama_gguf
    hf_path, _ = tiny_llama
    ck = open_checkpoint(path)
    got = ModelConfig.from_hf_dict(ck.hf_config)
    want = ModelConfig.from_hf_dict(_hf_cfg(hf_path))
    for f in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(got, f) == getattr(want, f), f
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert ck.hf_config["architectures"] == ["LlamaForCausalLM"]


def test_qwen2_gguf_not_permuted_and_tied(tiny_qwen2, tmp_path):
    path, state = tiny_qwen2
    out = tmp_path / "tiny-qwen2.gguf"
    write_model_gguf(out, "qwen2", _hf_cfg(path), state)
    ck = open_checkpoint(out)
    assert "lm_head.weight" not in ck.names()
    assert ck.hf_config["tie_word_embeddings"] is True
    cfg = ModelConfig.from_hf_dict(ck.hf_config)
    assert cfg.architecture == "qwen2" and cfg.attention_bias
    for name in ck.names():
        np.testing.assert_array_equal(ck.get(name), state[name], err_msg=name)


def test_truncated_gguf(llama_gguf, tmp_path):
    path, _ = llama_gguf
    data = path.read_bytes()
    for cut in (len(data) // 2, 200, len(data) - 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(bad)
        msg = str(e.value)
        assert "\n" not in msg and ("truncated" in msg or "corrupt" in msg), msg


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(p)
    assert "not a GGUF" in str(e.value)


def test_unsupported_arch(tmp_path, tiny_llama):
    path, state = tiny_llama
    out = tmp_path / "phi.gguf"
    write_model_gguf(out, "phi3", _hf_cfg(path), {})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(out)
    assert "phi3" in str(e.value) and "\n" not in str(e.value)


def test_no_tokenizer(llama_gguf, tmp_path):
    path, _ = llama_gguf
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path).write_tokenizer(tmp_path / "tok")
    assert "tokenizer" in str(e.value)


@pytest.fixture
def smollm2(smollm2_ck):
    return smollm2_ck


@needs_smollm2
def test_smollm2_names_shapes_config(smollm2):
    ck = smollm2
    names = ck.names()
    assert len(names) == 2 + 30 * 9  # embed + final norm, 9 per layer, tied head
    assert "lm_head.weight" not in names
    assert ck.shape("model.embed_tokens.weight") == (49152, 576)
    assert ck.shape("model.layers.0.self_attn.q_proj.weight") == (576, 576)
    assert ck.shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
    assert ck.shape("model.layers.29.mlp.down_proj.weight") == (576, 1536)
    cfg = ModelConfig.from_hf_dict(ck.hf_config)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.bos_token_id == 1
    assert 2 in cfg.eos_token_ids
    emb = ck.get_raw("model.embed_tokens.weight")
    assert isinstance(emb, GGMLBlocks) and emb.ggml_type == "Q8_0"
    q = ck.get_raw("model.layers.0.self_attn.q_proj.weight")
    assert isinstance(q, GGMLBlocks) and q.ggml_type == "Q4_1"
    assert ck.get("model.norm.weight").shape == (576,)


@needs_smollm2
def test_smollm2_qk_unpermuted(smollm2):
    """Un-permuting the Q4_1 blocks equals un-permuting the dequantized rows (3 KV heads)."""
    ck = smollm2
    name = "model.layers.3.self_attn.k_proj.weight"
    t = next(t for t in ck._reader.tensors if t.name == "blk.3.attn_k.weight")
    permuted = dequantize(t.data, t.tensor_type).reshape(192, 576)
    np.testing.assert_array_equal(ck.get(name), unpermute_rows(permuted, 3))
    np.testing.assert_array_equal(permute_rows(ck.get(name), 3), permuted)


@needs_smollm2
def test_smollm2_truncated(tmp_path):
    src = smollm2_gguf()
    bad = tmp_path / "half.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(src.stat().st_size // 2))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(bad)
    assert "truncated" in str(e.value) and "\n" not in str(e.value)



def test_split_gguf_refused(tmp_path, tiny_llama):
    import gguf

    path, _ = tiny_llama
    cfg = _hf_cfg(path)
    out = tmp_path / "m-00001-of-00002.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_uint16("split.count", 2)
    w.add_block_count(cfg["num_hidden_layers"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(out)
    assert "split" in str(e.value) and "\n" not in str(e.value)


def _llama3_rope_freqs(head_dim: int, theta: float, factor=8.0, low=1.0, high=4.0, orig=8192) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, in numpy."""
    import math

    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("params", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (4.0, 1.0, 4.0, 4096)])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, params):
    """Llama-3.x GGUFs carry rope scaling only as the rope_freqs tensor; the reader recovers the config."""
    import gguf

    out = tmp_path / "llama3.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for k, v in (("block_count", 1), ("context_length", 131072), ("embedding_length", 512),
                 ("feed_forward_length", 1024), ("attention.head_count", 4), ("attention.head_count_kv", 2)):
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_vocab_size(1000)
    w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(128, 500000.0, *params))
    w.add_tensor("output_norm.weight", np.ones(512, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ck = open_checkpoint(out)
    assert ck.names() == ["model.norm.weight"]  # rope_freqs has no HF tensor
    factor, low, high, orig = params
    assert ck.hf_config["rope_scaling"] == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }
    assert ModelConfig.from_hf_dict(ck.hf_config).rope_scaling["rope_type"] == "llama3"


def test_yarn_rope_scaling_from_metadata(tmp_path):
    import gguf

    out = tmp_path / "qwen2-yarn.gguf"
    w = gguf.GGUFWriter(str(out), "qwen2")
    for k, v in (("block_count", 1), ("context_length", 131072), ("embedding_length", 256),
                 ("feed_forward_length", 512), ("attention.head_count", 4), ("attention.head_count_kv", 2)):
        w.add_uint32(f"qwen2.{k}", v)
    w.add_vocab_size(1000)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(32768)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = ModelConfig.from_hf_dict(open_checkpoint(out).hf_config)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert cfg.architecture == "qwen2" and cfg.rope_theta == 10000.0


@pytest.mark.parametrize(("metadata", "want"), [
    ({"llama.rope.scaling.factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),  # no type: llama.cpp's "linear"
    ({"llama.rope.scale_linear": 4.0}, {"rope_type": "linear", "factor": 4.0}),  # the key older converters wrote
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 2.0}, None),  # "none" never scales
])
def test_linear_rope_scaling_as_llamacpp_reads_it(tmp_path, tiny_llama, metadata, want):
    """llama.cpp scales positions by 1/factor when a GGUF has rope.scaling.factor (or the older rope.scale_linear)
    whatever rope.scaling.type says, "linear" when it is missing, unless it is "none". Such a GGUF built with no
    rope_scaling: logits off by 1.7% at 40 tokens against llama.cpp's, more the longer the context."""
    path, state = tiny_llama
    out = tmp_path / "m.gguf"
    write_model_gguf(out, "llama", _hf_cfg(path), state, metadata=metadata)
    assert open_checkpoint(out).hf_config.get("rope_scaling") == want


def test_an_unknown_rope_scaling_type_is_refused_in_one_line(tmp_path, tiny_llama):
    """llama.cpp runs an unknown rope.scaling.type as linear; building it without scaling would be silently wrong."""
    path, state = tiny_llama
    out = tmp_path / "m.gguf"
    write_model_gguf(out, "llama", _hf_cfg(path), state,
                     metadata={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0})
    with pytest.raises(CheckpointError, match="rope.scaling.type 'longrope' is not supported") as e:
        open_checkpoint(out)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_rope_scaling_factor_without_type_matches_llamacpp(tmp_path, tiny_dense):
    """The bundle of a GGUF with only rope.scaling.factor computes llama.cpp's logits for it (float32 weights)."""
    from llama_cpp import Llama
    from safetensors.numpy import load_file

    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import open_bundle
    from lineside.runtime.generate import compute_logits
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
    from tests.build.models.test_build_summary import _tokenizer

    ck = tiny_dense("llama-gqa")
    cfg = _hf_cfg(ck)
    tok = _tokenizer()
    pad = cfg["vocab_size"] - len(tok["tokens"])  # llama.cpp wants one token per embedding row
    tok = {**tok, "tokens": [*tok["tokens"], *(f"[PAD{i}]" for i in range(pad))], "types": [*tok["types"], *[5] * pad]}
    out = tmp_path / "m.gguf"
    write_model_gguf(out, "llama", cfg, load_file(str(ck / "model.safetensors")), tokenizer=tok,
                     metadata={"llama.rope.scaling.factor": 4.0})
    ids = [int(i) for i in np.random.default_rng(0).integers(3, cfg["vocab_size"], 40)]
    llm = Llama(model_path=str(out), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(ids)
    ref = np.array(llm.scores[: len(ids)], dtype=np.float32)
    bundle = open_bundle(build_bundle(out, tmp_path / "b", BuildOptions(quant="fp32", max_seq_len=64)))
    got = compute_logits(OnnxRuntimeBackend(bundle, threads=1), ids, "prefill")
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert err < 2e-3, err  # llama.cpp keeps its KV cache in float16 (3e-4 here); unscaled positions: 1.7e-2


@pytest.mark.parametrize(("key", "add", "value", "match"), [
    # hidden // heads: ZeroDivisionError
    ("llama.attention.head_count", "add_uint32", 0, "'num_attention_heads' must be a positive integer, got 0"),
    # "64" // 4: TypeError
    ("llama.embedding_length", "add_string", "64", "llama.embedding_length is '64', not a non-negative integer"),
    ("llama.feed_forward_length", "add_int32", -96, "llama.feed_forward_length is -96, not a non-negative integer"),
    ("llama.block_count", "add_array", [2, 2], "llama.block_count is [2, 2], not a non-negative integer"),
])
def test_a_size_that_is_not_a_positive_integer_is_one_line(tmp_path, tiny_llama, key, add, value, match):
    """A GGUF from elsewhere with absurd metadata: one line naming the key, not a traceback."""
    import gguf

    cfg = _hf_cfg(tiny_llama[0])
    sizes = {"llama.block_count": cfg["num_hidden_layers"], "llama.embedding_length": cfg["hidden_size"],
             "llama.feed_forward_length": cfg["intermediate_size"],
             "llama.attention.head_count": cfg["num_attention_heads"]}
    out = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for k, v in sizes.items():
        if k == key:
            getattr(w, add)(k, value)
        else:
            w.add_uint32(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from lineside.errors import LinesideError

    with pytest.raises(LinesideError, match=re.escape(match)) as e:
        ModelConfig.from_hf_dict(open_checkpoint(out).hf_config)
    assert "\n" not in str(e.value)


def test_a_block_count_beyond_the_tensors_is_refused_before_listing_them(tmp_path, tiny_llama):
    """block_count 2**31 made the build list nine tensor names per layer (minutes, gigabytes) before saying one was
    missing; a config with more layers than the checkpoint has tensors is refused at once."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    path, state = tiny_llama
    out = tmp_path / "huge.gguf"
    write_model_gguf(out, "llama", {**_hf_cfg(path), "num_hidden_layers": 100_000}, state)
    with pytest.raises(CheckpointError, match="the config has 100000 layers but the checkpoint holds 21 tensors") as e:
        build_bundle(out, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=32))
    assert "\n" not in str(e.value) and not (tmp_path / "b").exists()


def test_a_tensor_disagreeing_with_the_gguf_metadata_names_the_metadata(tmp_path, tiny_llama):
    """A GGUF whose vocabulary size disagrees with its token_embd rows was told "the checkpoint and its config.json
    disagree": a GGUF has no config.json to look at; the line says the GGUF's metadata."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    path, state = tiny_llama
    cfg = _hf_cfg(path)
    out = tmp_path / "m.gguf"
    write_model_gguf(out, "llama", {**cfg, "vocab_size": cfg["vocab_size"] - 7}, state)
    with pytest.raises(CheckpointError) as e:
        build_bundle(out, tmp_path / "b", BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=32))
    msg = str(e.value)
    assert "'model.embed_tokens.weight'" in msg and "GGUF metadata" in msg and "config.json" not in msg, msg
    assert "\n" not in msg and not (tmp_path / "b").exists()


@pytest.mark.parametrize(("writer_method", "key"), [
    ("add_layer_norm_rms_eps", "llama.attention.layer_norm_rms_epsilon"),
    ("add_context_length", "llama.context_length"),
])
def test_a_build_refuses_a_gguf_without_what_llamacpp_requires(tmp_path, tiny_llama, monkeypatch, writer_method, key):
    """llama.cpp refuses a llama/qwen2 GGUF without its RMSNorm epsilon or trained context. The build stood 1e-6 in
    for the epsilon (a 1e-5 model's logits 0.9% off, silently) and 4096 for the context; now one line naming the
    key, before any work. Opening the file (tokenizer, sizes) still works."""
    import gguf

    from lineside.build.pipeline import BuildOptions, build_bundle

    path, state = tiny_llama
    cfg = {**_hf_cfg(path), "rms_norm_eps": 1e-5}  # Llama-2's; the stand-in was 1e-6
    out = tmp_path / "m.gguf"
    monkeypatch.setattr(gguf.GGUFWriter, writer_method, lambda self, *a, **k: None)
    write_model_gguf(out, "llama", cfg, state)
    monkeypatch.undo()
    assert open_checkpoint(out).meta(key) is None
    with pytest.raises(CheckpointError) as e:
        build_bundle(out, tmp_path / "b", BuildOptions(quant="fp32", max_seq_len=16))
    msg = str(e.value)
    assert "\n" not in msg and key in msg and "missing" in msg, msg
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


@pytest.mark.parametrize(("family", "key", "value"), [
    ("qwen2", "rope.dimension_count", 8),  # llama.cpp's qwen2 rotates 8 of each head's 16 dims; lineside all 16
    ("llama", "rope.dimension_count", 8),  # llama.cpp refuses this one ("invalid n_rot")
    ("qwen2", "attention.value_length", 32),  # values wider than keys: one head_dim cannot hold both
])
def test_heads_lineside_cannot_build_as_the_gguf_says_are_refused_in_one_line(tmp_path, tiny_llama, tiny_qwen2,
                                                                              family, key, value):
    """A GGUF rotating part of each head (rope.dimension_count below the head width) built with exit 0 into a bundle
    rotating whole heads, off from llama.cpp's logits without a word; the build names the key and stops first."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    path, state = tiny_llama if family == "llama" else tiny_qwen2
    out = tmp_path / "m.gguf"
    write_model_gguf(out, family, _hf_cfg(path), state, metadata={f"{family}.{key}": value})
    assert open_checkpoint(out).hf_config["head_dim"] == 16  # opening it (tokenizer, sizes) still works
    with pytest.raises(CheckpointError) as e:
        build_bundle(out, tmp_path / "b", BuildOptions(quant="fp32", max_seq_len=16))
    msg = str(e.value)
    assert "\n" not in msg and f"{family}.{key} is {value}" in msg and "16 wide" in msg, msg
    assert not (tmp_path / "b").exists()


def test_the_gguf_head_dimension_counts_it_writes_build(tmp_path, tiny_dense):
    """convert_hf_to_gguf.py writes rope.dimension_count = key_length = value_length = head_dim: those build."""
    from lineside.build.pipeline import BuildOptions, build_bundle
    from tests.build.models.test_build_summary import _tokenizer

    ck = tiny_dense("llama-gqa")
    out = tmp_path / "m.gguf"
    meta = {f"llama.{k}": 16 for k in ("rope.dimension_count", "attention.key_length", "attention.value_length")}
    write_model_gguf(out, "llama", _hf_cfg(ck), load_file(str(ck / "model.safetensors")), tokenizer=_tokenizer(),
                     metadata=meta)
    assert build_bundle(out, tmp_path / "b", BuildOptions(quant="fp32", max_seq_len=16)).is_dir()


def test_more_tokens_than_embedding_rows_is_refused_in_one_line(tmp_path, tiny_dense):
    """A token list longer than token_embd built (vocab_size from the metadata) and the tokenizer then gave ids with
    no embedding row: a prompt holding one failed at serve time. llama.cpp refuses the file; so does the build."""
    from lineside.build.pipeline import BuildOptions, build_bundle
    from tests.build.models.test_build_summary import _tokenizer

    ck = tiny_dense("llama-gqa")
    state = load_file(str(ck / "model.safetensors"))
    rows = state["model.embed_tokens.weight"].shape[0]
    tok = _tokenizer()
    extra = rows + 3 - len(tok["tokens"])
    tok["tokens"] += [f"<extra_{i}>" for i in range(extra)]
    tok["types"] += [4] * extra
    out = tmp_path / "m.gguf"
    write_model_gguf(out, "llama", _hf_cfg(ck), state, tokenizer=tok)
    with pytest.raises(CheckpointError) as e:
        build_bundle(out, tmp_path / "b", BuildOptions(quant="fp32", max_seq_len=16))
    msg = str(e.value)
    assert "\n" not in msg and f"{rows + 3} tokens" in msg and f"{rows} rows" in msg, msg
    assert f"ids {rows}..{rows + 2}" in msg and not (tmp_path / "b").exists()
