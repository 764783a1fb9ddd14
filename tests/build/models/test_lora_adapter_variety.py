"""PEFT LoRA adapters of the variety published on the Hub, read against peft itself (float32, CPU).

Each adapter is either read into the same per-linear updates peft merges (B·scaling·A, nothing else of the
model changed) or refused in one line naming the adapter_config.json field and what to do. The graphs' own
parity with peft is test_lora_parity.py; this checks the reader on many configs quickly.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lineside.config import ModelConfig, load_hf_config
from lineside.lora import AdapterError, read_adapter
from tests.conftest import make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _edit_config(**fields: Any) -> Callable[[Path], None]:
    def edit(adapter: Path) -> None:
        f = adapter / "adapter_config.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), **fields}))
    return edit


def _cast(dtype: torch.dtype) -> Callable[[Path], None]:
    def cast(adapter: Path) -> None:
        from safetensors.torch import load_file, save_file

        w = adapter / "adapter_model.safetensors"
        save_file({k: v.to(dtype) for k, v in load_file(str(w)).items()}, str(w))
    return cast


# name: (variant, LoraConfig fields, an edit of the saved adapter or None)
SERVED: dict[str, tuple[str, dict[str, Any], Callable[[Path], None] | None]] = {
    "r1": ("llama-gqa", dict(r=1, lora_alpha=1, target_modules=["q_proj", "v_proj"]), None),
    "r3-odd-alpha7": ("llama-gqa", dict(r=3, lora_alpha=7, target_modules=["q_proj", "v_proj"]), None),
    "r64": ("llama-gqa", dict(r=64, lora_alpha=16, target_modules=["q_proj", "v_proj"]), None),
    "alpha4r-all": ("llama-gqa", dict(r=8, lora_alpha=32, target_modules=ALL, task_type="CAUSAL_LM"), None),
    "rslora": ("llama-gqa", dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL), None),
    "full-paths": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules=["model.layers.0.self_attn.q_proj",
                                                                         "model.layers.1.mlp.down_proj"]), None),
    "regex": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules=r".*layers\.[01]\.self_attn\.(q|k)_proj"), None),
    "all-linear": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules="all-linear"), None),
    "layers-pattern": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                         layers_to_transform=[1], layers_pattern="layers"), None),
    "exclude-modules": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules="all-linear",
                                          exclude_modules=["down_proj"]), None),
    # per-module ranks and alphas by short name, full path and regex (peft's get_pattern_key)
    "patterns": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules=ALL,
                                   rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 7},
                                   alpha_pattern={"v_proj": 3, "layers.0.self_attn.o_proj": 20}), None),
    "patterns-regex-rslora": ("llama-gqa", dict(r=4, lora_alpha=8, use_rslora=True, target_modules=ALL,
                                                rank_pattern={r"^model.layers.0.*": 2},
                                                alpha_pattern={r"layers\.1\.mlp\..*": 11}), None),
    # peft turns fan_in_fan_out off on nn.Linear (with a warning): a config saying true is a plain LoRA
    "fan-in-fan-out-true": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                            _edit_config(fan_in_fan_out=True)),
    "bf16": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules=ALL), _cast(torch.bfloat16)),
    "fp16": ("llama-gqa", dict(r=4, lora_alpha=8, target_modules=ALL), _cast(torch.float16)),
    # Qwen2: the q/k/v biases stay the base model's
    "qwen2-all": ("qwen2-bias-tied", dict(r=4, lora_alpha=8, target_modules=ALL, task_type="CAUSAL_LM"), None),
    "qwen2-qkv-r3": ("qwen2-bias-tied", dict(r=3, lora_alpha=5, target_modules=["q_proj", "k_proj", "v_proj"]), None),
}

# name: (LoraConfig fields on llama-gqa, words the one-line refusal must hold)
REFUSED: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "dora": (dict(use_dora=True), ("use_dora true", "DoRA", "train a plain LoRA adapter")),
    "bias-all": (dict(bias="all"), ("bias 'all'", "bias='none'")),
    "bias-lora-only": (dict(bias="lora_only"), ("bias 'lora_only'", "bias='none'")),
    "lora-bias": (dict(lora_bias=True), ("lora_bias true", "without lora_bias")),
    "save-lm-head": (dict(modules_to_save=["lm_head"]), ('modules_to_save ["lm_head"]', "without modules_to_save")),
    "save-embed": (dict(modules_to_save=["embed_tokens"]), ("modules_to_save", "embed_tokens")),
    "trainable-tokens": (dict(trainable_token_indices=[3, 5]), ("trainable_token_indices [3, 5]",)),
    "embedding-lora": (dict(target_modules=["q_proj", "embed_tokens"]), ("target_modules", "embed_tokens",
                                                                          "train with target_modules limited")),
    "lm-head-lora": (dict(target_modules=["q_proj", "lm_head"]), ("target_modules", "lm_head",
                                                                   "train with target_modules limited")),
}


def model_config(ckpt: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(load_hf_config(ckpt / "config.json"))


def _merged_deltas(ckpt: Path, adapter: Path) -> tuple[dict[str, np.ndarray], list[str]]:
    """peft's merged-minus-base weight of each adapted linear, and every other parameter the merge changed."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fan_in_fan_out's "Setting fan_in_fan_out to False"
        after = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    deltas = {k: (after[k] - before[k]).numpy() for k in before if not torch.equal(after[k], before[k])}
    return deltas, [k for k in deltas if not k.endswith("_proj.weight")]


