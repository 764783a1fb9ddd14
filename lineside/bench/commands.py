"""`lineside bench`: load-test an OpenAI-compatible server (--url) or a bundle in-process (--bundle)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from lineside import cli_checks as checks
from lineside.bench.load import PATTERNS
from lineside.bench.spec_metrics import SpecCounters, spec_counters
from lineside.console_line import say
from lineside.errors import LinesideError

MAX_REQUESTS = 1_000_000  # one run's schedule is held in memory
MAX_CONCURRENCY = 10_000
MAX_PROMPT_LEN = 1 << 20  # synthetic prompt tokens: more than any bundle's context (and 512 of them fit in memory)
MAX_PROMPTS_PER_REQUEST = 1024  # a list prompt's length: far past what servers take (lineside's: 64)
MAX_RATE = float(MAX_REQUESTS)  # requests/s: × --duration must stay a finite count for the schedule's cap


def num(default, *, kind: type = int, **bounds):
    """A numeric bench option with its range checked while parsing (cli_checks.number_option)."""
    return checks.number_option(default=default, kind=kind, **bounds)


def _prompts(prompts_file: Path | None, prompt_len: str, count: int, seed: int, tokenizer):
    from lineside.bench.prompts import from_jsonl, parse_range, synthetic

    if prompts_file is not None:
        return from_jsonl(prompts_file, tokenizer)
    return synthetic(count, parse_range(prompt_len, "--prompt-len", MAX_PROMPT_LEN), seed, tokenizer)


def _tokenizer(tokenizer: Path | None, bundle: Path | None):
    from lineside.bench.prompts import load_tokenizer

    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if bundle is not None and (bundle / "tokenizer" / "tokenizer.json").is_file():
        return load_tokenizer(bundle / "tokenizer" / "tokenizer.json")
    return None


def _token_counter(tok):
    """Tokens in a streamed text (no special tokens): the output count where a server sends no usage."""
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _run_counting_spec(url: str, api_key: str, schedule, pool, cfg, deadline: float, warmup: int):
    """The run, and the server's speculative-decoding counters over it: read after the warm-up (whose drafts are in
    no other number either) and after the last answer."""
    from lineside.bench.runner import run

    before: list[SpecCounters] = []
    result = run(url, schedule, pool, cfg, deadline, warmup,
                 at_start=lambda: before.append(spec_counters(url, api_key)))
    return result, spec_counters(url, api_key) - before[0]


def bench(
    url: str = typer.Option(None, "--url", help="Base URL of a running OpenAI-compatible server: http://HOST:PORT (a trailing /v1 is fine)."),
    bundle: Path = typer.Option(None, "--bundle", help="Serve this bundle in-process on a loopback port."),
    compare: tuple[str, str] | None = typer.Option(None, "--compare", help="Compare two runs: A B, each a --out directory or its report.json."),
    pattern: str = typer.Option("burst", help="burst | poisson | gamma | concurrency | chunked (prompts fed to "
                                               "/v1/prefill in --chunks pieces, --chunk-interval s apart)"),
    rate: float = num(1.0, kind=float, above=0, high=MAX_RATE,
                      help="burst: requests sent each second; poisson/gamma: mean requests/s."),
    burstiness: float = num(1.0, kind=float, above=0, help="gamma shape: 1 = Poisson, < 1 burstier."),
    concurrency: int = num(4, low=1, high=MAX_CONCURRENCY, help="Requests in flight for --pattern concurrency."),
    chunks: int = num(8, low=1, high=1000, help="--pattern chunked: pieces each prompt is fed in."),
    chunk_interval: float = num(1.5, kind=float, low=0, high=checks.MAX_SECONDS,
                                help="--pattern chunked: seconds between two pieces of a prompt."),
    duration: float = num(20.0, kind=float, low=0, high=checks.MAX_SECONDS,
                          help="Seconds of arrivals (0 = bounded by --num-requests only)."),
    num_requests: int = num(0, low=0, high=MAX_REQUESTS, help="Cap on requests sent (0 = no cap beyond --duration)."),
    endpoint: str = typer.Option("completions", help="completions | chat"),
    prompt_len: str = typer.Option("32:192", help="Synthetic prompt length range in tokens, MIN:MAX."),
    prompts_per_request: str = typer.Option(None, help="MIN:MAX prompts per request (burst default 1:3)."),
    prompts_file: Path = typer.Option(None, help="JSONL prompts ({\"prompt\"|\"text\"|\"messages\"}, optional \"max_tokens\", "
                                                 "chat's \"tools\" and \"tool_choice\") instead."),
    tokenizer: Path = typer.Option(None, help="tokenizer.json for exact synthetic lengths and for counting output tokens of a server "
                                                "that sends no usage (default: bundle's)."),
    max_tokens: int = num(64, low=1, help="max_tokens of every request."),
    temperature: float = num(0.0, kind=float, low=0, help="Sampling temperature (0 = greedy)."),
    ignore_eos: bool = typer.Option(False, help="Send ignore_eos=true (servers that support it)."),
    model: str = typer.Option("", help="Model name to send (default: first of GET /v1/models)."),
    api_key: str = typer.Option(None, "--api-key", envvar=["LINESIDE_API_KEY", "OPENAI_API_KEY"], show_envvar=True,
                                help="--url only: the server's key, sent as 'Authorization: Bearer KEY' "
                                     "(a server run with `serve --api-key`)."),
    seed: int = num(0, low=0, help="Seeds arrivals and synthetic prompts."),
    ttft_ms: float = num(None, kind=float, above=0, help="Goodput target: TTFT at most this many ms."),
    tpot_ms: float = num(None, kind=float, above=0, help="Goodput target: TPOT at most this many ms."),
    e2el_ms: float = num(None, kind=float, above=0,
                         help="Goodput target: E2E latency at most this many ms (vLLM's --goodput e2el:MS)."),
    timeout: float = num(60.0, kind=float, above=0, high=checks.MAX_SECONDS, help="Per-request timeout (s)."),
    max_time: float = num(600.0, kind=float, above=0, high=checks.MAX_SECONDS,
                          help="Hard cap on the whole run (s), past the last send; in-flight requests are cancelled."),
    warmup: int = num(1, low=0, help="Requests sent (and not counted) before the run."),
    threads: int = num(None, low=1, high=checks.MAX_THREADS,
                       help="--bundle only: CPU threads for the in-process runtime."),
    num_slots: int = num(None, low=1, help="--bundle only: concurrent sequences of the in-process engine."),
    speculative: str = typer.Option(None, help="--bundle only: speculative decoding: ngram | layerskip:N | draft:BUNDLE | mtp."),
    spec_tokens: int = num(None, low=1, high=16, help="--bundle only: most tokens proposed per step (default 8)."),
    out: Path = typer.Option(None, help="Write report.json, report.md and PNG plots into this directory "
                                        "(its parent must exist)."),
    force: bool = typer.Option(False, help="Replace an existing, non-empty --out directory."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Skip the PNG plots."),
) -> None:
    """Load-test a server and report TTFT/TPOT/ITL/E2E percentiles, throughput and goodput.

    Definitions as vLLM `bench serve`'s (benchmarks/README.md has the table):

    TTFT = send to first output chunk; E2E = send to end of stream; TPOT = (E2E - TTFT) / (output tokens - 1).

    ITL = gaps between streamed chunks, one sample per chunk. Output tokens: usage, else --tokenizer's count.

    Failed or cut-off requests count as failed and enter no latency; percentiles interpolate linearly.
    """
    console = Console()
    if compare:
        from lineside.bench.report import compare as do_compare
        from lineside.bench.report import result_file

        do_compare(result_file(Path(compare[0])), result_file(Path(compare[1])), console)
        return
    # Every path first: a bad --out must not cost a whole run (and leaves nothing behind).
    if out is not None:
        checks.output_dir(out, "--out", force=force, what="report directory")
        if not no_plots:
            from lineside.bench.plots import check_available

            check_available()
    if bundle is not None:
        from lineside.bundle import read_manifest

        checks.input_dir(bundle, "--bundle", "bundle directory")
        manifest = read_manifest(bundle)
        bundle_max_seq = int(manifest.max_seq_len or 0)
        slots = num_slots or 8
        checks.fits_in_memory(checks.decode_state_bytes(manifest, slots),
                              f"the in-process server's KV cache for {slots} slots", "lower --num-slots")
    for opt, path in (("--prompts-file", prompts_file), ("--tokenizer", tokenizer)):
        if path is not None:
            checks.input_file(path, opt)
    if out is not None:
        checks.apart_from(out, "--out", {"--bundle": bundle, "--prompts-file": prompts_file, "--tokenizer": tokenizer})
    pattern = checks.choice(pattern, "--pattern", PATTERNS)
    if (url is None) == (bundle is None):
        raise LinesideError("give exactly one of --url http://HOST:PORT (a running server) or --bundle DIR")
    if url is not None and not url.startswith(("http://", "https://")):
        raise LinesideError(f"--url {url!r} must start with http:// or https://")
    if url is not None:
        # the server's root; the openai client's base_url ends in /v1 (what its users copy), every path here adds it
        url = url.rstrip("/").removesuffix("/v1")
    if endpoint not in ("completions", "chat"):
        raise LinesideError(f"--endpoint {endpoint!r} is not completions or chat")

    from lineside.runtime.speculative.config import parse_speculative

    spec = parse_speculative(speculative, spec_tokens)
    if spec is not None and bundle is None:
        raise LinesideError("--speculative configures the in-process server: use it with --bundle (for --url, "
                            "start the server with `lineside serve --speculative ...`)")
    if spec is not None:
        from lineside.bundle import open_bundle
        from lineside.runtime.speculative.proposers import check_proposer

        check_proposer(spec, open_bundle(bundle, verify=False))
    from lineside.bench.client import ClientConfig
    from lineside.bench.inprocess import ready_after_s, server_backend
    from lineside.bench.load import make_schedule
    from lineside.bench.prompts import PromptPool, parse_range
    from lineside.bench.report import (
        chunk_count_warning,
        failure_line,
        machine_load,
        machine_record,
        print_summary,
        summarize_run,
        token_sources,
        unknown_prompt_tokens_warning,
        warn_if_loaded,
        write_report,
    )

    ppr = (parse_range(prompts_per_request, "--prompts-per-request", MAX_PROMPTS_PER_REQUEST)
           if prompts_per_request else None)
    if ppr is not None and pattern in ("concurrency", "chunked"):  # the report would claim what was not sent
        raise LinesideError(f"--prompts-per-request applies to burst, poisson and gamma; --pattern {pattern} sends "
                            "one prompt per request: leave it out")
    longest = parse_range(prompt_len, "--prompt-len", MAX_PROMPT_LEN)[1]
    if bundle is not None and bundle_max_seq and prompts_file is None:
        checks.at_most(longest + max_tokens, bundle_max_seq - 1, "--prompt-len MAX + --max-tokens",
                       f"what the bundle's context of {bundle_max_seq} tokens leaves",
                       "lower --prompt-len or --max-tokens, or build the bundle with a larger --max-seq-len")
    if pattern != "concurrency" and not num_requests:
        checks.at_most(int(rate * duration), MAX_REQUESTS, "--rate × --duration", "what one run schedules",
                       "lower --rate or --duration, or cap with --num-requests")
    schedule = make_schedule(pattern, rate=rate, duration=duration, seed=seed, burstiness=burstiness,
                             workers=concurrency, max_requests=num_requests or None, prompts_per_request=ppr)
    if not schedule.closed_loop and not schedule.arrivals:
        raise LinesideError("the schedule sends no request; raise --rate, --duration or --num-requests")
    needed = sum(a.prompts for a in schedule.arrivals) or (num_requests or 256)
    tok = _tokenizer(tokenizer, bundle)
    prompts = _prompts(prompts_file, prompt_len, min(needed, 512) + warmup, seed, tok)
    if endpoint == "completions" and any(a.prompts > 1 for a in schedule.arrivals) and \
            len({p.max_tokens or max_tokens for p in prompts}) > 1:  # a list prompt has one max_tokens
        raise LinesideError(f"{prompts_file}: its lines ask for different \"max_tokens\", and one /v1/completions "
                            "request with several prompts carries only one; use --prompts-per-request 1 or "
                            "--endpoint chat (a call per prompt)")
    if endpoint == "completions" and any(p.tools for p in prompts):  # /v1/completions has no tools
        raise LinesideError(f"{prompts_file}: its lines carry \"tools\", which only chat requests take; pass "
                            "--endpoint chat")
    pool = PromptPool(prompts)
    span = schedule.arrivals[-1].time if schedule.arrivals else duration
    if pattern == "chunked":
        span += (chunks - 1) * chunk_interval  # the last prompt's feeding
    if span >= max_time:  # the runner sends nothing past it: the rest would be missing from the report, not failed
        raise LinesideError(f"--max-time {max_time:g} s would end the run before it sends everything (its requests "
                            f"go out over {span:.1f} s); raise --max-time or lower --duration / --num-requests")
    deadline = min(max_time, (span + timeout) if span else max_time)
    cfg = ClientConfig(base_url=url or "", endpoint=endpoint, model=model, max_tokens=max_tokens,
                       temperature=temperature, ignore_eos=ignore_eos, timeout=timeout,
                       chunks=chunks if pattern == "chunked" else 0, chunk_interval=chunk_interval,
                       api_key=(api_key or "") if url is not None else "",
                       count_tokens=None if tok is None else _token_counter(tok))

    load_before = machine_load()
    warn_if_loaded(load_before, console)
    if bundle is not None:
        from lineside.bench.inprocess import BackgroundServer, bundle_app

        say(console, f"starting lineside's server for {bundle} in-process ...")
        with BackgroundServer(bundle_app(bundle, threads=threads, num_slots=num_slots,
                                         speculative=spec)) as server:
            ready_s = server.start_to_ready_s
            backend, backend_reason = server_backend(server.url)
            result, spec_delta = _run_counting_spec(server.url, "", schedule, pool, cfg, deadline, warmup)
    else:
        ready_s = ready_after_s(url)
        backend, backend_reason = server_backend(url)
        result, spec_delta = _run_counting_spec(url, cfg.api_key, schedule, pool, cfg, deadline, warmup)
    load_after = machine_load()

    summary = summarize_run(result.records, result.duration, ttft_ms, tpot_ms, e2el_ms)
    meta = {"target": url or f"bundle {bundle} (in-process)", "model": result.model,
            "backend": backend, "backend_reason": backend_reason, "endpoint": endpoint,
            "pattern": pattern, "rate": rate, "duration": duration, "num_requests": num_requests,
            "prompts": str(prompts_file) if prompts_file else f"synthetic {prompt_len} tokens",
            "max_tokens": max_tokens, "seed": seed, "started_at": result.started_at}
    if bundle is not None:
        meta.update({k: v for k, v in (("threads", threads), ("num_slots", num_slots)) if v is not None})
    if ready_s is not None:  # cold start: the server process's own start -> ready (in-process: app start -> ready)
        meta["time_to_ready_s" if bundle is None else "server_start_to_ready_s"] = round(ready_s, 2)
    if pattern == "gamma":
        meta["burstiness"] = burstiness
    if pattern == "concurrency":
        meta["concurrency"] = concurrency
    if pattern == "chunked":  # TTFT is measured from the completion, sent right after the last chunk
        meta.update(chunks=chunks, chunk_interval=chunk_interval)
    if ppr or pattern == "burst":
        meta["prompts_per_request"] = prompts_per_request or "1:3"
    meta["machine"] = machine_record(load_before, load_after)
    sources = token_sources(result.records)
    meta["output_tokens_from"] = sources
    print_summary(summary, console, title=f"lineside bench ({pattern}) -> {result.model}")
    say(console, f"backend: {backend} ({backend_reason})" if backend and backend_reason else
        f"backend: {backend}" if backend else "backend: not reported by the server (not lineside's?)")
    for warning in (chunk_count_warning(sources), unknown_prompt_tokens_warning(summary)):
        if warning:
            say(console, warning, style="yellow")
    if spec_delta.steps:
        meta["speculative"] = spec_delta.report()
        say(console, f"speculative decoding: {spec_delta.describe()}")
    if out is not None:
        with checks.staged_dir(out) as tmp:  # complete or absent: never a half-written report
            written = write_report(tmp, result.records, summary, meta, plots=not no_plots)
        say(console, f"wrote {', '.join(str(out / p.name) for p in written.values())}")
    failed = failure_line(result.records, summary)
    if failed is not None:  # the report is written, and says the same; the exit status says the run was not clean
        raise LinesideError(failed + (f" (the report's Errors section lists them: {out / 'report.md'})"
                                      if out is not None else ""))


def register(app: typer.Typer) -> None:
    """Add `lineside bench` to the CLI."""
    app.command("bench")(bench)
