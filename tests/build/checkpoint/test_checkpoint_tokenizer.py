"""GGUF tokenizers rebuilt as tokenizer.json must give llama.cpp's ids.

Reference ids for SmolLM2 are frozen in data/smollm2_llamacpp_ids.json (made with llama.cpp via
llama-cpp-python: ``PYTHONPATH=. python tests/build/checkpoint/test_checkpoint_tokenizer.py --freeze``). When
llama_cpp is importable, further tests compare against it live: random text, and every
supported ``tokenizer.ggml.pre`` on a vocabulary cut from SmolLM2's.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from lineside.build.checkpoint import open_checkpoint
from lineside.errors import CheckpointError
from tests.build.checkpoint.ckpt_gguf_writer import write_model_gguf
from tests.build.checkpoint.ckpt_helpers import needs_smollm2, smollm2_gguf

DATA = Path(__file__).parent / "data"
TEXTS = json.loads((DATA / "tokenizer_texts.json").read_text(encoding="utf-8"))
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")


def _load(out: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json"))


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_ck, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2_tok")
    info = smollm2_ck.write_tokenizer(out)
    return out, info, _load(out)


@needs_smollm2
def test_smollm2_frozen_llamacpp_ids(smollm2_tok):
    _, _, tok = smollm2_tok
    ref = json.loads((DATA / "smollm2_llamacpp_ids.json").read_text())
    assert set(ref) == set(TEXTS)
    for key, text in TEXTS.items():
        assert tok.encode(text, add_special_tokens=False).ids == ref[key], key
        assert tok.encode(text).ids == ref[key], key  # SmolLM2: add_bos_token is false


@needs_smollm2
def test_smollm2_digits_split_one_by_one(smollm2_tok):
    _, _, tok = smollm2_tok
    enc = tok.encode("\n\n  0. In 2024-11-29", add_special_tokens=False)
    assert [t for t in enc.tokens if t.isdigit()] == list("0202411" "29")
    assert tok.decode(enc.ids) == "\n\n  0. In 2024-11-29"


@needs_smollm2
def test_smollm2_tokenizer_files(smollm2_tok):
    import jinja2

    out, info, tok = smollm2_tok
    assert info["bos_token_id"] == 1 and info["add_bos_token"] is False
    assert info["eos_token_ids"][0] == 2 and 0 in info["eos_token_ids"]  # <|im_end|>, <|endoftext|>
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["bos_token"] == "<|im_start|>"
    assert tcfg["chat_template"] == info["chat_template"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and 2 in gen["eos_token_id"]
    prompt = jinja2.Template(info["chat_template"]).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    ids = tok.encode(prompt).ids
    assert ids[0] == 1 and 2 in ids  # <|im_start|> and <|im_end|> came out as single special ids
    assert tok.token_to_id("<|im_end|>") == 2


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pool = list("abcXYZ019 \n\t\r'.,;:!?-_()[]{}\"") + [
        "'s", "'LL", "  ", "\u00a0", "\u2003", "\u3000", "\u0085", "\u200b", "é", "中", "文", "😀", "👍🏽",
        "٣", "²", "½", "Ⅻ", "\x0b", "<|im_end|>", "<|im_start|>", "\ufeff", "ǅ", "ʰ", "$", "+", "<=>", "|",
    ]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@needs_smollm2
@needs_llama_cpp
def test_smollm2_vs_llamacpp_live(smollm2_tok):
    from llama_cpp import Llama

    _, _, tok = smollm2_tok
    llm = Llama(model_path=str(smollm2_gguf()), vocab_only=True, verbose=False)
    for text in [*TEXTS.values(), *_random_texts(400)]:
        want = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert tok.encode(text, add_special_tokens=False).ids == want, repr(text)


PRE_NAMES = ["default", "gpt-2", "smollm", "starcoder", "llama-bpe", "qwen2", "deepseek-r1-qwen", "deepseek-v3",
             "deepseek-llm", "deepseek-coder"]


@pytest.fixture(scope="module")
def cut_vocab(smollm2_ck):
    """SmolLM2's first 6000 tokens and the merges that stay inside them: a valid, smaller BPE."""
    ck = smollm2_ck
    n = 6000
    tokens = ck.meta("tokenizer.ggml.tokens")[:n]
    types = ck.meta("tokenizer.ggml.token_type")[:n]
    have = set(tokens)
    merges = []
    for m in ck.meta("tokenizer.ggml.merges"):
        a, b = m.split(" ", 1)
        if a in have and b in have and a + b in have:
            merges.append(m)
    return tokens, types, merges


