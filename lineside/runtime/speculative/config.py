"""Which proposer runs and how many tokens it may propose per step (`--speculative`, `--spec-tokens`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from lineside.errors import LinesideError
from lineside.runtime.sampling import Sampler
from lineside.strenum import StrEnum

MAX_SPEC_TOKENS = 16
DEFAULT_SPEC_TOKENS = 8  # the cap; the adaptive rule picks k ≤ it (benchmarks/ngram_params.py, speculative.py)
METHODS_HELP = "ngram | layerskip:N | draft:BUNDLE | mtp"


class SpecMethod(StrEnum):
    NGRAM = "ngram"  # prompt lookup: propose what followed the last n tokens earlier in the text
    LAYERSKIP = "layerskip"  # the model's own first N layers + final norm + LM head (build --draft-layers N)
    DRAFT = "draft"  # a smaller bundle with the same tokenizer
    MTP = "mtp"  # DeepSeek-V4's multi-token-prediction module


class Proposer(Protocol):
    """Guesses up to ``k`` tokens that follow ``tokens`` (prompt + generated); [] when it has no guess."""

    # True when a guess costs no model call: then a sequence whose draft length fell to 0 keeps checking
    # a 1-token guess against what it samples, so its draft length can grow back.
    cheap: bool

    def propose(self, tokens: list[int], k: int) -> list[int]:
        ...


@dataclass
class DraftRow:
    """One decoding row asking a model proposer for drafts: its target slot, prompt + generated tokens (the
    last one not yet in the target's KV), how many drafts, and the row's sampler (q follows its settings)."""

    slot: int
    tokens: list[int]
    k: int
    sampler: Sampler
    prompt_len: int


@dataclass
class Draft:
    tokens: list[int]
    # The proposer's distribution q each token was drawn from (target vocabulary); None: deterministic (q = 1).
    probs: list[np.ndarray] | None = None


class ModelProposer(Protocol):
    """A proposer that runs a model: called once per step for all its rows, in the engine's step thread."""

    cheap: bool

    def propose_rows(self, rows: list[DraftRow]) -> list[Draft]:
        ...

    def close(self) -> None:
        ...


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    num_tokens: int = DEFAULT_SPEC_TOKENS
    # Speculate only in steps with at most this many decode rows (None: the backend's ``spec_max_rows``).
    max_rows: int | None = None
    draft_layers: int | None = None  # layerskip:N
    draft_bundle: Path | None = None  # draft:BUNDLE
    # A draft model's step in target decode steps, for the adaptive rule (None: estimated from weight bytes).
    draft_cost: float | None = None

    @property
    def label(self) -> str:
        """The method as `--speculative` spells it."""
        if self.method == SpecMethod.LAYERSKIP:
            return f"layerskip:{self.draft_layers}"
        if self.method == SpecMethod.DRAFT:
            return f"draft:{self.draft_bundle}"
        return str(self.method)

    def proposer(self) -> Proposer:
        """The token proposer of a method that needs no model (ngram); model proposers come from
        ``speculative.proposers.make_proposer``."""
        from lineside.runtime.speculative.ngram import NgramProposer

        if self.method != SpecMethod.NGRAM:
            raise LinesideError(f"--speculative {self.label} needs a model; use speculative.proposers.make_proposer")
        return NgramProposer()


def parse_speculative(method: str | None, spec_tokens: int | None = None) -> SpeculativeConfig | None:
    """The config for `--speculative METHOD --spec-tokens K` (None: off); one line for bad input."""
    if method is None or method in ("", "off", "none"):
        if spec_tokens is not None:
            raise LinesideError("--spec-tokens needs --speculative METHOD (e.g. --speculative ngram)")
        return None
    name, sep, arg = method.partition(":")
    if name not in tuple(SpecMethod):
        raise LinesideError(f"--speculative {method!r} is not a known method; choose one of: {METHODS_HELP}")
    k = DEFAULT_SPEC_TOKENS if spec_tokens is None else int(spec_tokens)
    if not 1 <= k <= MAX_SPEC_TOKENS:
        raise LinesideError(f"--spec-tokens must be between 1 and {MAX_SPEC_TOKENS}, got {k}")
    kind = SpecMethod(name)
    if kind in (SpecMethod.NGRAM, SpecMethod.MTP):
        if sep:
            raise LinesideError(f"--speculative {method!r}: {name} takes no argument; write --speculative {name}")
        return SpeculativeConfig(kind, k)
    if kind == SpecMethod.LAYERSKIP:
        if not arg.isdecimal() or int(arg) < 1:  # isdigit() takes "²", which int() refuses
            raise LinesideError(f"--speculative {method!r}: write layerskip:N with N ≥ 1 draft layers (the bundle "
                                "must be built with --draft-layers N)")
        return SpeculativeConfig(kind, k, draft_layers=int(arg))
    if not arg:
        raise LinesideError(f"--speculative {method!r}: write draft:BUNDLE, the path of a smaller bundle with the "
                            "same tokenizer")
    path = Path(arg)
    if not (path / "manifest.json").is_file():
        raise LinesideError(f"--speculative {method!r}: {path} is not a bundle directory (no manifest.json); "
                            "build the draft model with `lineside build` first")
    return SpeculativeConfig(kind, k, draft_bundle=path)
