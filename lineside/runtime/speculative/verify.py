"""The verification rule: which proposed tokens a row keeps, and the token the model adds after them.

Greedy (temperature 0): keep drafts while each equals the argmax at its position. Sampling: the
speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) with a deterministic proposer,
whose draft probability is 1: keep draft t with probability p(t); on a rejection sample from p with t
removed and renormalised. Then P(out = t) = p(t) and, for x ≠ t, P(out = x) = (1 - p(t)) · p(x) / (1 - p(t))
= p(x): every emitted token has the model's own distribution. After all drafts are kept, the bonus
token is sampled from the last position as in plain decoding.

Under a grammar, p at each position is the masked distribution plain decoding would use there: the
matcher is advanced by each kept draft to give the next position's mask, and rolled back afterwards,
so the sequence's matcher is where it was (``Sequence.on_token`` then accepts the tokens for real).
With logprobs asked for, every emitted token gets the logprob plain decoding would have reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lineside.runtime.sampling import Sampler, TokenLogprob
from lineside.runtime.structured import GrammarMatcher


@dataclass
class Verdict:
    kept: list[int]  # the drafts kept, in order
    token: int  # the token sampled after them (the correction, or the bonus when all were kept)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per kept draft, then the token's; when asked


def verify(sampler: Sampler, logits: np.ndarray, drafts: list[int], history: list[int],
           prompt_len: int) -> tuple[list[int], int]:
    """``logits[i]`` [≥ len(drafts)+1, vocab] predicts the token after ``history + drafts[:i]``.
    Returns (the drafts kept, the token sampled after them)."""
    v = verify_drafts(sampler, logits, drafts, history, prompt_len)
    return v.kept, v.token


def verify_drafts(sampler: Sampler, logits: np.ndarray, drafts: list[int], history: list[int], prompt_len: int, *,
                  matcher: GrammarMatcher | None = None, first_allowed: np.ndarray | None = None,
                  logprobs: int | None = None) -> Verdict:
    """As ``verify``, under ``matcher``'s grammar when given (``first_allowed``: its mask now, if already
    computed in a batch) and with the logprobs of every emitted token when ``logprobs`` is not None."""
    hist = list(history)
    out = Verdict([], -1)
    advanced = 0
    try:
        for i, t in enumerate(drafts):
            allowed = _mask(matcher, first_allowed if i == 0 else None)
            d = sampler.distribution(logits[i], hist, prompt_len, allowed=allowed)
            if isinstance(d, int):
                rejected: int | None = d if d != t else None
            elif not sampler.rng.random() < d[t]:
                rest = d.copy()
                rest[t] = 0.0
                rest /= rest.sum()  # > 0: a rejection needs p(t) < 1
                rejected = int(sampler.rng.choice(rest.shape[0], p=rest))
            else:
                rejected = None
            tok = t if rejected is None else rejected
            if logprobs is not None:
                out.logprobs.append(sampler.logprob(logits[i], tok, hist, prompt_len, allowed=allowed, top_n=logprobs))
            if rejected is not None:
                out.token = rejected
                return out
            out.kept.append(t)
            hist.append(t)
            if matcher is not None:
                if not matcher.accept(t):  # the mask allowed t, so the grammar takes it
                    raise RuntimeError(f"grammar matcher refused draft token {t} it had allowed: {matcher.error}")
                advanced += 1
        last = logits[len(drafts)]
        res = sampler.step(last, hist, prompt_len, allowed=_mask(matcher, first_allowed if not drafts else None),
                           logprobs=logprobs)
        out.token = res.token
        if res.logprob is not None:
            out.logprobs.append(res.logprob)
        return out
    finally:
        if matcher is not None:
            matcher.rollback(advanced)


def _mask(matcher: GrammarMatcher | None, given: np.ndarray | None) -> np.ndarray | None:
    if given is not None or matcher is None:
        return given
    return matcher.allowed()
