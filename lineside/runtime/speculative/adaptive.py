"""Per-sequence draft length: shrinks (down to 0, plain decode) while few drafts are accepted, grows back
while most are. The acceptance rate is an exponential average over verified (or shadow-checked) drafts."""

from __future__ import annotations


class DraftLength:
    def __init__(self, max_k: int, *, low: float = 0.3, high: float = 0.6, decay: float = 0.7):
        self.max_k, self.k = max_k, max_k
        self.low, self.high, self.decay = low, high, decay
        self.rate = 1.0  # optimistic start: speculate until the text shows it does not pay

    def observe(self, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` proposed tokens were kept (a shadow check at k = 0 passes 1 and 0/1)."""
        if drafted <= 0:
            return
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / drafted
        if self.rate < self.low:
            self.k //= 2
        elif self.rate >= self.high and self.k < self.max_k:
            self.k += 1
