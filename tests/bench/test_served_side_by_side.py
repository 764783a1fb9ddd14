"""benchmarks/served_side_by_side.py's pieces that decide what is compared: the order of the sides in each round,
the README table's rows, and the engine-without-HTTP side (same greedy text as the direct loop)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.served_side_by_side import (  # noqa: E402
    PROMPT,
    engine_runner,
    inprocess_runner,
    markdown_table,
    round_order,
)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_each_side_runs_in_each_position_and_after_each_other_side_alike(n):
    names = [f"side{k}" for k in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = [round_order(names, i) for i in range(cycle)]
    assert all(sorted(order) == names for order in orders)
    for pos in range(n):
        column = [order[pos] for order in orders]
        assert all(column.count(name) == cycle // n for name in names)
    pairs = [(a, b) for order in orders for a, b in zip(order, order[1:], strict=False)]
    assert all(pairs.count((a, b)) == cycle // n for a in names for b in names if a != b)
    assert round_order(names, cycle) == orders[0]


def test_one_side_or_none():
    assert round_order([], 3) == [] and round_order(["a"], 5) == ["a"]


def test_table_puts_the_batch_under_the_engine_row():
    table = markdown_table({"lineside": 90.0, "lineside engine": 95.0, "lineside in-process": 100.0},
                           {"lineside": 1.2}, {"lineside": (80.0, 260.0, True)}, 280.0, 8).splitlines()
    assert table[2].startswith("| `lineside serve`") and "260.0 (3.25× one stream)" in table[2]
    engine = next(r for r in table if "serving engine in-process" in r)
    assert "| 95.0 | 280.0 |" in engine
    direct = next(r for r in table if "direct loop" in r)
    assert "| 100.0 | — |" in direct


def test_engine_side_streams_the_direct_loops_greedy_text(tiny_bundle):
    run, stop = engine_runner(tiny_bundle, 1, PROMPT, 12)
    try:
        got = run()
    finally:
        stop()
    want = inprocess_runner(tiny_bundle, 1, PROMPT, 12)()
    assert got.text == want.text and got.tokens == want.tokens
    assert got.finish_reason in ("length", "stop") and got.decode_s >= 0
