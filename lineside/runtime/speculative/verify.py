"""The verification rule: which proposed tokens a row keeps, and the token the model adds after them.

Greedy (temperature 0): keep drafts while each equals the argmax at its position.

Sampling: the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023). The proposer drew draft
t from q (a draft model's distribution under the row's own sampling settings; a deterministic proposer
such as prompt lookup has q = 1 at t). Keep t with probability min(1, p(t)/q(t)); on a rejection sample
from the residual r = max(0, p - q) / Σ max(0, p - q). Then for every token x:
  P(out = x) = q(x) · min(1, p(x)/q(x)) + P(reject) · r(x)
             = min(p, q)(x) + (1 - Σ min(p, q)) · max(0, p - q)(x) / Σ max(0, p - q)
and since Σ max(0, p - q) = Σ (p - min(p, q)) = 1 - Σ min(p, q), this is min(p, q)(x) + max(0, p - q)(x) = p(x):
every emitted token has the model's own distribution. With q = 1 at t this is: keep t with probability
p(t), else sample from p with t removed and renormalised — which is what drawing x from p exactly as plain
decoding does (the row's generator, one draw) and keeping t when x = t, else emitting x, gives. So a
deterministic proposer's row draws once per emitted token, like plain decoding: a seeded request gets plain
decoding's tokens whether a step speculates or not (the batch's width, the draft length). After all drafts
are kept, the bonus token is sampled from the last position as in plain decoding.

Under a grammar, p at each position is the masked distribution plain decoding would use there: the
matcher is advanced by each kept draft to give the next position's mask, and rolled back afterwards,
so the sequence's matcher is where it was (``Sequence.on_token`` then accepts the tokens for real).
With logprobs asked for, every emitted token gets the logprob plain decoding would have reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lineside.runtime.sampling import Sampler, TokenLogprob
from lineside.runtime.speculative.config import Draft
from lineside.runtime.structured import GrammarMatcher


@dataclass
class Verdict:
    kept: list[int]  # the drafts kept, in order
    token: int  # the token sampled after them (the correction, or the bonus when all were kept)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per kept draft, then the token's; when asked


def verify(sampler: Sampler, logits: np.ndarray, drafts: list[int], history: list[int],
           prompt_len: int, probs: list[np.ndarray] | None = None) -> tuple[list[int], int]:
    """``logits[i]`` [≥ len(drafts)+1, vocab] predicts the token after ``history + drafts[:i]``; ``probs[i]``:
    the distribution draft i was drawn from (None: a deterministic proposer).
    Returns (the drafts kept, the token sampled after them)."""
    v = verify_drafts(sampler, logits, drafts, history, prompt_len, probs=probs)
    return v.kept, v.token


def verify_drafts(sampler: Sampler, logits: np.ndarray, drafts: list[int], history: list[int], prompt_len: int, *,
                  matcher: GrammarMatcher | None = None, first_allowed: np.ndarray | None = None,
                  logprobs: int | None = None, probs: list[np.ndarray] | None = None) -> Verdict:
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
            elif probs is None:  # q = 1 at t: draw as plain decoding does, keep t if that is the draw
                x = int(sampler.rng.choice(d.shape[0], p=d))
                rejected = None if x == t else x
            else:
                q = probs[i]
                keep = sampler.rng.random() * float(q[t]) < d[t]  # u < p(t) / q(t)
                rejected = None if keep else _residual_sample(sampler, d, q)
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


def scorable(matcher: GrammarMatcher | None, draft: Draft) -> Draft:
    """The part of a model proposer's draft worth scoring under ``matcher``'s grammar: nothing past the first
    token it forbids (that one can never be kept). A deterministic draft (greedy, q = 1) is cut before it. A
    sampled one keeps it: its rejection then samples the residual max(0, p - q), without which the position
    would not follow p (sampling p there instead counts q's allowed mass twice)."""
    if matcher is None or not draft.tokens:
        return draft
    n = matcher.validate(draft.tokens) + (draft.probs is not None)
    return Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n])


def _mask(matcher: GrammarMatcher | None, given: np.ndarray | None) -> np.ndarray | None:
    if given is not None or matcher is None:
        return given
    return matcher.allowed()


def _residual_sample(sampler: Sampler, p: np.ndarray, q: np.ndarray) -> int:
    rest = np.maximum(p - q[:p.shape[0]], 0.0)
    total = rest.sum()
    if not total > 0:  # only reachable through rounding (a rejection needs p(t) < q(t))
        rest, total = p, p.sum()
    return int(sampler.rng.choice(rest.shape[0], p=rest / total))
