"""Per-sequence draft length: speculate with the k that gives the most tokens per unit of time, while that
beats plain decoding, else plain decode (k = 0) until the text matches again.

The per-token acceptance a is estimated as kept / (kept + rejections), exponentially averaged (each verified
step keeps a run of drafts and ends in at most one rejection: the geometric model's estimate). A step with k
drafts then yields E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs ``verify_cost`` + k · (``verify_token_cost``
+ ``draft_cost``) 1-token decode steps: the backend's fixed part of a verification step and what each drafted
token adds to it, and a draft model's cost per proposed token (0 for prompt lookup). Where the per-token part
is real (onnxruntime on CPU: each token adds about a quarter of a step) the best k follows the acceptance —
long drafts while the text is copied, one or two where guesses are hit and miss — rather than all or nothing.
At k = 0 the scheduler keeps checking a cheap proposer's 1-token guess against the sampled token,
so the estimate — and k — can come back; a model proposer instead gets a 1-token probe every
``probe_every`` steps, the interval doubling (up to ``probe_max``) after each failed probe, so a draft that
never agrees (an untrained layerskip cut) costs almost nothing.
"""

from __future__ import annotations


class DraftLength:
    def __init__(self, max_k: int, *, verify_cost: float = 1.0, verify_token_cost: float = 0.0, decay: float = 0.8,
                 draft_cost: float = 0.0, probe_every: int = 16, probe_max: int = 256):
        """``verify_cost``: a verification step's time in 1-token decode steps, ``verify_token_cost``: what each
        drafted token adds to it (the backend's; 1.0 and 0.0: free)."""
        self.max_k, self.k = max_k, max_k
        self.verify_cost, self.decay, self.draft_cost = verify_cost, decay, draft_cost
        self.verify_token_cost = verify_token_cost
        self.probe_every, self.probe_max, self._interval, self._idle = probe_every, probe_max, probe_every, 0
        self.kept, self.rejected = 3.0, 1.0  # optimistic start (a = 0.75): speculate until the text says no
        self._choose()

    @property
    def acceptance(self) -> float:
        """Estimated probability that the next proposed token is kept."""
        return self.kept / (self.kept + self.rejected)

    def expected_tokens(self, k: int) -> float:
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def speedup(self, k: int) -> float:
        """Tokens per unit of time with k drafts, relative to plain decoding."""
        return self.expected_tokens(k) / (self.verify_cost + k * (self.verify_token_cost + self.draft_cost))

    def budget(self, cheap: bool) -> int:
        """Drafts to ask for this step: k; at k = 0 a model proposer (no free shadow guess) gets a 1-token
        probe now and then, so a text that starts to match can win speculation back."""
        if self.k or cheap or self.probe_every <= 0:
            return self.k
        self._idle += 1
        if self._idle >= self._interval:
            self._idle = 0
            return 1
        return 0

    def observe(self, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` proposed tokens were kept (a shadow check at k = 0 passes 1 and 0/1)."""
        if drafted <= 0:
            return
        if self.k == 0:  # a probe (or a shadow guess): back off while it keeps failing
            self._interval = self.probe_every if accepted else min(2 * self._interval, self.probe_max)
        self.kept = self.decay * self.kept + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)
        self._choose()

    def _choose(self) -> None:
        best = max(range(1, self.max_k + 1), key=self.speedup)
        self.k = best if self.speedup(best) >= 1.0 else 0
