"""Invisible characters pasted into prompts: stripped the same way by the server and the CLI, so one prompt gives
the same token ids (and answer) through `lineside generate`/`chat` as through the HTTP API."""

from __future__ import annotations

import re

# BOM, zero-width space, word joiner, Mongolian vowel separator, soft hyphen: invisible, never meant.
_INVISIBLE = re.compile("[\ufeff\u200b\u2060\u180e\u00ad]")
# ZWJ / ZWNJ carry meaning inside emoji sequences and Indic / Persian words: removed only where they
# touch ASCII or the ends of the text (pasted artefacts), kept between two non-ASCII characters.
_JOINER = re.compile(r"(?:(?<=[\x00-\x7f])|^)[\u200c\u200d]+|[\u200c\u200d]+(?=[\x00-\x7f]|$)")


def strip_invisible(text: str) -> str:
    """``text`` without the BOM, zero-width characters and stray joiners (valid Unicode expected)."""
    if text.isascii():
        return text
    return _JOINER.sub("", _INVISIBLE.sub("", text))
