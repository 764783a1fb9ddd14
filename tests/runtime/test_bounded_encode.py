"""Counting a long prompt in pieces with an early stop (runtime/bounded_encode): for every pre-tokenizer family
the project builds (llama.cpp's regexes as gguf_tokenizer writes them, and GPT-2 byte-level from HF checkpoints)
the pieces encode to exactly the whole text's ids, so a refusal only ever refuses a prompt that cannot fit and
an accepted prompt's ids are the tokenizer's own; tokenizers outside that family are encoded whole."""

from __future__ import annotations

import json
import pickle
import random
import re
import unicodedata

import pytest

from lineside.build.checkpoint import gguf_tokenizer as gt
from lineside.runtime.bounded_encode import (
    _CUT,
    CountPlan,
    PromptTooLong,
    TokenBudget,
    cuts_are_exact,
    encode_within,
    piece_chars,
)

FAMILIES = {
    "gpt2-bytelevel": None,  # HF checkpoints' ByteLevel(use_regex=True)
    "smollm": [r"\p{N}", gt.GPT2],
    "llama3": [gt.LLAMA3],
    "qwen2": [gt.QWEN2],
    "deepseek-v3": gt.DEEPSEEK3,
    "default": gt.DEFAULT,
}
ALPHABET = (list("abcdefghijklmnopqrstuvwxyzABCXYZ") * 3 + list("0123456789") * 2 + list(".,;:!?'\"()[]{}-_/\\$<>|")
            + [" "] * 30 + ["\t"] * 4 + ["\n"] * 6 + ["\r\n", "'s", "'LL", "\u00a0", "\u3000", "\u4e2d", "\u6587",
                                                     "\u3072", "\u00e9", "e\u0301", "\u041f", "\U0001f600", "<|x|>"])


def _corpus(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def _tokenizer(regexes, *, normalizer=None, added=()):
    """A byte-level BPE trained on random text (a few hundred merges) with this pre-tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if regexes is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    words = "the sensor reads torque ok pressure line station".split()
    text = [" ".join(rng.choice(words) for _ in range(40)) + _corpus(rng, 200) for _ in range(50)]
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    for token in added:
        tok.add_tokens([token])
    return tok


@pytest.fixture(scope="module")
def family_tokenizers():
    return {name: _tokenizer(regexes) for name, regexes in FAMILIES.items()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_pieces_are_the_whole_texts_ids(family_tokenizers, name):
    tok = family_tokenizers[name]
    assert cuts_are_exact(tok)
    rng = random.Random(hash(name) & 0xFFFF)
    for _ in range(20):
        text = _corpus(rng, 600) + " <|im_start|>" + _corpus(rng, 300)
        whole = tok.encode(text, add_special_tokens=False).ids
        cuts = [m.start() for m in _CUT.finditer(text)]
        assert len(cuts) > 20
        bounds = zip([0, *cuts], [*cuts, len(text)], strict=True)
        pieces = [tok.encode(text[a:b], add_special_tokens=False).ids for a, b in bounds]
        assert [i for p in pieces for i in p] == whole


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_early_stop_refuses_only_what_cannot_fit(family_tokenizers, name):
    tok = family_tokenizers[name]
    plan = CountPlan.for_tokenizer(tok)
    rng = random.Random(7)
    words = "the sensor reads torque ok pressure line station".split()
    for text in (_corpus(rng, 3 * piece_chars(1000)),  # ~1-2 characters a token
                 " ".join(rng.choice(words) + rng.choice(["", ",", "."]) for _ in range(3000))):  # ~4-6
        whole = tok.encode(text, add_special_tokens=False).ids
        for limit in (1000, len(whole) // 3, len(whole) - 1, len(whole), len(whole) + 1):
            counting = _Counting(tok)
            try:
                ids = encode_within(counting, text, TokenBudget(limit), plan)
            except PromptTooLong as e:  # a count that is true of what was read: never more than the whole has
                assert limit < e.tokens <= len(whole) and e.chars_read <= len(text)
                if limit < len(whole) // 2:
                    assert sum(counting.calls) < len(text) * 0.75  # stopped early: most of it never encoded
            else:
                assert ids == whole  # accepted: the tokenizer's own ids
                assert limit >= len(whole) or len(text) <= piece_chars(limit)  # only what it had to encode whole
        with pytest.raises(PromptTooLong):
            encode_within(tok, text, TokenBudget(len(whole) // 3), plan)


class _Counting:
    """A tokenizer that records how many characters each encode call was given."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, add_special_tokens=False):
        self.calls.append(len(text))
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


def test_a_long_text_is_refused_from_its_bytes_alone(family_tokenizers):
    """Far longer than the limit: the byte bound refuses it without one encode call, with a true lower bound."""
    tok = family_tokenizers["smollm"]
    plan = CountPlan.for_tokenizer(tok)
    words = "the sensor reads torque ok pressure line station".split()
    text = " ".join(words[i % len(words)] for i in range(20000))
    counting = _Counting(tok)
    with pytest.raises(PromptTooLong) as e:
        encode_within(counting, text, TokenBudget(1000), plan)
    assert counting.calls == [] and 1000 < e.value.tokens <= len(tok.encode(text, add_special_tokens=False).ids)


def test_tokenizers_outside_the_family_are_encoded_whole():
    from tokenizers import AddedToken, normalizers

    spm_like = _tokenizer([gt.GPT2], normalizer=normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                                    normalizers.Replace(" ", "\u2581")]))
    assert not cuts_are_exact(spm_like)
    assert not cuts_are_exact(_tokenizer([gt.GPT2], normalizer=normalizers.NFKC()))
    assert not cuts_are_exact(_tokenizer([gt.GPT2], added=[AddedToken("<sep>", rstrip=True)]))
    assert not cuts_are_exact(_tokenizer([gt.GPT2], added=[AddedToken("new line", special=False)]))
    assert not cuts_are_exact(_tokenizer([r"\w+ \w+|\s+"]))  # a regex whose matches span a space: the probe sees it
    assert not cuts_are_exact(_tokenizer([r"(?<=a) "]))
    assert cuts_are_exact(_tokenizer([gt.QWEN2], normalizer=normalizers.NFC()))  # Qwen2's own normalizer
    # encoded whole, the limit still holds and the ids are the tokenizer's
    text = "word " * 3000
    whole = spm_like.encode(text, add_special_tokens=False).ids
    # encoded whole (no early stop possible), the ids are the tokenizer's; their exact count is the caller's to judge
    budget = TokenBudget(len(whole) - 1)
    assert encode_within(spm_like, text, budget, None) == whole and budget.used == len(whole)


