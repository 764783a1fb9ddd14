"""Bench outputs: a rich table in the terminal, a JSON file (records + summary), a markdown report with
PNG plots, and `--compare A.json B.json` (what changed between two runs, better or worse)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lineside import cli_checks as checks
from lineside.bench.metrics import RequestRecord, Summary, TokenSource, summarize
from lineside.console_line import say
from lineside.errors import LinesideError

FORMAT_VERSION = 1
LATENCIES = ("ttft", "tpot", "itl", "e2e")
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}
STATS = ("mean", "p50", "p90", "p99")
RATES = (  # (key, label, unit); higher is better
    ("request_throughput", "Request throughput", "req/s"),
    ("output_throughput", "Output token throughput", "tok/s"),
    ("total_token_throughput", "Total token throughput (prompt + output)", "tok/s"),
    ("effective_throughput", "Effective throughput (sum tokens / sum E2E)", "tok/s"),
    ("goodput", "Goodput (requests meeting targets)", "req/s"),
)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def summary_table(s: Summary, title: str = "lineside bench") -> Table:
    """Counts, throughputs and latency percentiles (ms) as one rich table."""
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    for col in STATS:
        t.add_column(col, justify="right")
    for key in LATENCIES:
        d = getattr(s, key)
        t.add_row(f"{LATENCY_NAMES[key]} (ms)", *(_ms(d[c]) for c in STATS))
    t.add_section()
    for key, label, unit in RATES:
        t.add_row(f"{label} ({unit})", _num(getattr(s, key)), "", "", "")
    t.add_row("Requests ok / failed", f"{s.completed} / {s.failed}", "", "", "")
    t.add_row("Output tokens / duration (s)", f"{s.output_tokens} / {s.duration:.1f}", "", "", "")
    return t


def print_summary(s: Summary, console: Console | None = None, title: str = "lineside bench") -> None:
    (console or Console()).print(summary_table(s, title))


def to_json(records: list[RequestRecord], summary: Summary, meta: dict) -> dict:
    return {"format": "lineside-bench", "version": FORMAT_VERSION, "meta": meta,
            "summary": summary.to_dict(), "records": [r.to_dict() for r in records]}


def write_json(path: Path, records: list[RequestRecord], summary: Summary, meta: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(records, summary, meta), indent=1))
    return path


def load_json(path: Path) -> tuple[list[RequestRecord], Summary, dict]:
    """Read a bench JSON back (for --compare and for re-rendering reports)."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise LinesideError(f"bench result {path} does not exist; pass a JSON file written by `lineside bench`") from None
    except json.JSONDecodeError as e:
        raise LinesideError(f"{path} is not JSON ({e.msg}); pass a file written by `lineside bench`") from None
    except UnicodeDecodeError as e:
        raise LinesideError(f"{path} is not JSON (not UTF-8: {e.reason} at byte {e.start}); pass a file written by "
                            "`lineside bench`") from None
    if not isinstance(d, dict) or d.get("format") != "lineside-bench":
        raise LinesideError(f"{path} is not a lineside bench result (no \"format\": \"lineside-bench\")")
    try:
        return ([RequestRecord.from_dict(r) for r in d.get("records", [])], Summary(**d["summary"]),
                d.get("meta", {}))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LinesideError(f"{path} is an incomplete lineside bench result ({type(e).__name__}: {e}); run "
                            "`lineside bench` again") from None


def result_file(path: Path, option: str = "--compare") -> Path:
    """A bench result to read: a report.json, or a `bench --out` directory holding one (what users have at hand)."""
    p = Path(path).expanduser()
    if p.is_dir():
        inside = p / "report.json"
        if not inside.is_file():
            raise LinesideError(f"{option} {p} is a directory without report.json; give a `lineside bench --out` "
                                "directory or a report.json file")
        p = inside
    return checks.input_file(p, option, "bench result (report.json)")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _loads(values) -> str:
    return "/".join("-" if v is None else f"{v:.2f}" for v in values or []) or "-"


