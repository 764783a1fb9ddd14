"""Token sampling: greedy, temperature, top-k, top-p, min-p and the usual penalties, seeded; logprobs.

Applied on one row of float32 logits in numpy; the order is transformers' (and vLLM V0's): penalties → grammar
mask → temperature → top-k → top-p → min-p, so the same seed gives the same text. vLLM V1 differs in two ways, left
as they are: it applies min-p before top-k/top-p (the kept set differs only when min_p and top_p are both set:
top-p's cumulative sums are then taken over what min-p left), and it samples greedily below temperature 1e-5, where
this samples softmax(x / T) all the way down (logits within a few T of the max keep a share).

vLLM's ``min_tokens``: while fewer than that many tokens have been generated (``history[prompt_len:]``, so a
verifying position counts the drafts before it), the stop tokens the sampler was given (EOS, ignore_eos or not,
and the request's stop_token_ids: vLLM's ``all_stop_token_ids``) are masked with the grammar mask. Where a
grammar allows nothing but stop tokens (it is complete), the grammar wins and they stay allowed, as vLLM does
since its PR #54218 (before it, the empty mask sampled token 0 and the grammar failed the request).

OpenAI's ``logit_bias`` is added to the model's logits before everything else (vLLM's order).

Logprobs are the log-softmax of the logits the sampler used *after the bias, penalties and the masks (grammar,
min_tokens), before temperature, top-k/p and min-p* (vLLM's ``processed_logprobs`` minus its temperature
step): with no penalty and no constraint they are the model's own log-probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from lineside.errors import LinesideError

UNSEEDED = -1  # vLLM's SamplingParams and llama.cpp's server (`--seed -1`) read seed -1 as "no seed" (a random one)


def sampler_seed(seed: int | None) -> int | None:
    """A request's or --seed's seed for the sampler: OpenAI's seed is a signed int64, numpy's generator takes it
    unsigned (a negative one is its unsigned 64-bit twin); -1 is none, as vLLM and llama.cpp read it (a client sending
    it for "random" got one fixed answer). One rule for the server and the CLI."""
    return None if seed is None or seed == UNSEEDED else seed % 2**64


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 → greedy
    top_k: int = 0  # 0 → off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0  # vLLM's: stop tokens masked (and stop strings not matched) until this many are generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, bias) added to the logits before the rest

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)  # NaN / inf penalties passed every range check below and sampled garbage
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(v):
                raise LinesideError(f"{name} must be a finite number, got {v!r}")
        for name in ("top_k", "min_tokens", "seed"):
            v = getattr(self, name)
            if not (v is None and name == "seed") and (
                    isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))):
                raise LinesideError(f"{name} must be an integer, got {v!r}")
        if not (self.temperature >= 0):
            raise LinesideError(f"temperature must be ≥ 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise LinesideError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise LinesideError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise LinesideError(f"top_k must be ≥ 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise LinesideError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and self.seed < 0:
            raise LinesideError(f"seed must be ≥ 0, got {self.seed}")
        if self.min_tokens < 0:
            raise LinesideError(f"min_tokens must be ≥ 0, got {self.min_tokens}")
        for token, bias in self.logit_bias:
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)) or token < 0 \
                    or isinstance(bias, (bool, np.bool_)) or not isinstance(bias, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(bias):
                raise LinesideError(f"logit_bias must map token ids (integers ≥ 0) to finite numbers, got "
                                    f"{token!r}: {bias!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax (ties to the lowest id). ``top_k`` 1 with a temperature is not: it keeps every
        token tied at the top and samples among them, as transformers' and vLLM's top-k keep a tied k-th value."""
        return self.temperature == 0