def test_python_whitespace_covers_unicode_white_space():
    """A cut needs a non-space before it; Python's \\s must know every character the tokenizers' regexes call \\s
    (Unicode White_Space), else a cut could fall inside a run of whitespace."""
    white_space = [0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
                   0x205F, 0x3000]
    assert all(re.fullmatch(r"\s", chr(c)) for c in white_space)
    assert all(unicodedata.category(chr(c)) in ("Zs", "Zl", "Zp", "Cc") for c in white_space)


def test_prompt_too_long_crosses_processes():
    e = pickle.loads(pickle.dumps(PromptTooLong(5000, 9000, 4095)))
    assert (e.tokens, e.chars_read, e.limit) == (5000, 9000, 4095) and "4095" in str(e)


def test_chat_prompts_keep_their_ids_and_stop_early(tmp_path, family_tokenizers):
    from lineside.runtime.tokenizer import Tokenizer

    hf = family_tokenizers["llama3"]
    hf.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer(tmp_path)
    rng = random.Random(3)
    content = _corpus(rng, 20000) + " <|im_end|> fake turn " + _corpus(rng, 20000)  # special text: stays text
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    whole = tok.encode_chat(msgs)
    assert tok.encode_chat(msgs, max_tokens=len(whole)) == whole
    assert tok.encode(content, max_tokens=10**6) == tok.encode(content)
    try:  # just under: refused only if counting in pieces got that far, and then with a count that is true
        assert tok.encode_chat(msgs, max_tokens=len(whole) - 1) == whole
    except PromptTooLong as e:
        assert len(whole) - 1 < e.tokens <= len(whole)
    counting = _Counting(hf)
    tok._tok = counting  # what the chat path hands the tokenizers library
    with pytest.raises(PromptTooLong) as e:
        tok.encode_chat(msgs, max_tokens=500)
    assert 500 < e.value.tokens <= len(whole)
    assert sum(counting.calls) < 5 * piece_chars(500)  # a few pieces at most, not the 40k characters


@pytest.mark.parametrize("name", ["smollm", "llama3"])
def test_a_stretch_without_cuts_is_bounded_from_below_soundly(family_tokenizers, name):
    """A long run with no space to cut at (``abab...``) is refused from its bytes and the longest token its bytes
    allow, without encoding it; the bound never exceeds the true count."""
    tok = family_tokenizers[name]
    plan = CountPlan.for_tokenizer(tok)
    assert plan.bytes is not None
    rng = random.Random(11)
    for charset in ("ab", "a", "=", "xyz01", "sensor", "thequickbrownfox.,;", "\u4e2d\u6587e\u0301", "ab\n  ="):
        for run in ("".join(rng.choice(charset) for _ in range(3000)), charset * 500, "x\n" + " " * 40 + charset * 500):
            true = len(tok.encode(run, add_special_tokens=False).ids)
            assert 0 < plan.at_least(run) <= true, (charset, plan.at_least(run), true)
    counting = _Counting(tok)
    run = "ab" * 20000
    with pytest.raises(PromptTooLong) as e:
        encode_within(counting, run, TokenBudget(500), plan)
    assert counting.calls == [] and e.value.tokens > 500  # refused from the bound alone
    calls = counting.calls
    fits = "sensor" * 300  # a stretch longer than two pieces whose bound leaves room: encoded, exactly
    whole = tok.encode(fits, add_special_tokens=False).ids
    assert len(fits) > 2 * piece_chars(len(whole))
    assert encode_within(counting, fits, TokenBudget(len(whole)), plan) == whole and calls


def test_byte_alphabet_is_gpt2s():
    from tokenizers import pre_tokenizers

    from lineside.runtime.bounded_encode import _byte_decoder

    table = _byte_decoder()
    assert sorted(table.values()) == list(range(256)) and set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table["\u0120"] == 0x20 and table["\u010a"] == 0x0A and table["A"] == 0x41
