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
