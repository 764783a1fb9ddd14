"""A small byte-level BPE tokenizer written next to tiny test checkpoints (shared by every test suite)."""

from __future__ import annotations

from pathlib import Path


def write_byte_tokenizer(out: Path, vocab_size: int) -> None:
    """A small byte-level BPE tokenizer so text paths work on tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        if len(vocab) >= vocab_size:
            break
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true, '
        '"chat_template": "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\\n{% endfor %}'
        '{% if add_generation_prompt %}assistant:{% endif %}"}')