@needs_smollm2
@needs_llama_cpp
@pytest.mark.parametrize("pre", PRE_NAMES)
def test_pre_tokenizers_vs_llamacpp(pre, cut_vocab, tiny_llama, tmp_path):
    from llama_cpp import Llama

    tokens, types, merges = cut_vocab
    hf_dir, state = tiny_llama
    cfg = json.loads((hf_dir / "config.json").read_text())
    path = tmp_path / f"{pre}.gguf"
    small = {k: v for k, v in state.items() if "layers" not in k}
    write_model_gguf(path, "llama", {**cfg, "num_hidden_layers": 0}, small, tokenizer=dict(
        tokens=tokens, types=types, merges=merges, pre=pre, bos=1, eos=2))
    out = tmp_path / "tok"
    open_checkpoint(path).write_tokenizer(out)
    tok = _load(out)
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in [*TEXTS.values(), *_random_texts(150, seed=1)]:
        want = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert tok.encode(text).ids == want, (pre, text)


def _tiny_bpe() -> dict:
    """A hand-made byte-level vocabulary: the GPT-2 byte alphabet, a few merges, three specials."""
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alpha = sorted(ByteLevel.alphabet())
    merges = ["2 0", "20 2", "Ġ t", "h e", "Ġt he"]
    merged = ["20", "202", "Ġt", "he", "Ġthe"]
    tokens = specials + alpha + merged + ["<think>"]
    types = [3] * 3 + [1] * (len(alpha) + len(merged)) + [4]
    return dict(tokens=tokens, types=types, merges=merges)


def _tiny_gguf(tmp_path: Path, tiny_llama, metadata: dict | None = None, **tok) -> Path:
    hf_dir, state = tiny_llama
    cfg = json.loads((hf_dir / "config.json").read_text())
    path = tmp_path / "tok.gguf"
    small = {k: v for k, v in state.items() if "layers" not in k}
    write_model_gguf(path, "llama", {**cfg, "num_hidden_layers": 0}, small, tokenizer=tok, metadata=metadata)
    return path


def test_recommended_sampling_is_carried_into_generation_config(tmp_path, tiny_llama):
    """A GGUF's general.sampling.* keys (the model's recommended sampling, llama.cpp's defaults for it) become
    generation_config.json's fields, which `serve --generation-config auto` applies as vLLM does."""
    from lineside.runtime.sampling_defaults import SamplingDefaults, read_sampling_defaults

    path = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="qwen2", bos=1, eos=2,
                      metadata={"general.sampling.temp": 0.6, "general.sampling.top_p": 0.95,
                                "general.sampling.top_k": 20, "general.sampling.penalty_repeat": 1.1})
    open_checkpoint(path).write_tokenizer(tmp_path / "out")
    assert read_sampling_defaults(tmp_path / "out" / "generation_config.json") == SamplingDefaults(
        temperature=pytest.approx(0.6), top_p=pytest.approx(0.95), top_k=20, repetition_penalty=pytest.approx(1.1))
    plain = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="qwen2", bos=1, eos=2)
    open_checkpoint(plain).write_tokenizer(tmp_path / "plain")
    assert read_sampling_defaults(tmp_path / "plain" / "generation_config.json") == SamplingDefaults()


