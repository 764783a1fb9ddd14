"""Hugging Face directories: names, shapes, values, dtypes, sharding and one-line errors."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lineside.build.checkpoint import CheckpointReader, open_checkpoint
from lineside.config import ModelConfig
from lineside.errors import CheckpointError
from tests.conftest import DENSE_VARIANTS


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    return msg


def test_llama_round_trip(tiny_llama):
    path, state = tiny_llama
    ck = open_checkpoint(path)
    assert isinstance(ck, CheckpointReader)
    assert sorted(ck.names()) == sorted(state)
    for name, want in state.items():
        assert ck.has(name)
        assert ck.shape(name) == want.shape
        got = ck.get(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    assert not ck.has("model.layers.9.self_attn.q_proj.weight")
    cfg = ModelConfig.from_hf_dict(ck.hf_config)
    assert (cfg.architecture, cfg.num_layers, cfg.num_kv_heads) == ("llama", 2, 2)
    ck.close()


def test_sharded_equals_single(tiny_llama, tiny_llama_sharded):
    path, state = tiny_llama
    files = list(tiny_llama_sharded.glob("*.safetensors"))
    assert len(files) > 1
    ck = open_checkpoint(tiny_llama_sharded)
    assert sorted(ck.names()) == sorted(state)
    for name, want in state.items():
        np.testing.assert_array_equal(ck.get(name), want)


def test_qwen2_bias_and_tied(tiny_qwen2):
    path, state = tiny_qwen2
    ck = open_checkpoint(path)
    assert ck.has("model.layers.0.self_attn.q_proj.bias")
    np.testing.assert_array_equal(ck.get("model.layers.1.self_attn.k_proj.bias"),
                                  state["model.layers.1.self_attn.k_proj.bias"])
    cfg = ModelConfig.from_hf_dict(ck.hf_config)
    assert cfg.architecture == "qwen2" and cfg.tie_word_embeddings


def test_get_raw_is_lazy_view(tiny_llama):
    path, _ = tiny_llama
    ck = open_checkpoint(path)
    raw = ck.get_raw("model.embed_tokens.weight")
    assert isinstance(raw, np.memmap) or isinstance(raw.base, np.memmap) or raw.base is not None
    with pytest.raises(ValueError):
        raw[0, 0] = 1.0  # read-only mapping, never a private copy of the model


def _write_dtypes(d: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    tensors = {
        "a.bf16": w.to(torch.bfloat16),
        "a.f16": w.to(torch.float16),
        "a.e4m3": w.to(torch.float8_e4m3fn),
        "a.e5m2": w.to(torch.float8_e5m2),
        "a.u8": torch.arange(32, dtype=torch.uint8).reshape(4, 8),
        "a.i8": torch.arange(-8, 8, dtype=torch.int8),
        "a.i32": torch.arange(6, dtype=torch.int32),
        "a.i64": torch.arange(6, dtype=torch.int64),
        "b.weight": (w * 3).to(torch.float8_e4m3fn),
        "b.weight_scale_inv": torch.tensor([[0.5, 2.0]]),  # 1×2 blocks of 8×8
    }
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return tensors


def test_raw_dtypes(tmp_path):
    tensors = _write_dtypes(tmp_path / "ck")
    ck = open_checkpoint(tmp_path / "ck")
    want_dtype = {
        "a.bf16": ml_dtypes.bfloat16, "a.f16": np.float16, "a.e4m3": ml_dtypes.float8_e4m3fn,
        "a.e5m2": ml_dtypes.float8_e5m2, "a.u8": np.uint8, "a.i8": np.int8, "a.i32": np.int32, "a.i64": np.int64,
    }
    for name, dt in want_dtype.items():
        raw = ck.get_raw(name)
        assert raw.dtype == np.dtype(dt), name
        assert raw.shape == tuple(tensors[name].shape)
        ref = tensors[name].to(torch.float32).numpy()
        np.testing.assert_array_equal(raw.astype(np.float32), ref)
        np.testing.assert_array_equal(ck.get(name), ref)


def test_fp8_block_scale_dequant(tmp_path):
    tensors = _write_dtypes(tmp_path / "ck")
    ck = open_checkpoint(tmp_path / "ck")
    w = tensors["b.weight"].to(torch.float32).numpy()
    want = w * np.repeat(np.array([[0.5, 2.0]], dtype=np.float32), 8, axis=1)
    np.testing.assert_array_equal(ck.get("b.weight"), want)
    assert ck.get_raw("b.weight").dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def test_truncated_file(tiny_llama, tmp_path):
    src, _ = tiny_llama
    d = tmp_path / "trunc"
    shutil.copytree(src, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert "truncated" in _one_line(e) and "model.safetensors" in str(e.value)


def test_truncated_header(tmp_path, tiny_llama):
    src, _ = tiny_llama
    d = tmp_path / "trunc_head"
    shutil.copytree(src, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert "truncated" in _one_line(e)


def test_malformed_header(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    body = b"{not json" + b" " * 7
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert "malformed" in _one_line(e)
    # A header entry whose byte range does not match its dtype and shape.
    hdr = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert "'x'" in _one_line(e)


def test_malformed_and_missing_config(tiny_llama, tmp_path):
    src, _ = tiny_llama
    d = tmp_path / "cfg"
    shutil.copytree(src, d)
    (d / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert "config.json" in _one_line(e)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert "config.json" in _one_line(e)


def test_index_errors(tiny_llama_sharded, tmp_path):
    d = tmp_path / "idx"
    shutil.copytree(tiny_llama_sharded, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    # A shard the index names but that is not on disk.
    shard = sorted(set(index["weight_map"].values()))[-1]
    (d / shard).rename(d / "moved.bin")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert shard in _one_line(e)
    (d / "moved.bin").rename(d / shard)
    # The shards' own headers say what they hold, as transformers and vLLM read them (the index only names the
    # files): a stale entry for a tensor no shard has is not a tensor, and one assigned to the wrong shard is read
    # where it is. A tensor the model needs and no shard holds is reported by the build (test_bad_checkpoints.py).
    want = open_checkpoint(tiny_llama_sharded).get("model.norm.weight")
    index["weight_map"]["model.layers.7.mlp.up_proj.weight"] = shard
    index["weight_map"]["model.norm.weight"] = next(f for f in sorted(set(index["weight_map"].values()))
                                                    if f != index["weight_map"]["model.norm.weight"])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = open_checkpoint(d)
    assert not ck.has("model.layers.7.mlp.up_proj.weight")
    np.testing.assert_array_equal(ck.get("model.norm.weight"), want)
    # A tensor nobody has.
    ck = open_checkpoint(tiny_llama_sharded)
    with pytest.raises(CheckpointError) as e:
        ck.get("model.layers.5.self_attn.q_proj.weight")
    assert "model.layers.5.self_attn.q_proj.weight" in _one_line(e)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path / "nope")
    _one_line(e)
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path / "x.txt")
    _one_line(e)
    d = tmp_path / "bin_only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert "safe_serialization" in _one_line(e)


def test_hf_write_tokenizer(tiny_llama, tmp_path):
    src, _ = tiny_llama
    path = tmp_path / "ck"
    shutil.copytree(src, path)
    # ids the 96-token model has (ones past it are refused: test_bad_checkpoints.py)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 90, "eos_token_id": [91, 5]}))
    info = open_checkpoint(path).write_tokenizer(tmp_path / "tok")
    assert info == {  # generation_config.json's ends, then the tokenizer's EOS </s> (257), as vLLM stops on both
        "bos_token_id": 90, "eos_token_ids": [91, 5, 257],
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}", "add_bos_token": True,
    }
    tcfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == "<s>" and tcfg["chat_template"] and tcfg["add_bos_token"] is True
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert (tmp_path / "tok" / "generation_config.json").is_file()


def test_bos_without_generation_config_is_the_tokenizers(tiny_dense, tmp_path):
    """R1-Distill-Qwen's config.json gives bos_token_id = its EOS (151643) while the tokenizer's BOS is
    <｜begin▁of▁sentence｜>; without generation_config.json (a fine-tune saved without one) the prompt must
    still start with the tokenizer's BOS, as transformers (and vLLM, llama.cpp's converter) encode it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    from lineside.runtime.tokenizer import Tokenizer

    path = tmp_path / "ck"
    shutil.copytree(tiny_dense("llama-gqa"), path)  # tokenizer: <s> = 1, </s> = 2
    hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # adds BOS
    hf.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").unlink(missing_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["bos_token_id"] = cfg["eos_token_id"] = 2
    (path / "config.json").write_text(json.dumps(cfg))
    info = open_checkpoint(path).write_tokenizer(tmp_path / "tok")
    want = AutoTokenizer.from_pretrained(path)("hello there")["input_ids"]
    assert want[0] == 1
    assert info["bos_token_id"] == 1 and info["eos_token_ids"] == [2]
    assert Tokenizer(tmp_path / "tok", info).encode("hello there") == want


