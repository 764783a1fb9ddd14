"""benchmarks/serving_engine.py's steady-state window: the tokens/s of part 1 come from the span in which every
stream is decoding, which a short --tokens can leave empty."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.serving_engine import steady_rate  # noqa: E402


def test_steady_rate_counts_the_tokens_inside_the_window_where_every_stream_decodes():
    # stream A: tokens at 0..4; stream B starts at 1 and ends at 5: window (1, 4] holds 3 of A's and 3 of B's
    times = [[0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0]]
    assert steady_rate(times, tokens=5) == pytest.approx(6 / 3.0)


@pytest.mark.parametrize("times", [[[0.0, 1.0], [1.0, 2.0]], [[0.0, 0.5], [1.0, 2.0]]])
def test_a_window_that_never_opens_is_one_line_not_a_crash_or_a_negative_rate(times):
    """`serving_engine.py --tokens 8`: at 8 streams the first stream ended before the last began, and the script
    died in a ZeroDivisionError (or, with the window inverted, printed a negative tokens/s)."""
    with pytest.raises(SystemExit) as e:
        steady_rate(times, tokens=2)
    said = str(e.value.code)
    assert "--tokens 2" in said and "2 streams" in said and "\n" not in said, said