def test_tiny_smollm_rules(tmp_path, tiny_llama):
    path = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="smollm", bos=1, eos=2, add_bos=False,
                      chat_template="{{ messages }}")
    info = open_checkpoint(path).write_tokenizer(tmp_path / "out")
    assert info == {"bos_token_id": 1, "eos_token_ids": [2, 0], "chat_template": "{{ messages }}",
                    "add_bos_token": False}
    tok = _load(tmp_path / "out")
    enc = tok.encode("the 2024 the<|im_end|><think>", add_special_tokens=True)
    # digits one by one (the 20/202 merges must not fire), specials and user tokens kept whole
    assert enc.tokens == ["t", "he", "Ġ", "2", "0", "2", "4", "Ġthe", "<|im_end|>", "<think>"]
    assert tok.token_to_id("<think>") == len(_tiny_bpe()["tokens"]) - 1


def test_tiny_llama3_adds_bos(tmp_path, tiny_llama):
    path = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="llama-bpe", bos=1, eos=2)
    info = open_checkpoint(path).write_tokenizer(tmp_path / "out")
    assert info["add_bos_token"] is True  # llama.cpp's default for llama3 vocabularies
    tok = _load(tmp_path / "out")
    enc = tok.encode("the 2024")
    assert enc.ids[0] == 1
    assert enc.tokens[1:] == ["t", "he", "Ġ", "202", "4"]  # \p{N}{1,3} chunks, merges apply
    tcfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tcfg["add_bos_token"] is True and tcfg["bos_token"] == "<|im_start|>"


# (pre, text, tokens as llama.cpp gives them on _tiny_bpe() plus the merge "Ġ Ġ"): DeepSeek LLM keeps digit runs whole
# and a run of spaces before U+3000 (whitespace to llama.cpp, not a punctuation char) in one piece; Coder splits digits.
DEEPSEEK_CASES = [
    ("deepseek-llm", "the 2024\nthe  \u3000\"", ["<|im_start|>", "t", "he", "Ġ", "202", "4", "Ċ", "t", "he", "ĠĠ",
                                               "ã", "Ģ", "Ģ", '"']),
    ("deepseek-coder", "the 2024 the", ["<|im_start|>", "t", "he", "Ġ", "2", "0", "2", "4", "Ġthe"]),
]


@pytest.mark.parametrize(("pre", "text", "want"), DEEPSEEK_CASES)
def test_tiny_deepseek_llm_and_coder_pre_tokenizers(pre, text, want, tmp_path, tiny_llama):
    """DeepSeek LLM 7B / Coder 6.7B GGUFs (llama architecture) name these pre-tokenizers; once refused as unknown."""
    vocab = _tiny_bpe()
    vocab = {**vocab, "merges": [*vocab["merges"], "Ġ Ġ"], "tokens": [*vocab["tokens"], "ĠĠ"], "types": [*vocab["types"], 1]}
    path = _tiny_gguf(tmp_path, tiny_llama, **vocab, pre=pre, bos=1, eos=2, add_bos=True)
    open_checkpoint(path).write_tokenizer(tmp_path / "out")
    tok = _load(tmp_path / "out")
    assert tok.encode(text).tokens == want
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text
    if importlib.util.find_spec("llama_cpp") is not None:
        from llama_cpp import Llama

        llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        assert tok.encode(text).ids == llm.tokenize(text.encode(), add_bos=True, special=True)


def test_unsupported_tokenizers(tmp_path, tiny_llama):
    path = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="made-up-pre")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path).write_tokenizer(tmp_path / "out")
    assert "made-up-pre" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "tok.gguf").unlink()
    path = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="default", model="bert")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path).write_tokenizer(tmp_path / "out")
    assert "bert" in str(e.value)


