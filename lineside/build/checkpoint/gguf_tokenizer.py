"""Rebuild a Hugging Face ``tokenizer.json`` from GGUF metadata so it gives llama.cpp's ids.

A GGUF stores the vocabulary, merges and the *name* of the pre-tokenizer (``tokenizer.ggml.pre``);
llama.cpp maps that name to a list of split regexes in ``src/llama-vocab.cpp``
(``llm_tokenizer_bpe``). We map the same names to the same regexes, applied one after another
as ``Split(..., "isolated")`` steps before GPT-2 byte-level encoding. The regexes are written
in their Hugging Face form (with the trailing ``\\s+`` alternative that llama.cpp's hand-written
GPT-2 / Llama-3 splitters implement).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lineside.build.checkpoint.hf_tokenizer import default_template, template_record
from lineside.errors import CheckpointError, LinesideError

if TYPE_CHECKING:
    from lineside.build.checkpoint.gguf_file import GGUFCheckpoint

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# DeepSeek LLM / Coder (llama-architecture GGUFs: deepseek-llm-7b, deepseek-coder-6.7b): newlines alone, words,
# punctuation, a trailing run of spaces, CJK/Hangul runs, digits; the cased-letter class is the original tokenizer.json's.
# llama.cpp runs these category-free regexes on text whose non-ASCII whitespace became \x0B, so U+3000 and the
# U+2000 spaces never fall in the punctuation or CJK ranges there: "&&[^\s]" takes them out here too.
_CASED = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]]+"
DEEPSEEK_LLM = [
    "[\r\n]", r"\s?[" + _CASED + "]+", "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002&&[^\\s]]+",
    r"\s+$", _CJK_HANGUL, r"\p{N}+",
]
DEEPSEEK_CODER = ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"]
DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# tokenizer.ggml.pre → (regexes, ignore_merges, add_bos default, clean_up_tokenization_spaces),
# following llama_vocab::impl::load and llm_tokenizer_bpe in llama.cpp's src/llama-vocab.cpp.
_LLAMA3 = ([LLAMA3], True, True, True)
_SMOLLM = ([r"\p{N}", GPT2], False, False, True)
_GPT2 = ([GPT2], False, False, True)
_QWEN2 = ([QWEN2], False, False, False)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool, bool]] = {
    "default": (DEFAULT, False, False, True),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe"], ([LLAMA3], False, False, True)),
    "smollm": ([r"\p{N}", GPT2], False, False, False),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "exaone", "minerva-7b"], _SMOLLM),
    "command-r": ([r"\p{N}", GPT2], False, False, False),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"], _GPT2),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"], _QWEN2),
    "deepseek-v3": (DEEPSEEK3, False, False, False),
    "deepseek-llm": (DEEPSEEK_LLM, False, False, False),
    "deepseek-coder": (DEEPSEEK_CODER, False, False, False),
}
# Token texts llama.cpp treats as end-of-generation (llama_vocab::impl::load, special_eog_ids).
EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>",
}
# The FIM tokens llama.cpp also ends generation on: the GGUF's id, else the token with one of these texts.
FIM_EOG = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Texts llama.cpp makes control tokens whatever their stored type ("control-looking token ... will be
# overridden"): EOT/EOM/FIM candidates and the EOG texts. They are then split out of text whole.
CONTROL_LOOKING = EOG_TEXTS | {t for ts in FIM_EOG.values() for t in ts} | {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>", "<|prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>", "<|suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>", "<|middle|>",
}
CONTROL, USER_DEFINED, UNKNOWN = 3, 4, 2


# GGUF's recommended-sampling keys (llama.cpp's defaults for the model) -> generation_config.json's fields
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def write_gguf_tokenizer(ck: GGUFCheckpoint, out_dir: Path) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json for a GGUF's vocab."""
    model = ck.meta("tokenizer.ggml.model")
    tokens = ck.meta("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise CheckpointError(f"{ck.path}: GGUF has no tokenizer (tokenizer.ggml.model/tokens); it cannot be served")
    types = ck.meta("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "gpt2":
        tok, opts = _bpe_tokenizer(ck, tokens, types)
    elif model == "llama":
        from lineside.build.checkpoint.gguf_spm import spm_tokenizer

        tok, opts = spm_tokenizer(ck, tokens, types)
    else:
        raise CheckpointError(
            f"{ck.path}: GGUF tokenizer model {model!r} is not supported (supported: gpt2 BPE, llama SPM)"
        )

    bos = special_id(ck, "bos_token_id", tokens, opts.get("default_bos"))
    eos = special_id(ck, "eos_token_id", tokens, opts.get("default_eos"))
    add_bos = bool(ck.meta("tokenizer.ggml.add_bos_token", opts["add_bos"]))
    add_eos = bool(ck.meta("tokenizer.ggml.add_eos_token", False))
    if add_bos and bos is None:
        raise CheckpointError(f"{ck.path}: GGUF sets add_bos_token but has no bos_token_id; re-convert the model")
    _post_process(tok, tokens, bos if add_bos else None, eos if add_eos else None, model == "gpt2")
    eos_ids = eog_ids(ck, tokens, eos)
    templates = _chat_templates(ck)
    chat_template = default_template(templates)

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    text = {i: tokens[i] for i in (bos, eos) if i is not None and 0 <= i < len(tokens)}
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text.get(bos),
        "eos_token": text.get(eos),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": opts["clean_spaces"],
        "model_max_length": int(ck.hf_config.get("max_position_embeddings", 4096)),
    }
    for key, field in (("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        i = ck.meta(f"tokenizer.ggml.{field}")
        if i is not None and 0 <= i < len(tokens):
            tcfg[key] = tokens[i]
    if templates:
        tcfg["chat_template"] = template_record(templates)
    _dump(out_dir / "tokenizer_config.json", tcfg)
    gen: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    pad = ck.meta("tokenizer.ggml.padding_token_id")
    if pad is not None:
        gen["pad_token_id"] = pad
    for key, field in SAMPLING_KEYS.items():  # the model's recommended sampling, as llama.cpp reads it
        value = ck.meta(key)
        if value is not None:  # checked as serve reads it: a bundle serve refuses to start is no bundle
            gen[field] = _sampling_value(ck, key, field, value)
    _dump(out_dir / "generation_config.json", gen)
    return {"bos_token_id": bos, "eos_token_ids": eos_ids, "chat_template": chat_template, "add_bos_token": add_bos}


def _sampling_value(ck: GGUFCheckpoint, key: str, field: str, value: Any) -> Any:
    """A general.sampling.* value serve's --generation-config auto would take, or one line naming the key."""
    from lineside.runtime.sampling_defaults import check_field

    try:
        check_field(field, value, f"{ck.path}: {key}", advice="remove the key (gguf-py's gguf_new_metadata.py "
                    f"--remove-metadata {key}) and build again")
    except LinesideError as e:
        raise CheckpointError(str(e)) from None
    return value


def _chat_templates(ck: GGUFCheckpoint) -> dict[str, Any]:
    """The GGUF's chat templates by name: ``tokenizer.chat_template`` (the default) and, for each name listed in
    ``tokenizer.chat_templates``, ``tokenizer.chat_template.<name>`` (gguf-py's add_chat_template writes them so
    from transformers' named list, e.g. Hermes-2-Pro's "tool_use", which llama.cpp's server renders for tools)."""
    out: dict[str, Any] = {}
    default = ck.meta("tokenizer.chat_template")
    if default:
        out["default"] = default
    names = ck.meta("tokenizer.chat_templates")
    for name in names if isinstance(names, list) else []:
        text = ck.meta(f"tokenizer.chat_template.{name}") if isinstance(name, str) and name != "default" else None
        if isinstance(text, str) and text:
            out[name] = text
    return out


def _bpe_tokenizer(ck: GGUFCheckpoint, tokens: list[str], types: list[int]) -> tuple[Any, dict[str, Any]]:
    """GPT-2 style byte-level BPE with llama.cpp's pre-tokenizer for this GGUF's ``tokenizer.ggml.pre``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = ck.meta("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{ck.path}: GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    regexes, ignore_merges, add_bos, clean = PRE_TOKENIZERS[pre]
    vocab = _vocab(ck, tokens)
    raw_merges = ck.meta("tokenizer.ggml.merges")
    if raw_merges is None:  # llama.cpp refuses to load such a vocabulary ("cannot find tokenizer merges")
        raise CheckpointError(f"{ck.path}: GGUF BPE vocabulary has no tokenizer.ggml.merges; re-convert the model")
    merges = []
    for m in raw_merges:
        pos = m.find(" ", 1)  # as llama.cpp: the first space after position 0 separates the pair
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1 :]
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False))
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    _add_special(tok, tokens, types, AddedToken)
    return tok, {"add_bos": add_bos, "clean_spaces": clean, "default_bos": None, "default_eos": None}


def _vocab(ck: GGUFCheckpoint, tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        t = t or f"[EMPTY_{i}]"  # llama.cpp's name for empty entries
        if t in vocab:
            raise CheckpointError(f"{ck.path}: duplicate token {t!r} in the GGUF vocabulary (ids {vocab[t]} and {i})")
        vocab[t] = i
    return vocab


def _add_special(tok: Any, tokens: list[str], types: list[int], added_token: Any) -> None:
    """Control/unknown tokens as special, user-defined as non-special; both split out before BPE,
    like llama.cpp's tokenizer_st_partition with parse_special=true."""
    if len(types) != len(tokens):
        raise CheckpointError(f"GGUF token_type has {len(types)} entries for {len(tokens)} tokens; re-convert the model")
    types = [CONTROL if t in CONTROL_LOOKING else ty for t, ty in zip(tokens, types, strict=True)]
    want = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if t and ty in (CONTROL, USER_DEFINED, UNKNOWN)}
    if not want:
        return
    tok.add_tokens(
        [added_token(t, special=types[i] != USER_DEFINED, normalized=False) for t, i in want.items()]
    )
    bad = [t for t, i in want.items() if tok.token_to_id(t) != i]
    if bad:
        raise CheckpointError(f"special token {bad[0]!r} did not keep its GGUF id; the vocabulary is inconsistent")


def _post_process(tok: Any, tokens: list[str], bos: int | None, eos: int | None, byte_level: bool) -> None:
    """Prepend BOS / append EOS on ``encode(..., add_special_tokens=True)`` as llama.cpp's add_special does."""
    from tokenizers import processors

    if bos is None and eos is None:
        if byte_level:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    b = [tokens[bos]] if bos is not None else []
    e = [tokens[eos]] if eos is not None else []
    single = " ".join([*b, "$A", *e])
    pair = " ".join([*b, "$A", *e, *(f"{t}:1" for t in b), "$B:1", *(f"{t}:1" for t in e)])
    specials = [(tokens[i], i) for i in sorted({i for i in (bos, eos) if i is not None})]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def eog_ids(ck: GGUFCheckpoint, tokens: list[str], eos: int | None) -> list[int]:
    """eos first, then eot/eom, the FIM pad/repo/sep tokens and every token llama.cpp stops generation on."""
    ids: list[int] = [eos] if eos is not None else []
    fim = []
    for key, texts in FIM_EOG.items():
        v = special_id(ck, f"{key}_token_id", tokens)
        if v is None:  # llama.cpp keeps the last match it meets; for these short lists, the highest id
            v = max((i for i, t in enumerate(tokens) if t in texts), default=None)
        fim.append(v)
    for v in [special_id(ck, "eot_token_id", tokens), special_id(ck, "eom_token_id", tokens), *fim]:
        if v is not None and v not in ids:
            ids.append(int(v))
    for i, t in enumerate(tokens):
        if t in EOG_TEXTS and i not in ids:
            ids.append(i)
    named = {tokens[i]: i for i in ids if 0 <= i < len(tokens)}
    # llama.cpp's workarounds: gpt-oss / solar-open's <|end|> and gemma4's </s> do not end generation.
    if "<|end|>" in named and ({"<|return|>", "<|call|>"} <= named.keys() or {"<|calls|>", "<|flush|>"} <= named.keys()):
        ids.remove(named["<|end|>"])
    if "</s>" in named and "<|tool_response>" in named:
        ids.remove(named["</s>"])
    return ids


def special_id(ck: GGUFCheckpoint, field: str, tokens: list[str], default: int | None = None) -> int | None:
    """``tokenizer.ggml.<field>`` (bos_token_id, eos_token_id, ...), refused in one line when it lies past the token
    list: a BOS/EOS the tokenizer adds would fail on it, a stop id would never come (llama.cpp's loader calls it a
    bad special token). Not checked without a token list (a vocabulary-only reader has none to check against)."""
    v = ck.meta(f"tokenizer.ggml.{field}", default)
    if v is not None and tokens and not (type(v) is int and 0 <= v < len(tokens)):
        raise CheckpointError(f"{ck.path}: GGUF tokenizer.ggml.{field} {v!r} is not an id among its {len(tokens)} "
                              "tokens; the GGUF is corrupt, re-convert it")
    return v


def _dump(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")
