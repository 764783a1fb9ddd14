"""vLLM's ``prompt_logprobs`` request field: each prompt token's logprob, rank and text, with the top alternatives.

The shape is vLLM's (a list the length of the prompt: null for the first token, which nothing scores, then per
position a dict from token id, as a JSON string key, to ``{logprob, rank, decoded_token}``, the prompt's own token
first and then the ``prompt_logprobs`` most likely ones), so clients written against vLLM read it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lineside.runtime.sampling import MAX_TOP_LOGPROBS, TokenLogprob
from lineside.server.errors import APIError


def requested(value: Any) -> int | None:
    """How many alternatives per prompt token a request asks for (None: no prompt logprobs); a 400 naming the field
    for anything but an integer 0..20 (vLLM's -1, the whole vocabulary, is refused: it is that many numbers a token)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"prompt_logprobs: must be an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per "
                            f"prompt token), got {value!r}", "invalid_value", param="prompt_logprobs")
    return value


def prompt_logprobs_json(lps: Sequence[TokenLogprob], top_n: int, decode: Callable[[int], str]) -> list[Any]:
    """The response's ``prompt_logprobs``: ``lps`` score prompt tokens 1 on (the engine's, with at least ``top_n``
    alternatives and each token's rank); ``decode``: one token id's text, as vLLM's ``decoded_token``."""
    texts: dict[int, str] = {}

    def entry(tid: int, logprob: float, rank: int | None) -> dict[str, Any]:
        if tid not in texts:
            texts[tid] = decode(tid)
        return {"logprob": logprob, "rank": rank, "decoded_token": texts[tid]}

    out: list[Any] = [None]
    for t in lps:
        position = {str(t.token): entry(t.token, t.logprob, t.rank)}
        for place, (tid, value) in enumerate(t.top[:top_n]):
            position.setdefault(str(tid), entry(tid, value, place + 1))
        out.append(position)
    return out
