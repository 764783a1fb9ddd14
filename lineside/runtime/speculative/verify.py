"""The verification rule: which proposed tokens a row keeps, and the token the model adds after them.

Greedy (temperature 0): keep drafts while each equals the argmax at its position. Sampling: the
speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) with a deterministic proposer,
whose draft probability is 1: keep draft t with probability p(t); on a rejection sample from p with t
removed and renormalised. Then P(out = t) = p(t) and, for x ≠ t, P(out = x) = (1 - p(t)) · p(x) / (1 - p(t))
= p(x): every emitted token has the model's own distribution. After all drafts are kept, the bonus
token is sampled from the last position as in plain decoding.
"""

from __future__ import annotations

import numpy as np

from lineside.runtime.sampling import Sampler


def verify(sampler: Sampler, logits: np.ndarray, drafts: list[int], history: list[int],
           prompt_len: int) -> tuple[list[int], int]:
    """``logits[i]`` [≥ len(drafts)+1, vocab] predicts the token after ``history + drafts[:i]``.
    Returns (the drafts kept, the token sampled after them)."""
    hist = list(history)
    kept: list[int] = []
    for i, t in enumerate(drafts):
        d = sampler.distribution(logits[i], hist, prompt_len)
        if isinstance(d, int):
            if d != t:
                return kept, d
        elif not sampler.rng.random() < d[t]:
            rest = d.copy()
            rest[t] = 0.0
            rest /= rest.sum()  # > 0: a rejection needs p(t) < 1
            return kept, int(sampler.rng.choice(rest.shape[0], p=rest))
        kept.append(t)
        hist.append(t)
    return kept, sampler(logits[len(drafts)], hist, prompt_len)