def markdown(s: Summary, meta: dict, images: list[str], records: list[RequestRecord]) -> str:
    """The human report: what was run, the numbers, the plots, and the errors if any."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta.get("started_at", time.time())))
    parts = [f"# lineside bench: {meta.get('model') or meta.get('target', '')}", "",
             f"Run {when}. Metric definitions as vLLM `bench serve`: TTFT = first output chunk − send time; "
             "TPOT = (E2E − TTFT)/(output tokens − 1) (AIPerf calls it ITL); ITL = gaps between streamed chunks, "
             "one sample per chunk; percentiles by linear interpolation; failed requests are in no latency. "
             "Effective throughput = Σ output tokens / Σ E2E.", "", "## Setup", ""]
    parts.append(_md_table(["setting", "value"], [[k, f"`{v}`"] for k, v in meta.items()
                                                  if k not in ("started_at", "machine") and v is not None]))
    machine = meta.get("machine")
    if machine:
        parts += ["", f"Machine: {machine.get('cpu_count')} CPUs; load average (1/5/15 min) "
                      f"{_loads(machine.get('loadavg_before'))} before, {_loads(machine.get('loadavg_after'))} after."]
        if machine.get("loaded"):
            parts += ["", "**Warning: the machine was loaded when this run started; other processes inflate every "
                          "latency here. Compare only with a run made at a similar load.**"]
    parts += ["", "## Latency (ms)", ""]
    parts.append(_md_table(["metric", *STATS],
                           [[LATENCY_NAMES[k], *(_ms(getattr(s, k)[c]) for c in STATS)] for k in LATENCIES]))
    parts += ["", "## Throughput", ""]
    rows = [[label, _num(getattr(s, key)), unit] for key, label, unit in RATES]
    rows += [["Requests completed / failed", f"{s.completed} / {s.failed}", ""],
             ["Prompt tokens / output tokens", f"{'n/a' if s.prompt_tokens is None else s.prompt_tokens} / {s.output_tokens}", "tokens"],
             ["Duration", f"{s.duration:.2f}", "s"]]
    if s.goodput is not None:
        rows.append(["Goodput targets", f"TTFT ≤ {_ms(s.ttft_target)} ms, TPOT ≤ {_ms(s.tpot_target)} ms, "
                                        f"E2E ≤ {_ms(s.e2e_target)} ms", ""])
    parts.append(_md_table(["metric", "value", "unit"], rows))
    if images:
        parts += ["", "## Plots", ""] + [f"![{Path(i).stem}]({i})" for i in images]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    if errors:
        parts += ["", "## Errors", ""]
        parts.append(_md_table(["count", "error"], [[str(n), e.replace("|", "\\|")] for e, n in
                                                   sorted(errors.items(), key=lambda x: -x[1])[:20]]))
    return "\n".join(parts) + "\n"


def write_report(out_dir: Path, records: list[RequestRecord], summary: Summary, meta: dict,
                 plots: bool = True) -> dict[str, Path]:
    """report.json, report.md and the PNGs into out_dir; returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {"json": write_json(out_dir / "report.json", records, summary, meta)}
    images: list[Path] = []
    if plots:
        from lineside.bench.plots import write_plots

        images = write_plots(out_dir, records)
        written.update({p.stem: p for p in images})
    md = out_dir / "report.md"
    md.write_text(markdown(summary, meta, [p.name for p in images], records))
    written["markdown"] = md
    return written


def compare_rows(a: Summary, b: Summary) -> list[tuple[str, float | None, float | None, float | None, bool | None]]:
    """(metric, A, B, relative change B/A-1, B better?) for every throughput and latency percentile."""
    rows = []
    for key, label, _ in RATES:
        rows.append((label, getattr(a, key), getattr(b, key), True))
    for key in LATENCIES:
        for st in ("p50", "p90", "p99"):
            rows.append((f"{LATENCY_NAMES[key]} {st} (ms)", getattr(a, key)[st], getattr(b, key)[st], False))
    out = []
    for label, va, vb, higher_better in rows:
        if va is None or vb is None:
            out.append((label, va, vb, None, None))
            continue
        change = (vb / va - 1.0) if va else None
        better = None if vb == va else ((vb > va) == higher_better)
        out.append((label, va, vb, change, better))
    return out