def _eog_vocab() -> dict:
    """Qwen2.5 / SmolLM2 style FIM tokens, a mistyped (NORMAL) <|im_end|>, and texts llama.cpp ends on."""
    base = _tiny_bpe()
    extra = ["<|fim_prefix|>", "<|fim_pad|>", "<|file_sep|>", "<reponame>", "<|im_end|>", "[EOS]", "<x>"]
    tokens = [*base["tokens"][:2], "<y>", *base["tokens"][3:], *extra]
    types = [*base["types"], 3, 3, 3, 3, 1, 3, 3]
    return dict(tokens=tokens, types=types, merges=base["merges"])


def test_eog_and_control_looking_tokens_as_llamacpp(tmp_path, tiny_llama):
    """llama.cpp also ends generation on the FIM pad/repo/file-sep tokens (and more texts), and treats a
    control-looking token stored as NORMAL as control, so it is split out of text whole."""
    vocab = _eog_vocab()
    path = _tiny_gguf(tmp_path, tiny_llama, **vocab, pre="qwen2", bos=1, eos=0, add_bos=False)
    info = open_checkpoint(path).write_tokenizer(tmp_path / "out")
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    want = {ids[t] for t in ("<|endoftext|>", "<|fim_pad|>", "<reponame>", "<|file_sep|>", "<|im_end|>", "[EOS]")}
    assert info["eos_token_ids"][0] == 0 and set(info["eos_token_ids"]) == want
    assert _load(tmp_path / "out").encode("a<|im_end|>").ids == [ids["a"], ids["<|im_end|>"]]
    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        v = llama_cpp.llama_model_get_vocab(llm._model.model)
        assert {i for i in range(len(vocab["tokens"])) if llama_cpp.llama_vocab_is_eog(v, i)} == want
        assert llm.tokenize(b"a<|im_end|>", add_bos=False, special=True) == [ids["a"], ids["<|im_end|>"]]


def test_bpe_without_merges_is_refused(tmp_path, tiny_llama):
    """llama.cpp refuses a gpt2 vocabulary without tokenizer.ggml.merges; a merge-less BPE would
    silently feed the model byte-by-byte ids it never saw."""
    path = _tiny_gguf(tmp_path, tiny_llama, **{**_tiny_bpe(), "merges": []}, pre="qwen2", bos=1, eos=2)
    with pytest.raises(CheckpointError, match="merges"):
        open_checkpoint(path).write_tokenizer(tmp_path / "out")


