"""Prometheus metrics in the server's own registry, and one JSON line per finished request.

Latencies are measured where the client sees them (from the handler receiving the request to the
first/last token leaving); the queue time is the engine's. Gauges are read from engine.stats() at scrape.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger("lineside.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets from a GPU's milliseconds to a CPU's minutes (a 7B model on a line PC, behind a queue): a request past the
# last finite bound reads as that bound in every quantile. The long tails follow vLLM's (TTFT to 2560 s, E2E 7680 s).
_TTFT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0)
# TPOT and the gaps between tokens: a stalled or preempted request waits seconds to minutes (vLLM's reach 80 s)
_TPOT = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
         0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 3840.0, 7680.0)
_QUEUE = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
          240.0, 480.0, 960.0, 1920.0)


@dataclass
class RequestRecord:
    """What one finished request did; times are time.perf_counter() values."""

    request_id: str
    endpoint: str
    priority: str
    _: KW_ONLY
    mode: str
    stream: bool
    arrival: float
    outcome: str = "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    end: float | None = None
    queue_s: float | None = None
    tpot: float | None = None  # set on a request of several choices: their mean (they decode side by side)
    last_token: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between successive token events (each choice's)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.end is None else self.end - self.arrival

    @property
    def tpot_s(self) -> float | None:
        if self.tpot is not None:
            return self.tpot
        if self.first_token is None or self.end is None or self.completion_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)


# the outcome a request of several choices is counted under: its worst choice's
_OUTCOME_RANK = {"stop": 0, "length": 1, "cancelled": 2, "timeout": 3, "error": 4, "invalid": 5}


def combined(records: list[RequestRecord], *, prompt_tokens: int) -> RequestRecord:
    """One HTTP request's record from its choices' (n > 1, several prompts): the client got one response, so it
    is one request in every family and one latency-log line (as its usage, prompt tokens count each prompt once).
    Its first token is the earliest choice's, its end the latest's, its outcome the worst choice's; its TPOT is
    the mean of the choices' own (theirs are decoded side by side, so total tokens over time would be too low)."""
    if len(records) == 1:
        return records[0]
    first, seen = records[0], [r.first_token for r in records if r.first_token is not None]
    ends = [r.end for r in records if r.end is not None]
    queues = [r.queue_s for r in records if r.queue_s is not None]
    tpots = [t for t in (r.tpot_s for r in records) if t is not None]
    outcome = max((str(r.outcome) for r in records), key=lambda o: _OUTCOME_RANK.get(o, len(_OUTCOME_RANK)))
    extra = {k: v for r in reversed(records) for k, v in r.extra.items() if k != "engine_ttft_s"}
    engine_ttft = [r.extra["engine_ttft_s"] for r in records if r.extra.get("engine_ttft_s") is not None]
    if engine_ttft:
        extra["engine_ttft_s"] = min(engine_ttft)
    return RequestRecord(first.request_id, first.endpoint, first.priority, mode=first.mode, stream=first.stream,
                         arrival=min(r.arrival for r in records), outcome=outcome, prompt_tokens=prompt_tokens,
                         completion_tokens=sum(r.completion_tokens for r in records),
                         first_token=min(seen) if seen else None, end=max(ends) if ends else None,
                         queue_s=min(queues) if queues else None,
                         tpot=sum(tpots) / len(tpots) if tpots else None, itl=[g for r in records for g in r.itl],
                         extra={**extra, "choices": len(records)})


