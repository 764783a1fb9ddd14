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
p(t), else sample from p with t removed and renormalised. After all drafts are kept, the bonus token is
sampled from the last position as in plain decoding.
"""

from __future__ import annotations

import numpy as np

from lineside.runtime.sampling import Sampler


def verify(sampler: Sampler, logits: np.ndarray, drafts: list[int], history: list[int],
           prompt_len: int, probs: list[np.ndarray] | None = None) -> tuple[list[int], int]:
    """``logits[i]`` [≥ len(drafts)+1, vocab] predicts the token after ``history + drafts[:i]``; ``probs[i]``:
    the distribution draft i was drawn from (None: a deterministic proposer).
    Returns (the drafts kept, the token sampled after them)."""
    hist = list(history)
    kept: list[int] = []
    for i, t in enumerate(drafts):
        d = sampler.distribution(logits[i], hist, prompt_len)
        if isinstance(d, int):
            if d != t:
                return kept, d
        else:
            q = None if probs is None else probs[i]
            qt = 1.0 if q is None else float(q[t])
            if not sampler.rng.random() * qt < d[t]:  # u < p(t) / q(t)
                return kept, _residual_sample(sampler, d, t, q)
        kept.append(t)
        hist.append(t)
    return kept, sampler(logits[len(drafts)], hist, prompt_len)


def _residual_sample(sampler: Sampler, p: np.ndarray, t: int, q: np.ndarray | None) -> int:
    if q is None:
        rest = p.copy()
        rest[t] = 0.0
    else:
        rest = np.maximum(p - q[:p.shape[0]], 0.0)
    total = rest.sum()
    if not total > 0:  # only reachable through rounding (a rejection needs p(t) < q(t))
        rest, total = p, p.sum()
    return int(sampler.rng.choice(rest.shape[0], p=rest / total))
