"""Serving metrics with the field's definitions (vLLM `bench serve`, NVIDIA AIPerf).

TTFT = first token time - send time; TPOT = (E2E - TTFT) / (output tokens - 1), i.e. the first
token is excluded; ITL = gaps between streamed chunks; total token throughput = (prompt + output
tokens) / duration, as vLLM's; effective throughput = sum(output tokens) / sum(E2E). A request
carrying several prompts (OpenAI's list `prompt`) streams several choices: its TPOT and ITL are taken
per choice, its output tokens summed over choices.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

import numpy as np

PERCENTILES = (50, 90, 99)


class TokenSource(str, Enum):
    """Where a request's output token counts came from: a chunk may carry several tokens, so only the first two
    are token counts; `chunks` (no usage, no tokenizer) is a lower bound."""

    USAGE = "usage"  # the stream's usage (stream_options.include_usage), as vLLM's bench takes it
    TOKENIZER = "tokenizer"  # the streamed text encoded with the bundle's or --tokenizer's tokenizer, as vLLM falls back
    CHUNKS = "chunks"  # one per streamed chunk that carried text


@dataclass
class RequestRecord:
    """What one request did, in seconds from the start of the run (plain data: JSON in, JSON out)."""

    start: float
    end: float
    prompts: int = 1
    prompt_tokens: int | None = 0  # None: no usage and no tokenizer counted them
    output_tokens: int = 0
    # per choice index: arrival time of every streamed chunk that carried output (same clock as start)
    chunk_times: dict[int, list[float]] = field(default_factory=dict)
    # per choice index: output tokens of that choice (see token_source)
    choice_tokens: dict[int, int] = field(default_factory=dict)
    error: str | None = None
    token_source: TokenSource = TokenSource.USAGE

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    def to_dict(self) -> dict:
        return {**asdict(self), "token_source": self.token_source.value}

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        d = dict(d)
        d["token_source"] = TokenSource(d.get("token_source", TokenSource.USAGE.value))
        d["chunk_times"] = {int(k): list(v) for k, v in d.get("chunk_times", {}).items()}
        d["choice_tokens"] = {int(k): int(v) for k, v in d.get("choice_tokens", {}).items()}
        return cls(**d)


def ttft(rec: RequestRecord) -> float | None:
    """Time from sending to the first output chunk of any choice."""
    firsts = [t[0] for t in rec.chunk_times.values() if t]
    return min(firsts) - rec.start if firsts else None


def e2e(rec: RequestRecord) -> float:
    """End-to-end latency: send to the last byte of the response."""
    return rec.end - rec.start


def _choice_tokens(rec: RequestRecord, idx: int) -> int:
    return rec.choice_tokens.get(idx, len(rec.chunk_times.get(idx, [])))


def tpot(rec: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output tokens - 1) per choice, averaged over choices with more than one token."""
    vals = []
    for idx, times in rec.chunk_times.items():
        n = _choice_tokens(rec, idx)
        if not times or n < 2:
            continue
        # a single-choice request ends at the response end; with several choices each ends at its last chunk
        end = rec.end if len(rec.chunk_times) == 1 else times[-1]
        vals.append((end - times[0]) / (n - 1))
    return float(np.mean(vals)) if vals else None


def itls(rec: RequestRecord) -> list[float]:
    """Gaps between consecutive streamed chunks of the same choice."""
    out: list[float] = []
    for times in rec.chunk_times.values():
        out.extend(float(b - a) for a, b in zip(times, times[1:], strict=False))
    return out


def percentiles(values: list[float], ps: tuple[int, ...] = PERCENTILES) -> dict[str, float | None]:
    """mean and p50/p90/p99 (linear interpolation, numpy's default); None when there is no sample."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in ps}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in ps}}


def good(rec: RequestRecord, ttft_target: float | None, tpot_target: float | None,
         e2e_target: float | None = None) -> bool:
    """A request counts toward goodput when it succeeded and met every target that was set (vLLM's
    `--goodput ttft: tpot: e2el:`; a 1-token answer has no TPOT and meets that target, as vLLM's TPOT 0 does)."""
    if not rec.ok:
        return False
    if e2e_target is not None and e2e(rec) > e2e_target:
        return False
    t = ttft(rec)
    if ttft_target is not None and (t is None or t > ttft_target):
        return False
    p = tpot(rec)
    return not (tpot_target is not None and p is not None and p > tpot_target)


@dataclass
class Summary:
    """The run's numbers (seconds, tokens, per-second rates); what report.py prints and compares."""

    requests: int
    completed: int
    failed: int
    duration: float
    prompt_tokens: int | None  # None when a completed request's count is unknown
    output_tokens: int
    request_throughput: float
    output_throughput: float
    effective_throughput: float
    goodput: float | None
    ttft: dict[str, float | None]
    tpot: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]
    ttft_target: float | None = None
    tpot_target: float | None = None
    e2e_target: float | None = None
    # (prompt + output tokens of completed requests) / duration: vLLM's "Total Token throughput"; None in a report
    # written before it was kept, so it is worked out from the counts that report has; None when prompt_tokens is unknown
    total_token_throughput: float | None = None

    def __post_init__(self) -> None:
        if self.total_token_throughput is None and self.prompt_tokens is not None:
            tokens = self.prompt_tokens + self.output_tokens
            self.total_token_throughput = tokens / self.duration if self.duration > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], duration: float | None = None,
              ttft_target: float | None = None, tpot_target: float | None = None,
              e2e_target: float | None = None) -> Summary:
    """Aggregate request records; duration defaults to first send to last response end."""
    done = [r for r in records if r.ok]
    if duration is None:
        duration = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    out_tok = sum(r.output_tokens for r in done)
    counts = [r.prompt_tokens for r in done]
    in_tok = None if None in counts else sum(c for c in counts if c is not None)  # a wrong 0 reads as real
    sum_e2e = sum(e2e(r) for r in done)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    targets = ttft_target is not None or tpot_target is not None or e2e_target is not None
    return Summary(
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration=float(duration),
        prompt_tokens=in_tok,
        output_tokens=out_tok,
        request_throughput=rate(len(done)),
        output_throughput=rate(out_tok),
        total_token_throughput=None if in_tok is None else rate(in_tok + out_tok),
        effective_throughput=out_tok / sum_e2e if sum_e2e > 0 else 0.0,
        goodput=rate(sum(good(r, ttft_target, tpot_target, e2e_target) for r in records)) if targets else None,
        ttft=percentiles([t for r in done if (t := ttft(r)) is not None]),
        tpot=percentiles([t for r in done if (t := tpot(r)) is not None]),
        itl=percentiles([g for r in done for g in itls(r)]),
        e2e=percentiles([e2e(r) for r in done]),
        ttft_target=ttft_target,
        tpot_target=tpot_target,
        e2e_target=e2e_target,
    )


def throughput_timeline(records: list[RequestRecord], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in fixed time bins (bin start times, rates), from chunk arrival times."""
    stamps: list[float] = []
    weights: list[float] = []
    for r in records:
        for idx, times in r.chunk_times.items():
            if times:  # spread a choice's token count evenly over its chunks (usage may exceed chunks)
                w = _choice_tokens(r, idx) / len(times)
                stamps.extend(times)
                weights.extend([w] * len(times))
    if not stamps:
        return np.zeros(0), np.zeros(0)
    nbins = int(np.floor(max(stamps) / bin_s)) + 1
    counts = np.bincount((np.asarray(stamps) // bin_s).astype(int), weights=weights, minlength=nbins)
    return np.arange(nbins) * bin_s, counts / bin_s
