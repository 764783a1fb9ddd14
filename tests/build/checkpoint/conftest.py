"""Tiny checkpoints the checkpoint tests make themselves (transformers models, hand-written GGUFs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.build.checkpoint.ckpt_helpers import TINY


def _tiny_tokenizer_json() -> dict:
    """A byte-level BPE tokenizer.json small enough to write by hand: 256 bytes + 2 specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return json.loads(tok.to_str())


def _save_hf(model, out: Path, **kw) -> Path:
    model.save_pretrained(out, safe_serialization=True, **kw)
    (out / "tokenizer.json").write_text(json.dumps(_tiny_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A random-weight Llama in HF format and its state dict (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    out = _save_hf(model, tmp_path_factory.mktemp("llama"))
    return out, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="session")
def tiny_llama_sharded(tiny_llama, tmp_path_factory) -> Path:
    """The same Llama saved in several shards with an index."""
    import torch
    from transformers import LlamaForCausalLM

    src, _ = tiny_llama
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    out = _save_hf(model, tmp_path_factory.mktemp("llama_sharded"), max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(**TINY, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    out = _save_hf(model, tmp_path_factory.mktemp("qwen2"))
    return out, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