class ServerMetrics:
    """The server's metric families; `observe` a finished request, `render` for /metrics."""

    def __init__(self, latency_log: str | Path | None = None):
        registry = self.registry = CollectorRegistry()
        self.ttft = Histogram("lineside_time_to_first_token_seconds", "Time to first token", buckets=_TTFT,
                              registry=registry)
        self.tpot = Histogram("lineside_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TPOT, registry=registry)
        # vLLM's inter_token_latency_seconds: every gap between a choice's successive tokens as the handler got them
        self.itl = Histogram("lineside_inter_token_latency_seconds", "Time between successive tokens of a response",
                             buckets=_TPOT, registry=registry)
        self.e2e = Histogram("lineside_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_E2E, registry=registry)
        self.queue = Histogram("lineside_request_queue_time_seconds", "Time spent waiting for a slot",
                               buckets=_QUEUE, registry=registry)
        self.running = Gauge("lineside_num_requests_running", "Requests holding a slot", registry=registry)
        self.waiting = Gauge("lineside_num_requests_waiting", "Requests waiting for a slot", registry=registry)
        self.kv_usage = Gauge("lineside_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", registry=registry)
        # the KV arena's real allocation (runtime/kv_bytes.py), labelled with the dtype it stores
        self.kv_bytes_per_token = Gauge("lineside_kv_cache_bytes_per_token", "KV arena bytes per cached token "
                                        "(all layers, K and V, with their scales)", ["dtype"], registry=registry)
        self.kv_capacity = Gauge("lineside_kv_cache_capacity_bytes", "KV arena bytes allocated (all slots)",
                                 ["dtype"], registry=registry)
        self.kv_used = Gauge("lineside_kv_cache_used_bytes", "KV arena bytes holding running requests' tokens",
                             ["dtype"], registry=registry)
        self.requests = Counter("lineside_requests", "Finished requests by outcome", ["outcome"], registry=registry)
        self.prompt_tokens = Counter("lineside_prompt_tokens", "Prompt tokens processed", registry=registry)
        self.generation_tokens = Counter("lineside_generation_tokens", "Tokens generated", registry=registry)
        self.http_inflight = Gauge("lineside_http_requests_in_flight",
                                   "Requests a drain waits for being served (generation, /tokenize, /detokenize)",
                                   registry=registry)
        self._device: dict[str, Gauge] = {}
        self._spec = _SpecDecodeCollector()
        registry.register(self._spec)
        self._sessions = _SessionCollector()
        registry.register(self._sessions)
        self._lora = _LoraCollector()
        registry.register(self._lora)
        self._cache = _PrefixCacheCollector()
        registry.register(self._cache)
        self._grammars = _GrammarCollector()
        registry.register(self._grammars)
        self._engine_health = _EngineHealthCollector()
        registry.register(self._engine_health)
        self.listeners: list[Callable[[RequestRecord], None]] = []  # told of every finished request (SLO guard)
        self._log_path = Path(latency_log) if latency_log else None
        self._log = None
        self._log_failing = False  # the last write failed (warned once until one succeeds)
        self._lock = threading.Lock()

    def reject(self, outcome: str) -> None:
        """Count a request refused before generation (invalid, queue_full, unauthorized, draining)."""
        self.requests.labels(outcome).inc()

    def observe(self, record: RequestRecord) -> None:
        """Record a finished generation request in every family and the latency log."""
        if record.end is None:
            record.end = time.perf_counter()
        self.requests.labels(record.outcome).inc()
        if record.queue_s is not None or record.first_token is not None:  # its prompt ran (a request cancelled
            self.prompt_tokens.inc(record.prompt_tokens)  # while it waited, or a cache answer, processed none)
        if record.outcome != "cached":  # an SLO cache answer's tokens were generated for an earlier request
            self.generation_tokens.inc(record.completion_tokens)
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
        if record.tpot_s is not None:
            self.tpot.observe(record.tpot_s)
        for gap in record.itl:
            self.itl.observe(gap)
        self.e2e.observe(record.e2e_s or 0.0)
        if record.queue_s is not None:
            self.queue.observe(record.queue_s)
        for listener in self.listeners:
            listener(record)
        if self._log_path is not None:
            self._write_log(record)

    def _write_log(self, record: RequestRecord) -> None:
        fields = asdict(record)
        for name in ("arrival", "first_token", "end", "tpot", "last_token", "itl", "extra"):
            fields.pop(name)
        row = {"ts": time.time(), **fields, "ttft_s": record.ttft_s, "tpot_s": record.tpot_s,
               "e2e_s": record.e2e_s, **record.extra}
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self._lock:
            try:
                if self._log is not None and self._rotated():
                    self._drop_log()
                if self._log is None:
                    self._log_path.parent.mkdir(parents=True, exist_ok=True)
                    self._log = open(self._log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
                self._log.write(line)
            except OSError as e:  # a full disk must not fail the request it records: say so once, retry next time
                self._drop_log()
                if not self._log_failing:
                    log.warning("cannot write the latency log %s (%s); requests are served and counted in /metrics, "
                                "their log lines are lost until it can be written again", self._log_path,
                                e.strerror or e)
                self._log_failing = True
            else:
                if self._log_failing:
                    log.info("the latency log %s is written again", self._log_path)
                self._log_failing = False

    def _rotated(self) -> bool:
        """The path no longer names the open file (logrotate renamed it, or it was removed): open a new one, as
        logging.WatchedFileHandler does, so lines do not go on into a rotated file a later rotation deletes."""
        try:
            on_disk = os.stat(self._log_path)
        except OSError:
            return True
        open_file = os.fstat(self._log.fileno())
        return (on_disk.st_dev, on_disk.st_ino) != (open_file.st_dev, open_file.st_ino)

    def _drop_log(self) -> None:
        try:
            if self._log is not None:
                self._log.close()
        except OSError:  # closing flushes: the same full disk
            pass
        self._log = None

    def update_engine(self, stats: Any, *, others: list[Any] | tuple[Any, ...] = ()) -> None:
        """Copy the engine's live counters into the gauges (called at scrape time). ``others``: the stats of the
        other engines serving requests (the SLO guard's fallback): their requests run and wait too, so they add to
        the running / waiting gauges; the arena and cache families stay the primary's."""
        def reader(s: Any) -> Callable[..., Any]:
            return s.get if isinstance(s, dict) else lambda k, d=None: getattr(s, k, d)

        get = reader(stats)
        self.running.set(sum(reader(s)("running", 0) or 0 for s in (stats, *others)))
        self.waiting.set(sum(reader(s)("waiting", 0) or 0 for s in (stats, *others)))
        self.kv_usage.set(get("kv_usage", 0.0) or 0.0)
        kv_dtype = get("kv_dtype", "") or ""
        if kv_dtype:
            self.kv_bytes_per_token.labels(kv_dtype).set(get("kv_bytes_per_token", 0.0) or 0.0)
            self.kv_capacity.labels(kv_dtype).set(get("kv_capacity_bytes", 0) or 0)
            self.kv_used.labels(kv_dtype).set(get("kv_bytes_used", 0) or 0)
        self._spec.stats = stats if get("spec_acceptance") else None
        self._sessions.stats = stats
        self._lora.stats = stats
        self._cache.stats = stats
        self._grammars.stats = stats
        self._engine_health.stats = stats

    def update_device(self, values: dict[str, float]) -> None:
        """Device gauges (Jetson tegrastats: RAM, GPU load, rails, temperatures) as lineside_<name>; a gauge the
        reading no longer has (tegrastats exited) is removed, not left at its last value."""
        keys = {"lineside_" + "".join(c if c.isalnum() or c == "_" else "_" for c in name): name for name in values}
        for key in [k for k in self._device if k not in keys]:
            self.registry.unregister(self._device.pop(key))
        for key, name in keys.items():
            value = values[name]
            gauge = self._device.get(key)
            if gauge is None:
                gauge = self._device[key] = Gauge(key, f"{name} (tegrastats)", registry=self.registry)
            gauge.set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        with self._lock:
            self._drop_log()


class _SpecDecodeCollector:
    """Speculative decoding's engine counters (named like vLLM's under our prefix), from the last scraped stats."""

    def __init__(self) -> None:
        self.stats: Any = None

    def collect(self) -> Any:
        st = self.stats
        get = (st.get if isinstance(st, dict) else lambda k, d=None: getattr(st, k, d)) if st is not None else None
        drafted = CounterMetricFamily("lineside_spec_decode_num_draft_tokens", "Proposed tokens the model scored")
        accepted = CounterMetricFamily("lineside_spec_decode_num_accepted_tokens", "Proposed tokens kept")
        drafted.add_metric([], float(get("spec_draft_tokens_total", 0) or 0) if get else 0.0)
        accepted.add_metric([], float(get("spec_accepted_tokens_total", 0) or 0) if get else 0.0)
        yield drafted
        yield accepted
        bounds, counts, total = get("spec_acceptance") if get else ((), (), 0.0)
        hist = HistogramMetricFamily("lineside_spec_decode_acceptance_rate",
                                     "Share of a row's proposed tokens kept, per verification step")
        cum, buckets = 0, []
        for b, c in zip(bounds, counts, strict=True):
            cum += int(c)
            buckets.append((repr(float(b)), cum))
        buckets.append(("+Inf", cum))
        hist.add_metric([], buckets, sum_value=float(total))
        yield hist


class _StatsCollector:
    """Gauges and counters read from the last scraped engine stats (0 before the first scrape)."""

    GAUGES: tuple[tuple[str, str, str], ...] = ()  # (metric, EngineStats field, help)
    COUNTERS: tuple[tuple[str, str, str], ...] = ()

    def __init__(self) -> None:
        self.stats: Any = None

    def collect(self) -> Any:
        st = self.stats

        def value(key: str) -> float:
            if st is None:
                return 0.0
            v = st.get(key, 0) if isinstance(st, dict) else getattr(st, key, 0)
            return float(v or 0)

        for name, key, doc in self.GAUGES:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value(key))
            yield g
        for name, key, doc in self.COUNTERS:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value(key))
            yield c


class _LoraCollector(_StatsCollector):
    """LoRA adapters (serve --lora-modules / the bundle's): how many are served and loaded, slot churn."""

    GAUGES = (("lineside_lora_adapters_served", "lora_adapters_served", "LoRA adapters this server serves"),
              ("lineside_lora_slots", "lora_slots", "Adapter slots of the backend (--max-loras)"),
              ("lineside_lora_adapters_loaded", "lora_adapters_loaded", "Adapters resident in a slot"),
              ("lineside_lora_adapters_in_use", "lora_adapters_in_use",
               "Resident adapters a waiting or running request holds"))
    COUNTERS = (("lineside_lora_slot_loads", "lora_slot_loads", "Adapters written into a slot"),
                ("lineside_lora_slot_evictions", "lora_slot_evictions",
                 "Of those, loads that replaced an idle adapter (least recently used)"))


class _PrefixCacheCollector(_StatsCollector):
    """Prompt tokens reused from the prefix cache and requests preempted, named like vLLM's (queries and hits in
    tokens: hits / queries is the share of prompt tokens not computed), so a dashboard can watch the cache."""

    COUNTERS = (("lineside_prefix_cache_queries", "prompt_tokens_total", "Prompt tokens looked up in the prefix cache"),
                ("lineside_prefix_cache_hits", "prefix_cache_hit_tokens",
                 "Of those, tokens found in the cache (not computed again)"),
                ("lineside_prefix_cache_hit_requests", "prefix_cache_hits", "Requests that reused a cached prefix"),
                ("lineside_num_preemptions", "preemptions",
                 "Running requests paused to free KV memory (resumed later from their tokens)"))


class _GrammarCollector(_StatsCollector):
    """The structured-output grammar cache (serve --max-cached-grammars): what it holds and how often it missed."""

    GAUGES = (("lineside_grammar_cache_entries", "grammars_cached",
               "Compiled structured-output grammars held (at most --max-cached-grammars)"),)
    COUNTERS = (("lineside_grammar_compiles", "grammar_compiles",
                 "Constraints compiled, refusals included (a cache miss each)"),)


class _EngineHealthCollector(_StatsCollector):
    """The engine's step health (runtime/engine_health.py): failed 1 once it serves no more (alert on it)."""

    GAUGES = (("lineside_engine_failed", "engine_failed",
               "1 once the engine failed (--max-failed-steps steps in a row, or a lost device) and serves no more"),
              ("lineside_engine_consecutive_failed_steps", "failed_steps_consecutive",
               "Model steps in a row whose backend calls all failed (0 after any step that worked)"))
    COUNTERS = (("lineside_engine_failed_steps", "failed_steps_total", "Model steps whose backend calls all failed"),)


class _SessionCollector(_StatsCollector):
    """Prefill sessions (POST /v1/prefill) from the last scraped engine stats: what they hold and what they saved."""

    GAUGES = (("lineside_prefill_sessions", "sessions", "Prefill sessions held"),
              ("lineside_prefill_session_pinned_blocks", "session_pinned_blocks",
               "KV blocks pinned by prefill sessions (they count against the same arena)"))
    COUNTERS = (("lineside_prefill_session_hits", "session_hits", "Completions that started from a session's KV"),
                ("lineside_prefill_session_tokens_saved", "session_tokens_saved",
                 "Prompt tokens those completions did not compute"),
                ("lineside_prefill_session_prefill_tokens", "session_prefill_tokens",
                 "Tokens computed for sessions in idle capacity"),
                ("lineside_prefill_sessions_expired", "sessions_expired", "Sessions released at the end of their TTL"),
                ("lineside_prefill_sessions_evicted", "sessions_evicted",
                 "Sessions released early because running requests needed the memory"))
