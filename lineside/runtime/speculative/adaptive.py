"""Per-sequence draft length: speculate with the full k while the expected tokens per verification step beat
what a verification step costs (in 1-token steps), else plain decode (k = 0) until the text matches again.

The per-token acceptance a is estimated as kept / (kept + rejections), exponentially averaged (each verified
step keeps a run of drafts and ends in at most one rejection: the geometric model's estimate). A step with k
drafts then yields E(k) = (1 - a^(k+1)) / (1 - a) tokens. At k = 0 the scheduler keeps checking a cheap
proposer's 1-token guess against the sampled token, so the estimate — and k — can come back.
"""

from __future__ import annotations


class DraftLength:
    def __init__(self, max_k: int, *, verify_cost: float = 1.0, decay: float = 0.8):
        """``verify_cost``: a verification step's time in 1-token decode steps (the backend's; 1.0: free)."""
        self.max_k, self.k = max_k, max_k
        self.verify_cost, self.decay = verify_cost, decay
        self.kept, self.rejected = 3.0, 1.0  # optimistic start (a = 0.75): speculate until the text says no

    @property
    def acceptance(self) -> float:
        """Estimated probability that the next proposed token is kept."""
        return self.kept / (self.kept + self.rejected)

    def expected_tokens(self, k: int) -> float:
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def observe(self, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` proposed tokens were kept (a shadow check at k = 0 passes 1 and 0/1)."""
        if drafted <= 0:
            return
        self.kept = self.decay * self.kept + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)
        self.k = self.max_k if self.expected_tokens(self.max_k) >= self.verify_cost else 0
