"""benchmarks/served_side_by_side.py's pieces that decide what is compared: the order of the sides in each round,
the README table's rows, and the engine-without-HTTP side (same greedy text as the direct loop)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.served_side_by_side import (  # noqa: E402
    PROMPT,
    BatchRounds,
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
    rounds = BatchRounds(one_stream=[80.0, 100.0, 90.0], aggregate=[260.0, 250.0, 270.0], identical=[True] * 3)
    table = markdown_table({"lineside": 90.0, "lineside engine": 95.0, "lineside in-process": 100.0},
                           {"lineside": 1.2}, {"lineside": rounds}, 280.0, 8).splitlines()
    # the median aggregate and the median of the per-round ratios (3.25, 2.5, 3.0): not 260 / 90
    assert table[2].startswith("| `lineside serve`") and "260.0 (3.00× one stream)" in table[2]
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


def test_batch_rounds_flip_the_order_and_compare_each_text(monkeypatch):
    from benchmarks import served_side_by_side as sbs
    from benchmarks.stream_clients import Stream

    calls: list[str] = []
    monkeypatch.setattr(sbs.time, "sleep", lambda s: None)

    def one(url, model, prompt, max_tokens):
        calls.append("one")
        return Stream(text=prompt, tokens=10, end_s=0.1)

    def many(url, model, prompts, max_tokens):
        calls.append("many")
        texts = [p + "!" if calls.count("many") == 2 else p for p in prompts]  # the second round's texts differ
        return 300.0, [Stream(text=t, tokens=10) for t in texts]

    monkeypatch.setattr(sbs, "stream_completion", one)
    monkeypatch.setattr(sbs, "concurrent", many)
    server = sbs.Server(name="x", url="http://127.0.0.1:1", proc=None, ready_s=0.0, model="m", log=Path("/dev/null"))
    got = sbs.batch_rounds(server, ["a", "b"], 10, 3)
    assert calls == ["one", "one", "many", "many", "one", "one", "one", "one", "many"]
    assert got.one_stream == [100.0] * 3 and got.aggregate == [300.0] * 3 and got.ratio() == 3.0
    assert got.identical == [True, False, True]
