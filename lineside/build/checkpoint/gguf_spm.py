"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model == "llama"``) as a tokenizer.json.

llama.cpp's SPM tokenizer (llm_tokenizer_spm_session in src/llama-vocab.cpp) starts from UTF-8
characters, repeatedly merges the adjacent pair whose concatenation is a token with the highest
score (leftmost first on ties), and falls back to ``<0xXX>`` byte tokens. Every raw-text fragment
(the text between special tokens) gets a ``▁`` prefix when add_space_prefix is set, spaces become
``▁``. A BPE with merges ranked by the merged token's score, byte fallback and a
Prepend("▁") + Replace(" ", "▁") normalizer (run per fragment) does the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lineside.errors import CheckpointError

if TYPE_CHECKING:
    from lineside.build.checkpoint.gguf_file import GGUFCheckpoint

SPACE = "\u2581"


def spm_tokenizer(ck: GGUFCheckpoint, tokens: list[str], types: list[int]) -> tuple[Any, dict[str, Any]]:
    """Build the tokenizers.Tokenizer; returns it with llama.cpp's SPM defaults (add_bos, ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    from lineside.build.checkpoint.gguf_tokenizer import _add_special, _vocab

    scores = ck.meta("tokenizer.ggml.scores")
    if scores is None or len(scores) < len(tokens):
        raise CheckpointError(f"{ck.path}: SPM vocabulary without tokenizer.ggml.scores; re-convert the model")
    vocab = _vocab(ck, tokens)
    merges = _merges_by_score(tokens, scores, vocab)
    unk_id = ck.meta("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(ck.meta("tokenizer.ggml.add_space_prefix", True))
    # A normalizer, not Metaspace: Metaspace skips the prefix when a fragment already starts with
    # a space, llama.cpp does not. Normalizers run per fragment between added tokens.
    norm = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*norm, normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    _add_special(tok, tokens, types, AddedToken)
    return tok, {"add_bos": True, "clean_spaces": False, "default_bos": 1, "default_eos": 2}


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of every token whose halves are tokens, best merged score first.

    Ties (same merged token, several splits) keep the shorter left piece first, which is the
    split llama.cpp reaches when it merges left to right.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for tid, t in enumerate(tokens):
        for i in range(1, len(t)):
            a, b = t[:i], t[i:]
            if a in vocab and b in vocab:
                ranked.append((-float(scores[tid]), tid, i, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]
