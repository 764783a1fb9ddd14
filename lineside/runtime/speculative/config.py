"""Which proposer runs and how many tokens it may propose per step (`--speculative`, `--spec-tokens`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lineside.errors import LinesideError
from lineside.strenum import StrEnum

MAX_SPEC_TOKENS = 16
DEFAULT_SPEC_TOKENS = 4  # see benchmarks/speculative.py for the measurement behind it


class SpecMethod(StrEnum):
    NGRAM = "ngram"  # prompt lookup: propose what followed the last n tokens earlier in the text


class Proposer(Protocol):
    """Guesses up to ``k`` tokens that follow ``tokens`` (prompt + generated); [] when it has no guess."""

    # True when a guess costs no model call: then a sequence whose draft length fell to 0 keeps checking
    # a 1-token guess against what it samples, so its draft length can grow back.
    cheap: bool

    def propose(self, tokens: list[int], k: int) -> list[int]:
        ...


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    num_tokens: int = DEFAULT_SPEC_TOKENS
    # Speculate only in steps with at most this many decode rows (None: the backend's ``spec_max_rows``).
    max_rows: int | None = None

    def proposer(self) -> Proposer:
        from lineside.runtime.speculative.ngram import NgramProposer

        return NgramProposer()


def parse_speculative(method: str | None, spec_tokens: int | None = None) -> SpeculativeConfig | None:
    """The config for `--speculative METHOD --spec-tokens K` (None: off); one line for bad input."""
    if method is None or method in ("", "off", "none"):
        if spec_tokens is not None:
            raise LinesideError("--spec-tokens needs --speculative METHOD (e.g. --speculative ngram)")
        return None
    if method not in tuple(SpecMethod):
        known = ", ".join(SpecMethod)
        if method.split(":")[0] in ("layerskip", "draft", "mtp"):
            raise LinesideError(f"--speculative {method!r} is not built in this version (only prompt lookup is); choose one of: {known}")
        raise LinesideError(f"--speculative {method!r} is not a known method; choose one of: {known}")
    k = DEFAULT_SPEC_TOKENS if spec_tokens is None else int(spec_tokens)
    if not 1 <= k <= MAX_SPEC_TOKENS:
        raise LinesideError(f"--spec-tokens must be between 1 and {MAX_SPEC_TOKENS}, got {k}")
    return SpeculativeConfig(SpecMethod(method), k)
