"""The SLO guard: a degradation ladder (controller), its signals, a fallback bundle and a response cache."""

from lineside.server.slo.view import SloStatus, SloView

__all__ = ["SloStatus", "SloView"]