@pytest.mark.parametrize("name", sorted(SERVED))
def test_adapter_reads_as_peft_merges_it(name, tiny_dense, tmp_path):
    variant, lora, edit = SERVED[name]
    ckpt = tiny_dense(variant)
    adapter = make_peft_adapter(ckpt, tmp_path / name, seed=3, **lora)
    if edit is not None:
        edit(adapter)
    got = read_adapter(adapter, model_config(ckpt), name)
    deltas, others = _merged_deltas(ckpt, adapter)
    assert others == []  # a served adapter changes the projections only (no bias, embedding or head)
    mine = {f"model.layers.{layer}.{t.module}.weight": key for key in got.weights for layer, t in [key]}
    assert set(mine) == set(deltas), name  # the same linears of the same layers
    for module, key in mine.items():
        a, b = got.scaled_pair(key)
        ref = deltas[module]
        assert np.abs(b @ a - ref).max() / np.abs(ref).max() < 1e-5, (name, module)
    assert got.rank == max(a.shape[0] for a, _ in got.weights.values())


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_adapter_peft_computes_otherwise_is_refused_naming_the_field(name, tiny_dense, tmp_path):
    lora, needles = REFUSED[name]
    ckpt = tiny_dense("llama-gqa")
    adapter = make_peft_adapter(ckpt, tmp_path / name, seed=3, **{"r": 4, "lora_alpha": 8,
                                                                  "target_modules": ["q_proj", "v_proj"], **lora})
    with pytest.raises(AdapterError) as e:
        read_adapter(adapter, model_config(ckpt), name)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