def test_hf_chat_template_jinja(tiny_qwen2, tmp_path):
    src, _ = tiny_qwen2
    d = tmp_path / "q"
    shutil.copytree(src, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "!"}))  # a token the 96-token model has
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (d / "generation_config.json").unlink(missing_ok=True)
    info = open_checkpoint(d).write_tokenizer(tmp_path / "out")
    assert info["chat_template"] == "{{ messages[0]['content'] }}"
    assert info["add_bos_token"] is False
    assert info["eos_token_ids"]  # from config.json or the eos_token text
    tcfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == "{{ messages[0]['content'] }}"


def _with_template(tiny_llama, tmp_path, template) -> Path:
    src, _ = tiny_llama
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": template}))
    return d


@pytest.mark.parametrize("template", [5, True, {"default": "{{ x }}"}, ["{{ x }}"],
                                      [{"name": "default", "template": 5}], [{"template": "{{ x }}"}]],
                         ids=lambda t: json.dumps(t))
def test_hf_chat_template_of_another_type_is_one_line(tiny_llama, tmp_path, template):
    """Copied as it was, it only failed when a chat was rendered (serve, chat, generate --chat)."""
    d = _with_template(tiny_llama, tmp_path, template)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d).write_tokenizer(tmp_path / "tok")
    line = _one_line(e)
    assert str(d / "tokenizer_config.json") in line and "chat_template" in line, line
    assert not (tmp_path / "tok").exists()


