"""What a finished request tells the SLO guard's on-time counter: a request the client's own grammar ended mid-
generation (outcome "invalid") is neither on time nor late, so it cannot push the on-time alerts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from lineside.runtime.request import FinishReason
from lineside.server.metrics import RequestRecord
from lineside.server.slo.guard import SloGuard
from lineside.server.slo.policy import SloPolicy


def _finished(guard: SloGuard, registry: CollectorRegistry) -> dict[str, float]:
    return {on: registry.get_sample_value("lineside_slo_finished_requests_total", {"mode": "batch", "on_time": on})
            for on in ("true", "false")}


def test_a_clients_grammar_failure_is_not_a_late_request():
    registry = CollectorRegistry()
    guard = SloGuard(SloPolicy(window_s=30), registry=registry, device=lambda: (None, None), ticking=False)
    for outcome in (FinishReason.STOP, "invalid", FinishReason.ERROR):
        guard.observe(RequestRecord("r", "/v1/completions", "normal", mode="batch", stream=False, arrival=0.0,
                                    outcome=outcome, first_token=0.1, end=0.2, queue_s=0.0))
    assert _finished(guard, registry) == {"true": 1.0, "false": 1.0}


def _slow(*, fallback: bool) -> RequestRecord:
    record = RequestRecord("r", "/v1/completions", "normal", mode="batch", stream=False, arrival=0.0,
                           outcome=FinishReason.STOP, first_token=5.0, end=5.5, queue_s=4.0)
    record.extra.update(slo_level=1, bundle="tiny-fallback" if fallback else "tiny-llama", slo_fallback=fallback)
    return record


def test_the_fallbacks_own_latency_does_not_move_the_ladder():
    """Level 1 sends batch work to the fallback; its slow answers (a small, busy bundle) escalated to level 2, which
    sent every request to that same fallback, and held level 2 while the primary idled. The primary's count."""
    registry = CollectorRegistry()
    guard = SloGuard(SloPolicy(window_s=30), registry=registry, device=lambda: (None, None), ticking=False)
    for _ in range(5):
        guard.signals.observe(ttft_s=1.0, queue_s=0.0)
    assert int(guard.tick(device=(None, None))) == 1
    for _ in range(20):
        guard.observe(_slow(fallback=True))
    assert int(guard.tick(device=(None, None))) == 1
    assert guard.signals.last.ttft_p90_s == 1.0 and guard.signals.last.ttft_samples == 5
    assert _finished(guard, registry) == {"true": 20.0, "false": 0.0}  # still counted as finished requests
    for _ in range(5):
        guard.observe(_slow(fallback=False))  # the primary's slow answers do escalate
    assert int(guard.tick(device=(None, None))) == 2
