"""Report files from hand-made timings, JSON round trip, and the compare arithmetic (better/worse)."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from lineside.bench.metrics import RequestRecord, summarize
from lineside.bench.report import compare, compare_rows, load_json, write_json, write_report
from lineside.errors import LinesideError
from tests.bench.test_bench_end_to_end import cli_app


def records(scale: float) -> list[RequestRecord]:
    """Six requests, one per 0.5 s; each streams 5 tokens every 0.1*scale s after a 0.2*scale s TTFT."""
    out = []
    for i in range(6):
        s = i * 0.5
        chunks = [s + 0.2 * scale + k * 0.1 * scale for k in range(5)]
        out.append(RequestRecord(start=s, end=chunks[-1], prompt_tokens=12, output_tokens=5,
                                 chunk_times={0: chunks}, choice_tokens={0: 5}))
    out.append(RequestRecord(start=3.0, end=3.1, error="HTTP 503: draining"))
    return out


def test_report_files_and_round_trip(tmp_path):
    recs = records(1.0)
    s = summarize(recs, ttft_target=0.3)
    written = write_report(tmp_path, recs, s, {"target": "http://127.0.0.1:1", "model": "m", "started_at": 0})
    assert set(written) == {"json", "markdown", "latency_distribution", "throughput_over_time",
                            "latency_over_time"}
    for p in written.values():
        assert p.stat().st_size > 0
    back_recs, back_s, meta = load_json(tmp_path / "report.json")
    assert back_recs == recs and back_s == s and meta["model"] == "m"
    md = (tmp_path / "report.md").read_text()
    assert "| TTFT | 200.0 | 200.0 | 200.0 | 200.0 |" in md  # TTFT exactly 0.2 s for every request
    assert "| TPOT | 100.0 |" in md
    assert "| 1 | HTTP 503: draining |" in md  # errors listed with counts
    assert "TTFT ≤ 300.0 ms" in md


def test_compare_rows_direction():
    a = summarize(records(1.0))
    b = summarize(records(0.5))  # everything twice as fast
    rows = {r[0]: r for r in compare_rows(a, b)}
    label, va, vb, change, better = rows["TTFT p50 (ms)"]
    assert (va, vb) == pytest.approx((0.2, 0.1)) and change == pytest.approx(-0.5) and better is True
    _, va, vb, change, better = rows["Effective throughput (sum tokens / sum E2E)"]
    assert change == pytest.approx(1.0) and better is True  # 5/0.6 -> 5/0.3 tokens per second
    worse = {r[0]: r for r in compare_rows(b, a)}
    assert worse["E2E p99 (ms)"][4] is False
    assert rows["Goodput (requests meeting targets)"][3] is None  # no targets: nothing to compare


def test_compare_prints_table(tmp_path):
    write_json(tmp_path / "a.json", records(1.0), summarize(records(1.0)), {})
    write_json(tmp_path / "b.json", records(0.5), summarize(records(0.5)), {})
    buf = io.StringIO()
    compare(tmp_path / "a.json", tmp_path / "b.json", Console(file=buf, width=140))
    text = buf.getvalue()
    assert "TTFT p50 (ms)" in text and "200.0" in text and "100.0" in text and "-50.0%" in text


def test_compare_says_when_the_runs_had_different_backends(tmp_path):
    """A TensorRT run against an onnxruntime one (auto fell back: no engine for this GPU) is no regression."""
    write_json(tmp_path / "a.json", records(0.5), summarize(records(0.5)), {"backend": "tensorrt"})
    write_json(tmp_path / "b.json", records(1.0), summarize(records(1.0)),
               {"backend": "onnxruntime", "backend_reason": "TensorRT not used: no engine for this GPU"})
    write_json(tmp_path / "c.json", records(1.0), summarize(records(1.0)), {"backend": "tensorrt"})
    buf = io.StringIO()
    compare(tmp_path / "a.json", tmp_path / "b.json", Console(file=buf, width=200))
    text = " ".join(buf.getvalue().split())
    assert "backends differ: A ran on tensorrt, B on onnxruntime (TensorRT not used: no engine for this GPU)" in text
    buf = io.StringIO()
    compare(tmp_path / "a.json", tmp_path / "c.json", Console(file=buf, width=200))
    assert "backends differ" not in buf.getvalue()


def test_compare_says_which_settings_the_runs_did_not_share(tmp_path):
    """`--compare` of a run at --max-tokens 64 against one at 128 (or another rate, pattern, goodput target) showed
    every change in green or red as if the server had changed; it now names each setting that differs."""
    meta = {"model": "m", "endpoint": "completions", "pattern": "burst", "rate": 2.0, "duration": 20.0,
            "max_tokens": 64, "seed": 0, "prompts": "synthetic 32:192 tokens", "started_at": 1.0}
    write_json(tmp_path / "a.json", records(1.0), summarize(records(1.0), ttft_target=0.3), meta)
    write_json(tmp_path / "b.json", records(0.5), summarize(records(0.5), ttft_target=0.5),
               {**meta, "rate": 4.0, "max_tokens": 128, "started_at": 2.0})
    write_json(tmp_path / "c.json", records(0.5), summarize(records(0.5), ttft_target=0.3), {**meta, "started_at": 3.0})
    buf = io.StringIO()
    compare(tmp_path / "a.json", tmp_path / "b.json", Console(file=buf, width=400))
    text = " ".join(buf.getvalue().split())
    assert "different settings (rate A 2, B 4; max_tokens A 64, B 128; --ttft-ms A 300.0, B 500.0)" in text, text
    buf = io.StringIO()
    compare(tmp_path / "a.json", tmp_path / "c.json", Console(file=buf, width=400))  # only the start time differs
    assert "different settings" not in buf.getvalue()


def test_load_json_rejects_foreign_files(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / "y.json").write_text("{")
    with pytest.raises(LinesideError, match="not a lineside bench result"):
        load_json(tmp_path / "x.json")
    with pytest.raises(LinesideError, match="is not JSON"):
        load_json(tmp_path / "y.json")
    with pytest.raises(LinesideError, match="does not exist"):
        load_json(tmp_path / "z.json")
    (tmp_path / "u.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(LinesideError, match="is not JSON"):
        load_json(tmp_path / "u.json")


@pytest.mark.parametrize("raw", [
    {"format": "lineside-bench"},  # no summary
    {"format": "lineside-bench", "summary": {"x": 1}},  # a summary of another shape
    {"format": "lineside-bench", "summary": {}, "records": [1]},
])
def test_load_json_refuses_a_cut_or_edited_result_in_one_line(tmp_path, raw):
    (tmp_path / "r.json").write_text(json.dumps(raw))
    with pytest.raises(LinesideError, match="incomplete lineside bench result") as e:
        load_json(tmp_path / "r.json")
    assert "\n" not in str(e.value)


def test_cli_compare_takes_the_out_directories_themselves(tmp_path):
    """`bench --out DIR` is what a user has at hand: `--compare A B` of two such directories reads their report.json
    (it answered "is a directory; give a bench result" before); a directory without one is one line, exit 1."""
    from typer.testing import CliRunner

    for name, scale in (("a", 1.0), ("b", 0.5)):
        (tmp_path / name).mkdir()
        write_json(tmp_path / name / "report.json", records(scale), summarize(records(scale)), {})
    runner = CliRunner()
    r = runner.invoke(cli_app(), ["bench", "--compare", str(tmp_path / "a"), str(tmp_path / "b" / "report.json")])
    assert r.exit_code == 0, r.output
    assert "TTFT p50 (ms)" in r.output and "-50.0%" in r.output  # 200 ms -> 100 ms
    (tmp_path / "empty").mkdir()
    r = runner.invoke(cli_app(), ["bench", "--compare", str(tmp_path / "a"), str(tmp_path / "empty")])
    assert r.exit_code != 0 and not isinstance(r.exception, AssertionError)
    assert isinstance(r.exception, LinesideError) and "without report.json" in str(r.exception)


def test_total_token_throughput_in_the_table_report_json_and_compare(tmp_path):
    """records(1.0): 6 requests of 12 prompt + 5 output tokens over 3.1 s (first send 0, last end 3.1), so
    (72 + 30) / 3.1 = 32.90 tok/s, where vLLM prints its "Total Token throughput"; a report written before the
    number was kept has it worked out from its counts."""
    from lineside.bench.report import summary_table

    s = summarize(records(1.0))
    assert s.duration == pytest.approx(3.1) and s.total_token_throughput == pytest.approx(102 / 3.1)
    buf = io.StringIO()
    Console(file=buf, width=200).print(summary_table(s))
    assert re.search(r"Total token throughput \(prompt \+ output\) \(tok/s\) +│ +32\.90 ", buf.getvalue())
    write_report(tmp_path / "a", records(1.0), s, {"started_at": 0}, plots=False)
    assert json.loads((tmp_path / "a" / "report.json").read_text())["summary"]["total_token_throughput"] == \
        pytest.approx(102 / 3.1)
    assert "| Total token throughput (prompt + output) | 32.90 | tok/s |" in (tmp_path / "a" / "report.md").read_text()
    old = json.loads((tmp_path / "a" / "report.json").read_text())
    del old["summary"]["total_token_throughput"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_json(tmp_path / "old.json")[1].total_token_throughput == pytest.approx(102 / 3.1)
    rows = {r[0]: r for r in compare_rows(summarize(records(1.0)), summarize(records(0.5)))}
    # 0.5 scale: last end 2.5 + 0.1 + 0.2 = 2.8 s, but the failed record ends at 3.1: duration 3.1 both times
    assert rows["Total token throughput (prompt + output)"][1:3] == pytest.approx((102 / 3.1, 102 / 3.1))