@pytest.mark.parametrize(("other", "needles"), [
    (("qwen", "qwen2", {}), ("architecture is qwen2", "the bundle's is llama")),
    (("vocab400", "llama", {"vocab_size": 400}), ("vocab_size is 400", "the bundle's is 300")),
    (("hidden96", "llama", {"hidden_size": 96}), ("hidden_size is 96",)),
    (("layers3", "llama", {"num_hidden_layers": 3}), ("num_hidden_layers is 3",)),
], ids=["other-architecture", "other-vocabulary", "other-hidden-size", "other-layer-count"])
def test_adapter_of_a_local_base_of_another_model_is_refused(dense_checkpoint, tiny_dense, tmp_path, other,
                                                             needles):
    """An SFT adapter (task_type CAUSAL_LM: peft writes no auto_mapping) of another model whose A/B shapes fit
    was served: its base_model_name_or_path, when a local checkpoint, says which model it was trained on."""
    name, family, over = other
    ours = tiny_dense("llama-gqa")
    base_over = {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    theirs = dense_checkpoint(f"variety-{name}", family, **{**base_over, **over})
    adapter = make_peft_adapter(theirs, tmp_path / name, seed=3, r=4, lora_alpha=8, target_modules=["q_proj"],
                                layers_to_transform=[0], task_type="CAUSAL_LM")
    assert json.loads((adapter / "adapter_config.json").read_text())["auto_mapping"] is None
    with pytest.raises(AdapterError) as e:
        read_adapter(adapter, model_config(ours), name)
    msg = str(e.value)
    assert "\n" not in msg and "base_model_name_or_path" in msg and str(theirs) in msg, msg
    assert all(n in msg for n in needles), msg
    assert "use an adapter trained on the bundle's base model" in msg


def test_adapter_whose_base_is_a_hub_id_or_gone_is_read(tiny_dense, tmp_path):
    """base_model_name_or_path only informs: a Hub id, a relative path or a checkpoint not on this machine is
    not looked up (the A/B shapes are still checked)."""
    ckpt = tiny_dense("llama-gqa")
    adapter = make_peft_adapter(ckpt, tmp_path / "a", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"],
                                task_type="CAUSAL_LM")
    for base in ("meta-llama/Llama-3.2-1B", "./base", str(tmp_path / "gone"), None):
        _edit_config(base_model_name_or_path=base)(adapter)
        assert read_adapter(adapter, model_config(ckpt), "a").targets, base


def test_adapter_saved_from_unsharded_zero3_shards_is_refused_saying_so(tiny_dense, tmp_path):
    """DeepSpeed ZeRO-3 / FSDP save_pretrained without gathering writes zero-size lora_A/B: it was refused as
    'the adapter was made for another model', sending the user after the wrong cause."""
    from safetensors.torch import load_file, save_file

    ckpt = tiny_dense("llama-gqa")
    adapter = make_peft_adapter(ckpt, tmp_path / "z3", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"])
    w = adapter / "adapter_model.safetensors"
    save_file({k: torch.empty(0) for k in load_file(str(w))}, str(w))
    with pytest.raises(AdapterError) as e:
        read_adapter(adapter, model_config(ckpt), "z3")
    msg = str(e.value)
    assert "\n" not in msg and "empty tensors" in msg and "ZeRO-3" in msg and "another model" not in msg, msg


def test_adapter_saved_as_adapter_model_bin_is_refused_with_the_conversion(tiny_dense, tmp_path):
    """Older PEFT saved adapter_model.bin (a pickle): the refusal gives the command that converts it, and the
    converted adapter reads as the original."""
    import shlex
    import subprocess
    import sys

    from safetensors.torch import load_file

    ckpt = tiny_dense("llama-gqa")
    adapter = make_peft_adapter(ckpt, tmp_path / "bin", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"])
    w = adapter / "adapter_model.safetensors"
    want = read_adapter(adapter, model_config(ckpt), "bin")
    torch.save(load_file(str(w)), adapter / "adapter_model.bin")
    w.unlink()
    with pytest.raises(AdapterError) as e:
        read_adapter(adapter, model_config(ckpt), "bin")
    msg = str(e.value)
    assert "\n" not in msg and "adapter_model.bin is not read" in msg, msg
    command = shlex.split(msg.split("convert it in that directory with ", 1)[1])
    assert command[:2] == ["python", "-c"]
    subprocess.run([sys.executable, "-c", command[2]], cwd=adapter, check=True)
    got = read_adapter(adapter, model_config(ckpt), "bin")
    assert got.weights.keys() == want.weights.keys()
    assert all(np.array_equal(got.weights[k][1], want.weights[k][1]) for k in want.weights)
