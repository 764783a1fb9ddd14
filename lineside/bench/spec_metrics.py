"""Speculative decoding's counters read from a server's /metrics before and after a bench run: acceptance and
tokens per decode step (lineside's names; a server without them reads as zeros)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

_NAMES = {"lineside_spec_decode_num_draft_tokens_total": "drafted",
          "lineside_spec_decode_num_accepted_tokens_total": "accepted",
          "lineside_spec_decode_acceptance_rate_count": "steps"}


@dataclass
class SpecCounters:
    drafted: float = 0.0  # proposed tokens the model scored
    accepted: float = 0.0  # of those, kept
    steps: float = 0.0  # decode rows that verified proposals

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafted - other.drafted, self.accepted - other.accepted, self.steps - other.steps)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verifying row emits per step: its kept drafts plus the one the model samples."""
        return (self.accepted + self.steps) / self.steps if self.steps else 1.0

    def report(self) -> dict[str, float]:
        return {"draft_tokens": self.drafted, "accepted_tokens": self.accepted, "verify_steps": self.steps,
                "acceptance": round(self.acceptance, 4), "tokens_per_verify_step": round(self.tokens_per_step, 3)}

    def describe(self) -> str:
        return (f"{self.accepted:.0f}/{self.drafted:.0f} proposed tokens accepted ({self.acceptance:.0%}), "
                f"{self.tokens_per_step:.2f} tokens per verifying step over {self.steps:.0f} steps")


def spec_counters(base_url: str, api_key: str | None = None) -> SpecCounters:
    """The counters now; zeros when /metrics is missing, protected or does not have them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return SpecCounters()
    out = SpecCounters()
    if r.status_code != 200:
        return out
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in _NAMES:
            try:
                setattr(out, _NAMES[name], float(value))
            except ValueError:
                pass
    return out