# Logprobs a server may ask for per token (OpenAI's chat top_logprobs bound).
MAX_TOP_LOGPROBS = 20
# What a logprob of -inf (a token the mask or an extreme penalty ruled out) is reported as: JSON has no -inf.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and the ``top`` most likely tokens' (id, logprob), highest first; ``rank``: the
    chosen token's 1-based place among all tokens in that order (set where asked: vLLM's prompt_logprobs report it)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: TokenLogprob | None = None  # set when the request asked for logprobs


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one row (-inf entries stay -inf; NaN counts as -inf). Where some entries are +inf
    (a logit that overflowed), those share all the probability equally, as the sampler draws them (``_sanitize``):
    inf - inf was NaN, and the chosen token's logprob the floor of an impossible one."""
    x = np.asarray(x, dtype=np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    pos = np.isposinf(x)
    if pos.any():
        return np.where(pos, -np.log(np.count_nonzero(pos)), -np.inf)
    m = np.max(x)
    if not np.isfinite(m):
        m = 0.0
    return x - (m + np.log(np.sum(np.exp(x - m))))


def token_logprob(x: np.ndarray, token: int, top_n: int, *, ranked: bool = False) -> TokenLogprob:
    """Chosen + top-``top_n`` logprobs of a row of (processed) logits; ties keep the lower id first, as argmax.
    ``ranked``: also the chosen token's rank in that order (so a token in ``top`` at place i has rank i + 1)."""
    lp = log_softmax(x)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(int(top_n), lp.shape[0])
        idx = np.argpartition(-lp, n - 1)[:n] if n < lp.shape[0] else np.arange(lp.shape[0])
        idx = idx[np.lexsort((idx, -lp[idx]))]
        top = tuple((int(i), float(lp[i])) for i in idx if np.isfinite(lp[i]))
    v = float(lp[token])
    rank = int(np.count_nonzero(lp > v) + np.count_nonzero(lp[:token] == v)) + 1 if ranked else None
    return TokenLogprob(int(token), v if np.isfinite(v) else LOGPROB_FLOOR, top, rank)


class Sampler:
    """Per-request sampler: owns the request's random generator so a seed reproduces the output."""

    def __init__(self, params: SamplingParams, stop_ids: Iterable[int] = ()):
        """``stop_ids``: the tokens ``min_tokens`` holds back (unused when it is 0)."""
        params.validate()
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self._held = sorted({int(t) for t in stop_ids}) if params.min_tokens else []
        self._held_set = frozenset(self._held)
        self._bias = (np.array([t for t, _ in params.logit_bias], dtype=np.int64),
                      np.array([b for _, b in params.logit_bias], dtype=np.float64)) if params.logit_bias else None
        # Greedy (or top_k 1) with no penalty: the argmax of the raw row, without the float64 copy (~4% of a decode
        # step); top_k 1 takes it only when no other token ties the top
        self._plain_greedy = (params.greedy or params.top_k == 1) and params.repetition_penalty == 1.0 and not (
            params.presence_penalty or params.frequency_penalty or params.logit_bias)

    def __call__(self, logits: np.ndarray, history: list[int] | None = None, prompt_len: int = 0) -> int:
        """``history``: prompt + generated ids. The repetition penalty sees all of it; presence and
        frequency penalties count only the generated part, ``history[prompt_len:]`` (as vLLM does)."""
        return self.step(logits, history, prompt_len).token

    def step(self, logits: np.ndarray, history: list[int] | None = None, prompt_len: int = 0, *,
             allowed: np.ndarray | None = None, logprobs: int | None = None) -> SampleResult:
        """One token. ``allowed``: bool ``[vocab]`` from a grammar (None: every token); ``logprobs``: None for
        none, else how many top alternatives to report besides the chosen token's own logprob."""
        holding = self._holding(history, prompt_len)
        if self._plain_greedy and allowed is None and logprobs is None:
            tok = int(np.argmax(logits))  # float32 argmax = float64 argmax; it lands on a NaN if there is one
            if logits[tok] > -np.inf and not (holding and tok in self._held_set) and (  # not NaN, not a row of -inf
                    self.p.greedy or np.count_nonzero(logits == logits[tok]) == 1):
                return SampleResult(tok)
        if holding:
            allowed = self._min_tokens_mask(allowed, logits.shape[-1])
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            x = self._processed(np.asarray(logits, dtype=np.float64), history, prompt_len, allowed)
            tok = self._sample(x, logits, allowed)
            return SampleResult(tok, None if logprobs is None else token_logprob(x, tok, logprobs))

    def logprob(self, logits: np.ndarray, token: int, history: list[int] | None = None, prompt_len: int = 0, *,
                allowed: np.ndarray | None = None, top_n: int = 0) -> TokenLogprob:
        """What ``step`` reports for ``token`` at this position (speculative verification emits tokens it did
        not sample here, and reports them as plain decoding would)."""
        if self._holding(history, prompt_len):
            allowed = self._min_tokens_mask(allowed, logits.shape[-1])
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return token_logprob(self._processed(np.asarray(logits, dtype=np.float64), history, prompt_len, allowed),
                                 token, top_n)

    def distribution(self, logits: np.ndarray, history: list[int] | None = None, prompt_len: int = 0, *,
                     allowed: np.ndarray | None = None) -> int | np.ndarray:
        """What ``step`` samples from: the token itself when the choice is deterministic (greedy), else the
        float64 probabilities over the vocabulary (speculative verification needs them, speculative/verify.py)."""
        if self._holding(history, prompt_len):
            allowed = self._min_tokens_mask(allowed, logits.shape[-1])
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            x = self._processed(np.asarray(logits, dtype=np.float64), history, prompt_len, allowed)
            return self._distribution(x, logits, allowed)

    def draw(self, logits: np.ndarray, history: list[int] | None = None,
             prompt_len: int = 0) -> tuple[int, np.ndarray | None]:
        """A draft token and the probabilities it was drawn from (None when deterministic): a proposer's q, which
        the speculative-sampling rule divides by (speculative/verify.py). A sampled row's deterministic pick (top_k 1
        with one token at the top, the fallback) is a one-hot q, not None: a proposer lists q per draft only when
        the row samples, so each of its drafts needs one. A seeded row gets its distribution's most likely token
        and None, drawing nothing: verification then draws once per token as plain decoding does, so the seed
        gives plain decoding's text however many steps speculate (a drawn draft would spend the row's generator)."""
        d = self.distribution(logits, history, prompt_len)
        if isinstance(d, int):
            return d, None if self.p.greedy or self.p.seed is not None else np.eye(1, logits.shape[-1], d,
                                                                                   dtype=np.float64)[0]
        if self.p.seed is not None:
            return int(np.argmax(d)), None
        return int(self.rng.choice(d.shape[0], p=d)), d

    def _holding(self, history: list[int] | None, prompt_len: int) -> bool:
        """Whether min_tokens still holds the stop tokens back at the position after ``history``."""
        return bool(self._held) and (len(history) - prompt_len if history else 0) < self.p.min_tokens

    def _min_tokens_mask(self, allowed: np.ndarray | None, vocab: int) -> np.ndarray:
        """``allowed`` (None: every token) less the held stop tokens; a grammar that allows nothing else keeps
        them (it is complete: vLLM lets the grammar end the answer)."""
        mask = np.ones(vocab, dtype=bool) if allowed is None else np.array(allowed[:vocab], dtype=bool)
        ids = [t for t in self._held if 0 <= t < vocab]
        held = mask[ids].copy()
        mask[ids] = False
        if allowed is not None and not mask.any():
            mask[ids] = held
        return mask

    def _processed(self, x: np.ndarray, history: list[int] | None, prompt_len: int,
                   allowed: np.ndarray | None) -> np.ndarray:
        """The logit bias, penalties, then the grammar mask: what logprobs are computed from."""
        p = self.p
        if self._bias is not None:  # first, as vLLM applies it: the model's logits as the client shifted them
            ids, bias = self._bias
            ok = ids < x.shape[0]
            x = x.copy()  # ``x`` may be the caller's own row
            np.add.at(x, ids[ok], bias[ok])
        if history and p.repetition_penalty != 1.0:
            x = x.copy()
            ids = np.unique(np.asarray(history, dtype=np.int64))
            ids = ids[(ids >= 0) & (ids < x.shape[0])]
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        out = history[prompt_len:] if history else []
        if len(out) and (p.presence_penalty or p.frequency_penalty):
            x = x.copy()
            ids, counts = np.unique(np.asarray(out, dtype=np.int64), return_counts=True)
            ok = (ids >= 0) & (ids < x.shape[0])
            x[ids[ok]] -= p.presence_penalty + p.frequency_penalty * counts[ok]
        if allowed is not None:
            x = np.where(allowed[:x.shape[0]], x, -np.inf)
        return x

    def _sample(self, x: np.ndarray, logits: np.ndarray, allowed: np.ndarray | None) -> int:
        d = self._distribution(x, logits, allowed)
        return d if isinstance(d, int) else int(self.rng.choice(d.shape[0], p=d))

    def _distribution(self, x: np.ndarray, logits: np.ndarray, allowed: np.ndarray | None) -> int | np.ndarray:
        """From processed logits: the greedy token, or the probabilities after temperature/top-k/top-p/min-p."""
        p = self.p
        if p.greedy:
            tok = int(np.argmax(np.nan_to_num(x, nan=-np.inf)))
            return tok if x[tok] > -np.inf else _fallback(logits, allowed)
        x = _sanitize(x)
        if x is None:  # nothing finite left (extreme penalties): fall back to greedy
            return _fallback(logits, allowed)
        if p.top_k == 1 and np.count_nonzero(x == x.max()) == 1:
            return int(np.argmax(x))  # one token at the top: the choice is deterministic (a draft's q = 1)
        # the max is subtracted before dividing: softmax is unchanged, and a tiny temperature sends the others to
        # -inf (its limit, the argmax) where x / T alone overflowed every positive logit to +inf
        x = (x - x.max()) / p.temperature
        if p.top_k and p.top_k < x.shape[0]:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        probs = np.exp(x)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            csum = np.cumsum(probs[order])
            cut = int(np.searchsorted(csum, p.top_p)) + 1  # keep the smallest set reaching top_p
            keep = np.zeros_like(probs, dtype=bool)
            keep[order[:cut]] = True
            probs = np.where(keep, probs, 0.0)
        if p.min_p > 0:
            probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
        return probs


def _fallback(logits: np.ndarray, allowed: np.ndarray | None) -> int:
    """No candidate left after the processing: the raw argmax among the tokens the grammar allows. A row with no
    number in it at all (every logit NaN or -inf: a numerical failure in the model) is an error, where argmax gave
    token 0 every step, an answer of <unk> or an EOS that ends it empty."""
    raw = np.asarray(logits, dtype=np.float64)
    raw = np.where(np.isnan(raw), -np.inf, raw)  # (nan_to_num(nan=-inf) made the -inf entries finite)
    if not (raw > -np.inf).any():
        raise LinesideError("the model's logits at this position are all NaN or -inf (a numerical failure in the "
                            "model), so no token can be sampled")
    if allowed is not None:
        raw = np.where(allowed[:raw.shape[0]], np.nan_to_num(raw, neginf=np.finfo(np.float64).min), -np.inf)
    return int(np.argmax(raw))


def _sanitize(x: np.ndarray) -> np.ndarray | None:
    """Make extreme-but-valid penalties safe: NaN → -inf; if some logits overflowed to +inf, only those
    stay (uniformly); None when no candidate is left."""
    x = np.where(np.isnan(x), -np.inf, x)
    pos = np.isposinf(x)
    if pos.any():
        x = np.where(pos, 0.0, -np.inf)
    return x if np.isfinite(x).any() else None
