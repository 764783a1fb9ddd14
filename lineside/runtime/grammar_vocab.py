"""A tokenizer.json as the grammar engine can read it: SentencePiece decoders llguidance does not recognise, rewritten.

llguidance learns each token's bytes from the decoder: it reads only ``ByteLevel`` or a ``Sequence`` holding
``ByteFallback`` (with a ``Replace`` of ``▁`` by a space), and refuses every other one ("can't determine decoder
type"), which made every structured-output and logprobs request a 500 on such a model. Two SentencePiece decoders
checkpoints ship are refused: ``Metaspace`` (transformers' generic SPM conversion) and a ``Sequence`` of
``Replace``/``Fuse``/``Strip`` without ``ByteFallback`` (an SPM vocabulary trained without byte fallback). Both
write a token as its piece with ``▁`` made a space, which is what llguidance's SentencePiece reading does; the
copy given to it says so, and the real tokenizer (what the answer is decoded with) is left alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def readable_tokenizer_json(tokenizer_json: str) -> str:
    """``tokenizer_json`` with a SentencePiece decoder llguidance cannot read replaced by one it reads that gives
    every token the same bytes; unchanged when it reads it already (or when no rewrite says the same)."""
    spec = json.loads(tokenizer_json)
    decoder = spec.get("decoder")
    if not isinstance(decoder, dict) or _readable(decoder):
        return tokenizer_json
    space = _space_piece(decoder)
    if space is None:
        return tokenizer_json
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": space}, "content": " "}, {"type": "ByteFallback"}]}
    # llguidance reads a piece named <0xNN> as that byte once ByteFallback is there; the real decoder writes it as
    # its six characters. Such pieces are named special in the copy, so a grammar never allows them.
    vocab = (spec.get("model") or {}).get("vocab")
    taken = {t.get("id") for t in spec.get("added_tokens") or []}
    if isinstance(vocab, dict):
        spec["added_tokens"] = [*(spec.get("added_tokens") or []), *(
            {"id": i, "content": piece, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True} for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece) and i not in taken)]
    return json.dumps(spec, ensure_ascii=False)


def _readable(decoder: dict[str, Any]) -> bool:
    """Whether llguidance determines this decoder's type itself (byte-level, or SentencePiece with byte fallback)."""
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(
        isinstance(d, dict) and d.get("type") in ("ByteLevel", "ByteFallback") for d in decoder.get("decoders") or [])


def _space_piece(decoder: dict[str, Any]) -> str | None:
    """The one character a SentencePiece decoder turns into a space (``▁``), or None for any other decoder."""
    if decoder.get("type") == "Metaspace":
        r = decoder.get("replacement")
        return r if isinstance(r, str) and len(r) == 1 else None
    if decoder.get("type") != "Sequence":
        return None
    for d in decoder.get("decoders") or []:
        if isinstance(d, dict) and d.get("type") == "Replace" and d.get("content") == " ":
            s = (d.get("pattern") or {}).get("String")
            if isinstance(s, str) and len(s) == 1:
                return s
    return None