# meta keys that shape the load or the work each request asks for (not when or where it ran: that is noted apart)
COMPARED_SETTINGS = ("model", "endpoint", "pattern", "rate", "burstiness", "concurrency", "duration", "num_requests",
                     "prompts", "prompts_per_request", "max_tokens", "seed", "chunks", "chunk_interval", "threads",
                     "num_slots")


def _setting(value: object) -> str:
    return "-" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))


def setting_differences(meta_a: dict, meta_b: dict, a: Summary, b: Summary) -> list[str]:
    """'NAME A x, B y' for every setting the two runs did not share; goodput's targets too (goodput against
    different targets is two different numbers, not a change)."""
    def differ(name: str, va: object, vb: object) -> str | None:
        return None if va == vb else f"{name} A {_setting(va)}, B {_setting(vb)}"

    out = [differ(k, meta_a.get(k), meta_b.get(k)) for k in COMPARED_SETTINGS]
    if a.goodput is not None or b.goodput is not None:
        out += [differ("--ttft-ms", _ms(a.ttft_target), _ms(b.ttft_target)),
                differ("--tpot-ms", _ms(a.tpot_target), _ms(b.tpot_target)),
                differ("--e2el-ms", _ms(a.e2e_target), _ms(b.e2e_target))]
    return [d for d in out if d is not None]


def compare(path_a: Path, path_b: Path, console: Console | None = None) -> list[tuple]:
    """Print how run B differs from run A (green = better, red = worse); returns the rows."""
    _, a, meta_a = load_json(path_a)
    _, b, meta_b = load_json(path_b)
    t = Table(title=f"A = {path_a}  vs  B = {path_b}", header_style="bold")
    for col, just in (("metric", "left"), ("A", "right"), ("B", "right"), ("B vs A", "right")):
        t.add_column(col, justify=just)
    rows = compare_rows(a, b)
    for label, va, vb, change, better in rows:
        fmt = _ms if "(ms)" in label else _num
        ch = "-" if change is None else f"{change * 100:+.1f}%"
        style = "" if better is None else ("green" if better else "red")
        t.add_row(label, fmt(va), fmt(vb), f"[{style}]{ch}[/{style}]" if style else ch)
    console = console or Console()
    console.print(t)
    ba, bb = meta_a.get("backend"), meta_b.get("backend")
    if ba and bb and ba != bb:  # e.g. --backend auto fell back to the CPU on B's machine: not a regression
        def why(meta: dict) -> str:
            return f" ({meta['backend_reason']})" if meta.get("backend_reason") else ""

        say(console, f"note: backends differ: A ran on {ba}{why(meta_a)}, B on {bb}{why(meta_b)}")
    differ = setting_differences(meta_a, meta_b, a, b)
    if differ:  # a faster B at half the --max-tokens is no speed-up of the server
        say(console, f"note: the runs were made with different settings ({'; '.join(differ)}); a change above may "
                     "come from them, not from the server", style="yellow")
    ma, mb = meta_a.get("machine") or {}, meta_b.get("machine") or {}
    if ma.get("loaded") or mb.get("loaded") or bool(ma) != bool(mb):
        say(console, f"note: machine load at start, A {_loads(ma.get('loadavg_before'))} on "
                      f"{ma.get('cpu_count', '?')} CPUs, B {_loads(mb.get('loadavg_before'))} on {mb.get('cpu_count', '?')} CPUs; a loaded run "
                      "is slower for reasons outside the server")
    return rows


