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


CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_family_tokenizer(out: Path, special: list[str], *, bos: str | None, eos: str, template: str,
                           gen_eos: list[str]) -> dict[str, int]:
    """A byte-level BPE tokenizer with a family's special tokens (Qwen2's ChatML, Llama 3's headers), saved by
    transformers as the family's checkpoints ship it, with generation_config.json's eos_token_id list; returns the
    special tokens' ids."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    ids = {t: tok.token_to_id(t) for t in special}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    fast.chat_template = template
    fast.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[t] for t in gen_eos]}))
    return ids
