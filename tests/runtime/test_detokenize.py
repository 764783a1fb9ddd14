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