def test_hf_chat_template_list_of_named_templates(tiny_llama, tmp_path):
    """transformers' list form: the one named "default" (else the first) becomes the bundle's template; the list is
    kept whole (a chat with tools renders "tool_use": test_named_chat_templates.py)."""
    named = [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": "{{ messages }}"}]
    info = open_checkpoint(_with_template(tiny_llama, tmp_path, named)).write_tokenizer(tmp_path / "tok")
    assert info["chat_template"] == "{{ messages }}"
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["chat_template"] == named
    info = open_checkpoint(_with_template(tiny_llama, tmp_path / "n", None)).write_tokenizer(tmp_path / "tok2")
    assert info["chat_template"] is None


def test_mxfp4_with_e8m0_scales(tmp_path):
    """int8 weights holding two e2m1 codes per byte (low nibble first) × one ue8m0 scale per 32."""
    rng = np.random.default_rng(0)
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
    codes = rng.integers(0, 16, size=(4, 64))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    exps = rng.integers(-3, 4, size=(4, 2))
    scale = torch.tensor(2.0 ** exps, dtype=torch.float32).to(torch.float8_e8m0fnu)
    d = tmp_path / "fp4"
    d.mkdir()
    save_file({"e.weight": torch.from_numpy(packed.copy()), "e.scale": scale}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))
    ck = open_checkpoint(d)
    assert ck.get_raw("e.scale").dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
    assert ck.get_raw("e.weight").dtype == np.int8 and ck.shape("e.weight") == (4, 32)
    want = lut[codes] * np.repeat(2.0 ** exps, 32, axis=1).astype(np.float32)
    np.testing.assert_array_equal(ck.get("e.weight"), want)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_config_without_max_position_embeddings_takes_transformers_default(tiny_dense, family):
    """lineside assumed 4096; transformers reads the same config.json as 2048 (Llama) or 32768 (Qwen2)."""
    import transformers

    variant = next(v for v, (f, _) in DENSE_VARIANTS.items() if f == family)
    d = json.loads((tiny_dense(variant) / "config.json").read_text())
    d.pop("max_position_embeddings")
    want = transformers.AutoConfig.for_model(**d).max_position_embeddings
    assert ModelConfig.from_hf_dict(d).max_position_embeddings == want
