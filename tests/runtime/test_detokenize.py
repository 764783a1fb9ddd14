"""Incremental detokenization on byte-level BPE and on SentencePiece-style byte-fallback vocabularies."""

from __future__ import annotations

import pytest

from lineside.runtime.detokenize import IncrementalDetokenizer
from lineside.runtime.tokenizer import Tokenizer

TEXTS = ["plain ascii", "你好，世界", "emoji 😀🚀 and 👩‍👩‍👧", "é è ü ß", "mixed 日本語 ✓ end"]


def byte_fallback_dir(tmp_path):
    """A Llama-2-style vocabulary: a few whole characters, everything else as <0xNN> byte tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "abcdefghijklmnopqrstuvwxyz ▁你":
        vocab.setdefault(ch, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def stream(tok, ids):
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(i) for i in ids]
    return pieces, "".join(pieces) + d.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_never_breaks_characters(tmp_path, text):
    tok = Tokenizer(byte_fallback_dir(tmp_path))
    ids = tok.encode(text, add_special=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids) or text.isascii()
    pieces, whole = stream(tok, ids)
    assert whole == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_never_breaks_characters(tiny_bundle, text):
    tok = Tokenizer(tiny_bundle / "tokenizer")
    ids = tok.encode(text, add_special=False)
    pieces, whole = stream(tok, ids)
    assert whole == text and all("\ufffd" not in p for p in pieces)


def test_truncated_character_is_dropped_at_the_end(tiny_bundle):
    tok = Tokenizer(tiny_bundle / "tokenizer")
    ids = tok.encode("ok 😀", add_special=False)[:-1]  # the emoji's last byte never comes
    pieces, whole = stream(tok, ids)
    assert whole == "ok " and all("\ufffd" not in p for p in pieces)


def llama2_dir(tmp_path):
    """A Llama 2 / Mistral-style SentencePiece vocabulary as transformers (and gguf_spm) write it: "▁" prepended to
    the text, byte fallback, and a decoder that strips the space this adds in front of the first token."""
    import json

    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "T", "h", "e", "c", "a", "p", "i", "t", "l", "s", "P", "r", "o", "k", "▁T", "▁c", "▁i", "▁P"):
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "T"), ("▁", "c"), ("▁", "i"), ("▁", "P")]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(tmp_path, {"bos_token_id": 1, "eos_token_ids": [2], "add_bos_token": True})


def sequence_text(tok, prompt, generated):
    """The text a request's events carry for ``generated`` after ``prompt`` (what the server streams)."""
    from lineside.runtime.request import GenerationRequest, RequestHandle
    from lineside.runtime.sequence import Sequence

    seq = Sequence(RequestHandle(GenerationRequest(prompt_ids=prompt, max_tokens=len(generated))), tok, {2}, 256)
    pieces = [seq.on_token(i, 0.0).text for i in generated]
    return pieces, "".join(pieces)


def test_completion_keeps_the_space_its_first_token_starts_with(tmp_path):
    """On a SentencePiece vocabulary the decoder drops the space in front of the first token of a text; a
    completion's first token is not the first of the text, so "The capital is" goes on with " Paris", as vLLM,
    llama.cpp's server and transformers' text-generation pipeline return it. It was "Paris": prompt + completion
    read "The capital isParis"."""
    tok = llama2_dir(tmp_path)
    prompt = tok.encode("The capital is")
    generated = tok.encode("The capital is Paris")[len(prompt):]
    assert tok.id_to_token(generated[0]) == "▁P"
    expected = tok.decode(prompt + generated)[len(tok.decode(prompt)):]
    assert expected == " Paris"
    assert sequence_text(tok, prompt, generated)[1] == expected