def _freeze() -> None:
    """Regenerate data/smollm2_llamacpp_ids.json from llama.cpp itself."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(smollm2_gguf()), vocab_only=True, verbose=False)
    ref = {k: llm.tokenize(v.encode(), add_bos=False, special=True) for k, v in TEXTS.items()}
    (DATA / "smollm2_llamacpp_ids.json").write_text(json.dumps(ref) + "\n")


if __name__ == "__main__" and "--freeze" in sys.argv:
    _freeze()


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece-like vocabulary: <unk> <s> </s>, 256 byte tokens, then BPE pieces trained
    on the test texts with ▁ for spaces, scored by training order (earlier = better)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator(list(TEXTS.values()) * 3, trainers.BpeTrainer(vocab_size=700, show_progress=False))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types, scores = [2, 3, 3] + [6] * 256, [0.0] * len(tokens)
    for piece, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(i))
    return tokens, types, scores


@pytest.fixture(scope="module")
def spm_gguf(tiny_llama, tmp_path_factory):
    tokens, types, scores = _spm_vocab()
    d = tmp_path_factory.mktemp("spm")
    path = _tiny_gguf(d, tiny_llama, tokens=tokens, types=types, scores=scores, merges=[], pre="default",
                      model="llama", bos=1, eos=2)
    info = open_checkpoint(path).write_tokenizer(d / "out")
    return path, info, _load(d / "out")


def _spm_texts() -> list[str]:
    swap = {"<|im_start|>": "<s>", "<|im_end|>": "</s>"}
    out = []
    for t in [*TEXTS.values(), *_random_texts(300, seed=2), " leading", "a  b", "</s>  x<s>"]:
        for a, b in swap.items():
            t = t.replace(a, b)
        out.append(t)
    return out


def test_spm_rules(spm_gguf):
    _, info, tok = spm_gguf
    assert info["add_bos_token"] is True and info["bos_token_id"] == 1 and info["eos_token_ids"][0] == 2
    enc = tok.encode("Hi  there</s> x 😀")
    assert enc.ids[0] == 1  # BOS, as llama.cpp adds for SPM vocabularies
    assert enc.tokens[1].startswith("\u2581")  # space prefix on the first fragment ...
    i = enc.tokens.index("</s>")
    assert enc.tokens[i + 1].startswith("\u2581")  # ... and after every special token
    assert enc.tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # byte fallback
    plain = "Hi  there, x 😀 über"
    assert tok.decode(tok.encode(plain).ids, skip_special_tokens=True) == plain


@needs_llama_cpp
def test_spm_vs_llamacpp(spm_gguf):
    from llama_cpp import Llama

    path, _, tok = spm_gguf
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in _spm_texts():
        assert tok.encode(text).ids == llm.tokenize(text.encode(), add_bos=True, special=True), repr(text)


def test_field_fallback_matches_contents(tmp_path, tiny_llama):
    """The metadata decoder kept for gguf < 0.11 (no ReaderField.contents) reads the same values."""
    from lineside.build.checkpoint.gguf_file import _field_value

    path = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="smollm", bos=1, eos=2, add_bos=False,
                      chat_template="{{ x }}")
    ck = open_checkpoint(path)
    fields = ck._reader.fields
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.add_bos_token"} <= set(fields)
    for f in fields.values():
        assert _field_value(f) == f.contents(), f.name


@pytest.mark.parametrize(("tok", "metadata", "key"), [
    ({"bos": 900, "add_bos": True}, None, "bos_token_id"),  # IndexError in the BOS post-processor: a traceback
    ({"eos": 900}, {"tokenizer.ggml.add_eos_token": 1}, "eos_token_id"),  # the same for EOS
    ({"eos": 900}, None, "eos_token_id"),  # built, its bundle stopping on an id the model never produces
    ({}, {"tokenizer.ggml.eot_token_id": 900}, "eot_token_id"),
])
def test_a_special_token_id_beyond_the_vocabulary_is_one_line(tmp_path, tiny_llama, tok, metadata, key):
    """A GGUF whose bos/eos/eot id lies past its token list (a corrupt or hand-edited file; llama.cpp's loader calls
    it a "bad special token") is refused in one line naming the key, not a traceback or a stop id that never comes."""
    vocab = _tiny_bpe()
    path = _tiny_gguf(tmp_path, tiny_llama, **vocab, pre="qwen2", **{"bos": 1, "eos": 2, **tok}, metadata=metadata)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path).write_tokenizer(tmp_path / "out")
    msg = str(e.value)
    assert f"tokenizer.ggml.{key} 900" in msg and f"{len(vocab['tokens'])} tokens" in msg and "\n" not in msg, msg


@pytest.mark.parametrize(("key", "value"), [("general.sampling.temp", 5.0), ("general.sampling.top_p", 0.0),
                                            ("general.sampling.penalty_repeat", 0.0), ("general.sampling.min_p", 1.5)])
def test_recommended_sampling_out_of_range_is_refused_naming_the_key(tmp_path, tiny_llama, key, value):
    """A general.sampling.* value serve's --generation-config auto would refuse (so the bundle would not start under
    serve's defaults) is one line at build time naming the GGUF key and how to drop it."""
    path = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="qwen2", bos=1, eos=2, metadata={key: value})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path).write_tokenizer(tmp_path / "out")
    msg = str(e.value)
    assert key in msg and "--remove-metadata" in msg and "\n" not in msg
