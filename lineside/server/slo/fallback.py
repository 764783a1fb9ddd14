"""Checks on the fallback bundle before the server starts: it must tokenize exactly as the primary does
(requests are tokenized once, then routed), so a bundle with another tokenizer is refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

from lineside.errors import LinesideError


def tokenizer_fingerprint(bundle: str | os.PathLike[str]) -> tuple:
    """The manifest's hashes of the tokenizer files and its tokenizer settings (BOS/EOS, chat template)."""
    from lineside.bundle import read_manifest

    manifest = read_manifest(bundle)
    files = tuple(sorted((rel, entry.sha256) for rel, entry in manifest.files.items() if rel.startswith("tokenizer/")))
    settings = repr(sorted((manifest.tokenizer or {}).items()))
    return files, settings


def check_fallback(primary: str | os.PathLike[str], fallback: str | os.PathLike[str]) -> None:
    """Raise one LinesideError line unless ``fallback`` is a bundle with the primary's tokenizer."""
    primary, fallback = Path(primary), Path(fallback)
    try:
        theirs = tokenizer_fingerprint(fallback)
    except LinesideError as e:
        raise LinesideError(f"--fallback {fallback}: {e}") from None
    ours = tokenizer_fingerprint(primary)
    if theirs[0] != ours[0]:
        raise LinesideError(f"--fallback {fallback}: its tokenizer differs from {primary.name}'s; a fallback must "
                            "use the same tokenizer (build it from the same model family)")
    if theirs[1] != ours[1]:
        raise LinesideError(f"--fallback {fallback}: its special tokens or chat template differ from "
                            f"{primary.name}'s; rebuild it from the same checkpoint's tokenizer")