@pytest.mark.parametrize("make", ["byte_level", "byte_fallback"])
def test_prompt_ending_inside_a_character_is_completed_not_replaced(tmp_path, tiny_bundle, make):
    """A prompt given as token ids may end inside a character (the emoji's first bytes); the tokens that complete
    it decode alone to U+FFFD, which was streamed as text. As vLLM's detokenizer (primed with the prompt's tail),
    the completed character is the completion's text."""
    tok = Tokenizer(tiny_bundle / "tokenizer") if make == "byte_level" else llama2_dir(tmp_path)
    ids = tok.encode("ok 😀!", add_special=False)
    cut = next(i for i in range(len(ids), 0, -1) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt, generated = ids[:cut], ids[cut:]
    pieces, text = sequence_text(tok, prompt, generated)
    assert text == "😀!" and all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("make", ["byte_level", "byte_fallback"])
def test_completion_after_any_whole_prompt_is_the_rest_of_the_text(tmp_path, tiny_bundle, make):
    """Cut anywhere a long run of multi-byte characters (byte tokens, several per character) is whole, the generated
    tokens give exactly the rest of the text: the prompt's tokens decoded for context start at a character's first
    byte (a run of byte-fallback tokens that starts inside one decodes to U+FFFD throughout)."""
    tok = Tokenizer(tiny_bundle / "tokenizer") if make == "byte_level" else llama2_dir(tmp_path)
    ids = tok.encode("a 👨\u200d👩\u200d👧 中文 ok", add_special=False)
    cuts = [i for i in range(1, len(ids)) if "\ufffd" not in tok.decode(ids[:i])]
    assert len(cuts) >= 6 and max(cuts) > 12
    for cut in cuts:
        pieces, text = sequence_text(tok, ids[:cut], ids[cut:])
        assert text == tok.decode(ids)[len(tok.decode(ids[:cut])):], cut
        assert all("\ufffd" not in p for p in pieces), cut


@pytest.mark.parametrize("make", ["byte_level", "byte_fallback"])
@pytest.mark.parametrize("text", ["caf\ufffd then more", "\ufffd\ufffd ok", "x \ufffd😀 y", "日本\ufffd語"])
def test_prompt_ending_in_a_real_replacement_character_is_not_repeated(tmp_path, tiny_bundle, make, text):
    """A prompt may hold U+FFFD itself (text pasted from a broken encoding): a whole character, not one the prompt
    leaves incomplete. Its last U+FFFD was taken for an incomplete character and streamed again as the first text
    of the completion ("caf\ufffd" went on with "\ufffd then more")."""
    tok = Tokenizer(tiny_bundle / "tokenizer") if make == "byte_level" else llama2_dir(tmp_path)
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
    cuts = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd") and
            tok.decode(ids[:i]).count("\ufffd") == text[:len(tok.decode(ids[:i]))].count("\ufffd")]
    assert cuts  # prompts that end on a real U+FFFD
    for cut in cuts:
        pieces, out = sequence_text(tok, ids[:cut], ids[cut:])
        assert out == text[len(tok.decode(ids[:cut])):], cut


def test_prompt_ending_in_a_stray_byte_then_inside_a_character_streams_only_the_character(tiny_bundle):
    """Prompt ids that end in a stray continuation byte (U+FFFD for good) and the first bytes of an emoji: the tokens
    completing the emoji give the emoji, not the stray byte's U+FFFD again in front of it."""
    tok = Tokenizer(tiny_bundle / "tokenizer")
    emoji = tok.encode("😀!", add_special=False)
    stray = emoji[1]  # the emoji's second byte (0x9F) alone: no character starts so
    prompt = [*tok.encode("a ", add_special=False), stray, *emoji[:2]]
    assert tok.decode(prompt) == "a \ufffd\ufffd" and tok.decode(prompt + emoji[2:]) == "a \ufffd😀!"
    pieces, text = sequence_text(tok, prompt, emoji[2:])
    assert text == "😀!" and all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("make", ["byte_level", "byte_fallback"])
def test_prompt_ending_inside_a_character_after_a_whole_one_does_not_repeat_it(tmp_path, tiny_bundle, make):
    """Prompt ids that end in 👨 and the first byte of the ZWJ after it: a byte-fallback decoder turns a run of byte
    tokens that is not UTF-8 as a whole into U+FFFD throughout, 👨 included, so 👨 was taken for part of the
    incomplete character and streamed again in front of the ZWJ that completes it."""
    tok = Tokenizer(tiny_bundle / "tokenizer") if make == "byte_level" else llama2_dir(tmp_path)
    ids = tok.encode("ok 👨\u200d👩 end", add_special=False)
    cut = next(i for i in range(len(ids)) if tok.decode(ids[:i]) == "ok 👨") + 1  # and the ZWJ's first byte
    pieces, text = sequence_text(tok, ids[:cut], ids[cut:])
    assert text == "\u200d👩 end" and all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("make", ["byte_level", "byte_fallback"])
def test_prompt_ending_inside_a_character_of_a_long_byte_run_is_completed(tmp_path, tiny_bundle, make):
    """Prompt ids that end inside a character, the last of a run of byte tokens longer than the context window
    decoded in front of the completion: the window had to start at a character's first byte, which it looked
    for as a start that does not decode to U+FFFD; a byte-fallback decoder turns the whole run into U+FFFD while
    its last character is incomplete, so none was found and "字符 end" came out as "�������� end"."""
    tok = Tokenizer(tiny_bundle / "tokenizer") if make == "byte_level" else llama2_dir(tmp_path)
    text = "ok 中文字符中文字符中文字符 end"
    ids = tok.encode(text, add_special=False)
    cuts = [i for i in range(len(ids) - 12, len(ids) - 4) if tok.decode(ids[:i]) != text[:len(tok.decode(ids[:i]))]]
    assert len(cuts) >= 4  # prompts that end inside a character
    for cut in cuts:
        pieces, out = sequence_text(tok, ids[:cut], ids[cut:])
        whole = max(n for n in range(len(text)) if ids[:cut][:len(tok.encode(text[:n], add_special=False))] ==
                    tok.encode(text[:n], add_special=False))  # the prompt's whole characters
        assert out == text[whole:], cut
        assert "\ufffd" not in out, cut