def failure_line(records: list[RequestRecord], summary: Summary) -> str | None:
    """One line when any request failed (the run then exits non-zero): a load test whose server refused or dropped
    requests part-way is not a clean measurement, and its table alone (ok / failed) was easy to read past."""
    if summary.completed and not summary.failed:
        return None
    if not summary.requests:
        return "no request was sent before the run ended; raise --max-time or --duration"
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            what = r.error or "the answer had no output tokens"
            errors[what] = errors.get(what, 0) + 1
    common, n = max(errors.items(), key=lambda kv: kv[1])
    others = f"; {len(errors) - 1} other error(s) besides" if len(errors) > 1 else ""
    if summary.completed == 0:
        return f"no request succeeded out of {summary.requests} ({n} of them: {common}{others})"
    return (f"{summary.failed} of {summary.requests} requests failed ({n} of them: {common}{others}); the numbers "
            f"above count only the {summary.completed} that succeeded")


def token_sources(records: list[RequestRecord]) -> dict[str, int]:
    """How many successful requests had their output tokens from each source (usage, tokenizer, chunks)."""
    out: dict[str, int] = {}
    for r in records:
        if r.ok:
            out[r.token_source.value] = out.get(r.token_source.value, 0) + 1
    return out


def chunk_count_warning(sources: dict[str, int]) -> str | None:
    """One line when output tokens were counted one per chunk: a chunk may carry several tokens, so output
    throughput and TPOT are then too low and too high, and not comparable with vLLM's numbers."""
    n = sources.get(TokenSource.CHUNKS.value, 0)
    if not n:
        return None
    return (f"warning: the server sent no usage for {n} request(s) (stream_options.include_usage) and no tokenizer "
            "is known, so their output tokens were counted one per streamed chunk (a lower bound: a chunk may carry "
            "several); pass --tokenizer PATH/tokenizer.json to count them from the text")


def unknown_prompt_tokens_warning(summary: Summary) -> str | None:
    """One line when no completed request's prompt tokens were known (no usage, no tokenizer): the report shows
    them and the total token throughput as n/a, where a silent 0 would read as a measurement."""
    if summary.prompt_tokens is not None or not summary.completed:
        return None
    return ("warning: the server sent no usage and no tokenizer is known, so prompt tokens are unknown (n/a) and so "
            "is the total token throughput; pass --tokenizer PATH/tokenizer.json to count them")


def summarize_run(records: list[RequestRecord], duration: float, ttft_ms: float | None,
                  tpot_ms: float | None, e2e_ms: float | None = None) -> Summary:
    """summarize() with the CLI's millisecond targets."""
    def s(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000.0

    return summarize(records, duration, s(ttft_ms), s(tpot_ms), s(e2e_ms))


LOADED_PER_CPU = 0.25  # 1-minute load per CPU above which timings are not the machine's own


def machine_load(getloadavg=os.getloadavg, cpu_count=os.cpu_count) -> dict:
    """The machine's load right now: 1/5/15-minute load averages and the CPU count (injectable for tests)."""
    try:
        one, five, fifteen = getloadavg()
    except OSError:  # not available on this platform
        one = five = fifteen = None
    return {"loadavg_1m": None if one is None else round(one, 2),
            "loadavg_5m": None if five is None else round(five, 2),
            "loadavg_15m": None if fifteen is None else round(fifteen, 2), "cpu_count": cpu_count()}


def loaded_warning(load: dict) -> str | None:
    """A one-line warning when other work shares the CPUs (so a slow run is not read as a slow server)."""
    one, cpus = load.get("loadavg_1m"), load.get("cpu_count") or 1
    if one is None or one <= LOADED_PER_CPU * cpus:
        return None
    return (f"warning: 1-minute load average is {one:.1f} on {cpus} CPUs before starting; other processes "
            "will inflate every latency and lower every throughput (the report records the load)")


def warn_if_loaded(load: dict, console: Console) -> None:
    msg = loaded_warning(load)
    if msg:
        say(console, msg, style="yellow")


def machine_record(before: dict, after: dict) -> dict:
    """What a report keeps about the machine: CPU count and the load averages before and after the run."""
    return {"cpu_count": before.get("cpu_count"),
            "loadavg_before": [before.get(k) for k in ("loadavg_1m", "loadavg_5m", "loadavg_15m")],
            "loadavg_after": [after.get(k) for k in ("loadavg_1m", "loadavg_5m", "loadavg_15m")],
            "loaded": loaded_warning(before) is not None}
