"""PNG plots for the bench report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lineside.bench.metrics import RequestRecord, e2e, itls, throughput_timeline, tpot, ttft
from lineside.errors import LinesideError


def check_available() -> None:
    """Raise before a run, not after it: matplotlib is an extra (dev, bench), not a dependency of lineside."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LinesideError("the report's plots need matplotlib: pip install matplotlib (or pass --no-plots)") \
            from None


def _plt():
    check_available()
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def latency_distribution(path: Path, records: list[RequestRecord]) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2E (ms) with p50/p90/p99 marked."""
    plt = _plt()
    ok = [r for r in records if r.ok]
    series = {
        "TTFT": [t * 1000 for r in ok if (t := ttft(r)) is not None],
        "TPOT": [t * 1000 for r in ok if (t := tpot(r)) is not None],
        "ITL": [g * 1000 for r in ok for g in itls(r)],
        "E2E": [e2e(r) * 1000 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, vals) in zip(axes.flat, series.items(), strict=True):
        ax.set_title(f"{name} (n={len(vals)})")
        ax.set_xlabel("ms")
        if not vals:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        lo, hi = min(vals), max(vals)
        span = (lo - 0.5, hi + 0.5) if hi - lo < 1e-3 else (lo, hi)  # all equal: numpy can't bin a zero range
        ax.hist(vals, bins=min(50, max(5, len(vals) // 4)), range=span, color="#4C72B0", alpha=0.85)
        for p, color in ((50, "green"), (90, "orange"), (99, "red")):
            v = float(np.percentile(vals, p))
            ax.axvline(v, color=color, linestyle="--", linewidth=1, label=f"p{p} {v:.1f}")
        ax.legend(fontsize=8)
    fig.suptitle("Latency distributions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def throughput_over_time(path: Path, records: list[RequestRecord], bin_s: float | None = None) -> Path:
    """Output tokens/s per time bin (about 60 bins over the run), with requests in flight on a second axis."""
    plt = _plt()
    if bin_s is None:
        bin_s = max(0.1, round(max((r.end for r in records), default=0.0) / 60, 1))
    t, rate = throughput_timeline(records, bin_s)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    if len(t):
        ax.bar(t, rate, width=bin_s * 0.9, align="edge", color="#4C72B0", alpha=0.8, label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    if records:
        end = max(r.end for r in records)
        grid = np.linspace(0.0, end, 400)
        starts = np.array([r.start for r in records])[:, None]
        ends = np.array([r.end for r in records])[:, None]
        inflight = ((starts <= grid) & (grid < ends)).sum(axis=0)
        ax2 = ax.twinx()
        ax2.plot(grid, inflight, color="#C44E52", linewidth=1.2, label="requests in flight")
        ax2.set_ylabel("requests in flight")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Throughput over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latency_over_time(path: Path, records: list[RequestRecord]) -> Path:
    """TTFT and E2E of each request against its send time (shows queueing under bursts)."""
    plt = _plt()
    ok = [r for r in records if r.ok]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.scatter([r.start for r in ok], [e2e(r) * 1000 for r in ok], s=10, label="E2E", color="#4C72B0")
    pts = [(r.start, t * 1000) for r in ok if (t := ttft(r)) is not None]
    if pts:
        ax.scatter(*zip(*pts, strict=True), s=10, label="TTFT", color="#DD8452")
    bad = [r.start for r in records if not r.ok]
    if bad:
        ax.scatter(bad, [0] * len(bad), marker="x", color="red", label="failed")
    ax.set_xlabel("send time since start (s)")
    ax.set_ylabel("ms")
    ax.set_title("Latency by request send time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(out_dir: Path, records: list[RequestRecord]) -> list[Path]:
    """All report plots into out_dir."""
    return [latency_distribution(out_dir / "latency_distribution.png", records),
            throughput_over_time(out_dir / "throughput_over_time.png", records),
            latency_over_time(out_dir / "latency_over_time.png", records)]
