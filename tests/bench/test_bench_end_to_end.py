"""The bench against a fake OpenAI-compatible SSE server on 127.0.0.1 (free port), through the real
HTTP client, runner, CLI and report writer. Runs are bounded to a few seconds."""

from __future__ import annotations

import json
import sys
import types

import pytest
import typer
from typer.testing import CliRunner

from lineside.bench import load
from lineside.bench.client import ClientConfig
from lineside.bench.commands import register
from lineside.bench.inprocess import BackgroundServer
from lineside.bench.metrics import summarize, tpot, ttft
from lineside.bench.prompts import Prompt, PromptPool, synthetic
from lineside.bench.runner import run
from lineside.errors import LinesideError
from tests.bench.bench_fake_server import make_app

TTFT, STEP = 0.03, 0.005


@pytest.fixture(scope="module")
def server():
    app = make_app(TTFT, STEP)
    with BackgroundServer(app, startup_timeout=20) as srv:
        srv.app = app
        yield srv


def cli_app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    register(app)

    @app.callback()
    def _root() -> None:  # keep `bench` a subcommand
        pass

    return app


def test_burst_against_server_completions(server):
    sched = load.burst(per_second=3, duration=2, seed=0)
    cfg = ClientConfig(base_url="", max_tokens=8, timeout=10)
    res = run(server.url, sched, PromptPool(synthetic(20, (4, 12), seed=0)), cfg, deadline=10)
    assert res.model == "fake-model" and len(res.records) == 6
    for a, r in zip(sorted(sched.arrivals, key=lambda a: a.time), sorted(res.records, key=lambda r: r.start),
                    strict=True):
        assert r.ok, r.error
        assert r.start == pytest.approx(a.time, abs=0.15)  # sent on schedule
        assert r.prompts == a.prompts and len(r.chunk_times) == a.prompts  # one choice per prompt
        assert r.output_tokens == 8 * a.prompts  # from the server's usage
        assert ttft(r) >= TTFT
        assert STEP * 0.8 <= tpot(r) < 0.1
    s = summarize(res.records, res.duration)
    assert s.completed == 6 and s.failed == 0
    assert s.ttft["p50"] >= TTFT


def test_chat_multi_prompt_request_is_one_record(server):
    sched = load.Schedule("burst", (load.Arrival(0.0, 3),), duration=1.0, max_requests=1)
    cfg = ClientConfig(base_url="", endpoint="chat", max_tokens=5, timeout=10)
    res = run(server.url, sched, PromptPool([Prompt("a b"), Prompt("c"), Prompt("d e f")]), cfg, deadline=10)
    (r,) = res.records
    assert r.ok and sorted(r.chunk_times) == [0, 1, 2]
    assert r.choice_tokens == {0: 5, 1: 5, 2: 5} and r.output_tokens == 15  # role-only delta not counted
    assert r.prompt_tokens == 2 + 1 + 3


def test_chat_reasoning_tokens_are_output(server):
    """A reasoning model's thinking (`serve --reasoning-parser`: `delta.reasoning_content`) is output: its first
    token is the TTFT and its chunks the ITL, as vLLM's bench counts them (they were skipped: a run whose
    max_tokens ended inside the thinking had no TTFT, TPOT or ITL at all)."""
    sched = load.Schedule("poisson", (load.Arrival(0.0),), duration=1.0, max_requests=1)
    cfg = ClientConfig(base_url="", endpoint="chat", max_tokens=6, timeout=10)
    res = run(server.url, sched, PromptPool([Prompt("THINK about it")]), cfg, deadline=10)
    (r,) = res.records
    assert r.ok and len(r.chunk_times[0]) == 6 and r.output_tokens == 6
    assert ttft(r) >= TTFT and tpot(r) is not None


def test_closed_loop_concurrency_is_respected(server):
    server.app.state.max_inflight = 0
    sched = load.concurrency(2, max_requests=7)
    cfg = ClientConfig(base_url="", max_tokens=4, timeout=10)
    res = run(server.url, sched, PromptPool([Prompt("x y")]), cfg, deadline=10)
    assert len(res.records) == 7 and all(r.ok for r in res.records)
    assert server.app.state.max_inflight == 2


def test_failures_and_deadline_are_recorded(server):
    sched = load.Schedule("poisson", (load.Arrival(0.0), load.Arrival(0.05), load.Arrival(0.1)),
                          duration=1.0, max_requests=3)
    pool = PromptPool([Prompt("ok"), Prompt("FAIL please"), Prompt("SLOW one")])
    res = run(server.url, sched, pool, ClientConfig(base_url="", max_tokens=3, timeout=10), deadline=0.8)
    errors = sorted(r.error or "" for r in res.records)
    assert errors == ["", "HTTP 500: injected failure", "cancelled at the run's deadline"]
    assert res.duration < 3.0
    s = summarize(res.records, res.duration)
    assert (s.completed, s.failed) == (1, 2)


def test_closed_loop_requests_cut_at_the_deadline_are_recorded(server):
    """Concurrency workers still waiting at the deadline count as failed, as the open loop's do (they went
    unrecorded: a run cut short looked like fewer requests, none failed)."""
    sched = load.concurrency(2, max_requests=2)
    res = run(server.url, sched, PromptPool([Prompt("SLOW one")]), ClientConfig(base_url="", max_tokens=3,
                                                                               timeout=10), deadline=0.5)
    assert [r.error for r in res.records] == ["cancelled at the run's deadline"] * 2
    assert summarize(res.records, res.duration).failed == 2


def test_cli_url_report_and_compare(server, tmp_path):
    runner = CliRunner()
    outs = []
    for i, rate in enumerate((2, 4)):
        out = tmp_path / f"run{i}"
        r = runner.invoke(cli_app(), ["bench", "--url", server.url, "--pattern", "burst", "--rate", str(rate),
                                      "--duration", "2", "--max-tokens", "6", "--prompt-len", "4:16",
                                      "--ttft-ms", "500", "--tpot-ms", "50", "--out", str(out), "--seed", "3"])
        assert r.exit_code == 0, r.output
        assert "TTFT" in r.output and "Goodput" in r.output
        for name in ("report.json", "report.md", "latency_distribution.png", "throughput_over_time.png",
                     "latency_over_time.png"):
            assert (out / name).stat().st_size > 0, name
        outs.append(out)
    data = json.loads((outs[1] / "report.json").read_text())
    assert data["summary"]["requests"] == 8 and data["summary"]["failed"] == 0
    assert data["meta"]["pattern"] == "burst" and data["meta"]["prompts_per_request"] == "1:3"
    assert data["meta"]["time_to_ready_s"] == 1.25  # the server's own process start -> ready
    assert data["summary"]["goodput"] == pytest.approx(8 / data["summary"]["duration"])
    md = (outs[1] / "report.md").read_text()
    assert "![latency_distribution](latency_distribution.png)" in md and "| TTFT |" in md
    assert (outs[0] / "latency_distribution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = runner.invoke(cli_app(), ["bench", "--compare", str(outs[0] / "report.json"), str(outs[1] / "report.json")])
    assert r.exit_code == 0, r.output
    assert "Request throughput" in r.output and "TTFT p99 (ms)" in r.output and "%" in r.output


def test_cli_url_sends_the_servers_api_key(tmp_path, monkeypatch):
    """A server started with `serve --api-key` (or LINESIDE_API_KEY) is benched with the same key; without one the
    model listing's 401 is one line that says to pass it (it asked "is the server running?")."""
    monkeypatch.delenv("LINESIDE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    args = ["--pattern", "concurrency", "--concurrency", "1", "--num-requests", "2", "--duration", "0",
            "--max-tokens", "3", "--warmup", "0"]
    with BackgroundServer(make_app(0.01, 0.002, api_key="k3y"), startup_timeout=20) as srv:
        runner = CliRunner()
        r = runner.invoke(cli_app(), ["bench", "--url", srv.url, *args])
        said = str(r.exception)  # the LinesideError `lineside` prints as one line
        assert isinstance(r.exception, LinesideError) and "401" in said and "--api-key" in said, said
        assert "is the server running" not in said
        r = runner.invoke(cli_app(), ["bench", "--url", srv.url, "--model", "m", *args])
        said = str(r.exception)  # every request refused: say why
        assert isinstance(r.exception, LinesideError) and "wrong API key" in said and "--api-key" in said, said
        r = runner.invoke(cli_app(), ["bench", "--url", srv.url, "--api-key", "k3y", *args,
                                      "--out", str(tmp_path / "o"), "--no-plots"])
        assert r.exit_code == 0, r.output
        assert json.loads((tmp_path / "o" / "report.json").read_text())["summary"]["completed"] == 2
        r = runner.invoke(cli_app(), ["bench", "--url", srv.url, *args], env={"LINESIDE_API_KEY": "k3y"})
        assert r.exit_code == 0, r.output


def test_cli_url_with_the_openai_clients_v1_suffix(server, tmp_path):
    """`--url http://HOST:PORT/v1` (the openai client's base_url, the README's snippet) listed models at
    /v1/v1/models and failed with a 404 asking whether it was an OpenAI-compatible server."""
    args = ["--pattern", "concurrency", "--concurrency", "1", "--num-requests", "2", "--duration", "0",
            "--max-tokens", "3", "--warmup", "0", "--no-plots"]
    for i, suffix in enumerate(("/v1", "/v1/")):
        r = CliRunner().invoke(cli_app(), ["bench", "--url", server.url + suffix, *args, "--out", str(tmp_path / str(i))])
        assert r.exit_code == 0, (r.output, r.exception)
        summary = json.loads((tmp_path / str(i) / "report.json").read_text())["summary"]
        assert summary["completed"] == 2 and summary["failed"] == 0


@pytest.mark.parametrize("args", [["--pattern", "poisson", "--rate", "5", "--duration", "3"],
                                  ["--pattern", "poisson", "--rate", "5", "--duration", "0", "--num-requests", "40"],
                                  ["--pattern", "concurrency", "--duration", "3"],
                                  ["--pattern", "chunked", "--rate", "5", "--duration", "0.5", "--chunks", "3",
                                   "--chunk-interval", "0.5"]])
def test_cli_refuses_a_max_time_that_would_cut_the_schedule_short(server, args):
    """`--duration 3 --max-time 1` sent one second of arrivals and dropped the rest unrecorded: the report said
    duration 3, 0 failed, with a third of the requests (so did --duration 900 under the default --max-time 600)."""
    sent = server.app.state.requests
    r = CliRunner().invoke(cli_app(), ["bench", "--url", server.url, *args, "--max-time", "1", "--max-tokens", "2",
                                       "--prompt-len", "2:4"])
    said = str(r.exception)
    assert isinstance(r.exception, LinesideError) and "--max-time 1" in said and "raise --max-time" in said, said
    assert server.app.state.requests == sent


def test_cli_per_line_max_tokens_that_a_list_prompt_cannot_carry_are_refused(server, tmp_path):
    """A list `prompt` has one max_tokens: a burst request carrying prompts whose lines ask for different ones sent
    the first line's for all of them (the others' output lengths silently wrong). Refused before the run; chat
    (one call per prompt), one prompt per request and equal max_tokens run."""
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "a b", "max_tokens": 2}\n{"prompt": "c d", "max_tokens": 5}\n')
    args = ["bench", "--url", server.url, "--prompts-file", str(pf), "--pattern", "burst", "--rate", "1",
            "--duration", "1", "--warmup", "0", "--no-plots"]
    sent = server.app.state.requests
    r = CliRunner().invoke(cli_app(), [*args, "--prompts-per-request", "2"])
    said = str(r.exception)
    assert isinstance(r.exception, LinesideError) and "max_tokens" in said and "--prompts-per-request 1" in said, said
    assert server.app.state.requests == sent
    for i, extra in enumerate((["--prompts-per-request", "2", "--endpoint", "chat"], ["--prompts-per-request", "1"])):
        r = CliRunner().invoke(cli_app(), [*args, *extra, "--out", str(tmp_path / str(i))])
        assert r.exit_code == 0, (r.output, r.exception)
        (rec,) = json.loads((tmp_path / str(i) / "report.json").read_text())["records"]
        assert rec["choice_tokens"] == ({"0": 2, "1": 5} if i == 0 else {"0": 2})
    pf.write_text('{"prompt": "a b", "max_tokens": 3}\n{"prompt": "c d"}\n')
    r = CliRunner().invoke(cli_app(), [*args, "--prompts-per-request", "2", "--max-tokens", "3",
                                       "--out", str(tmp_path / "same")])
    assert r.exit_code == 0, (r.output, r.exception)


@pytest.mark.parametrize("pattern", ["concurrency", "chunked"])
def test_cli_refuses_prompts_per_request_a_pattern_does_not_use(server, pattern):
    """concurrency and chunked send one prompt per request: `--prompts-per-request 3` was ignored, and the
    report's setup still said prompts_per_request 3 over records that carried 1."""
    sent = server.app.state.requests
    r = CliRunner().invoke(cli_app(), ["bench", "--url", server.url, "--pattern", pattern, "--num-requests", "2",
                                       "--duration", "0", "--prompts-per-request", "3", "--max-tokens", "2"])
    said = str(r.exception)
    assert isinstance(r.exception, LinesideError) and "--prompts-per-request" in said and pattern in said, said
    assert server.app.state.requests == sent


def test_cli_without_matplotlib_stops_before_the_run(server, tmp_path, monkeypatch):
    """matplotlib is not one of lineside's dependencies (only the dev/bench extras'): `bench --out DIR` without it
    ran the whole load, then refused to write the plots — and with them the report, the run's records lost."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    sent = server.app.state.requests
    r = CliRunner().invoke(cli_app(), ["bench", "--url", server.url, "--pattern", "concurrency", "--num-requests",
                                       "2", "--duration", "0", "--max-tokens", "3", "--out", str(tmp_path / "o")])
    said = str(r.exception)
    assert isinstance(r.exception, LinesideError) and "matplotlib" in said and "--no-plots" in said, said
    assert server.app.state.requests == sent and not (tmp_path / "o").exists()


def test_cli_bundle_mode_serves_create_app_in_process(tmp_path, monkeypatch):
    from lineside.bundle import FORMAT_VERSION

    bundle = tmp_path / "bundle"
    bundle.mkdir()  # a manifest is all `bench --bundle` reads before serving (create_app is faked)
    (bundle / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "files": {},
                                                      "architecture": "llama", "config": "config.json",
                                                      "max_seq_len": 4096}))
    seen = {}

    def create_app(path, **options):
        seen["path"], seen["options"] = path, options
        return make_app(0.01, 0.002, model="bundle-model")

    monkeypatch.setitem(sys.modules, "lineside.server.app", types.SimpleNamespace(create_app=create_app))
    r = CliRunner().invoke(cli_app(), ["bench", "--bundle", str(bundle), "--pattern", "concurrency",
                                       "--concurrency", "2", "--num-requests", "4", "--duration", "0",
                                       "--max-tokens", "3", "--out", str(tmp_path / "o"), "--no-plots",
                                       "--num-slots", "4"])
    assert r.exit_code == 0, r.output
    assert seen["path"] == str(bundle) and seen["options"] == {"num_slots": 4}
    data = json.loads((tmp_path / "o" / "report.json").read_text())
    assert data["meta"]["model"] == "bundle-model" and data["summary"]["completed"] == 4
    assert data["meta"]["server_start_to_ready_s"] >= 0  # in-process: app start -> /health/ready
    assert not (tmp_path / "o" / "latency_distribution.png").exists()


def test_request_timeout_is_recorded(server):
    sched = load.Schedule("poisson", (load.Arrival(0.0),), duration=1.0, max_requests=1)
    res = run(server.url, sched, PromptPool([Prompt("SLOW")]), ClientConfig(base_url="", timeout=0.3), deadline=5)
    (r,) = res.records
    assert not r.ok and r.error == "ReadTimeout: nothing received for 0.3s (--timeout)"
    assert 0.25 < r.end - r.start < 1.5


def test_cli_bundle_reports_the_backend_auto_chose(tiny_bundle, tmp_path):
    """`bench --bundle` (backend auto) says which backend served and why, in the terminal and in report.json /
    report.md: a number means little without knowing whether TensorRT or onnxruntime CPU produced it."""
    out = tmp_path / "o"
    r = CliRunner().invoke(cli_app(), ["bench", "--bundle", str(tiny_bundle), "--pattern", "concurrency",
                                       "--concurrency", "1", "--num-requests", "2", "--duration", "0",
                                       "--max-tokens", "3", "--prompt-len", "4:8", "--warmup", "0",
                                       "--threads", "1", "--num-slots", "2", "--out", str(out), "--no-plots"])
    assert r.exit_code == 0, r.output
    assert "backend: onnxruntime (the bundle has no trt graph)" in r.output
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["backend"] == "onnxruntime" and meta["backend_reason"] == "the bundle has no trt graph"
    assert "| backend | `onnxruntime` |" in (out / "report.md").read_text()


def test_cli_url_reports_the_servers_backend_or_that_it_gave_none(server, tmp_path):
    args = ["--pattern", "concurrency", "--concurrency", "1", "--num-requests", "1", "--duration", "0",
            "--max-tokens", "2", "--warmup", "0", "--no-plots"]
    r = CliRunner().invoke(cli_app(), ["bench", "--url", server.url, *args, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert "backend: tensorrt (engine e.plan matches this GPU)" in r.output  # what its /health/ready says
    meta = json.loads((tmp_path / "a" / "report.json").read_text())["meta"]
    assert (meta["backend"], meta["backend_reason"]) == ("tensorrt", "engine e.plan matches this GPU")
    with BackgroundServer(make_app(0.01, 0.002, ready_body={"status": "ok"}), startup_timeout=20) as other:
        r = CliRunner().invoke(cli_app(), ["bench", "--url", other.url, *args, "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert "backend: not reported by the server" in r.output
    assert json.loads((tmp_path / "b" / "report.json").read_text())["meta"]["backend"] is None


def test_cli_a_run_with_failed_requests_exits_non_zero_and_says_why(server, tmp_path):
    """A server that refused some requests part-way through a run exited 0 (only an "ok / failed" cell of the
    table said so): a CI job or script read the run as a clean measurement. The report is still written; the run
    ends with one line naming the commonest error and a non-zero exit."""
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "ok one"}\n{"prompt": "FAIL two"}\n{"prompt": "ok three"}\n')
    out = tmp_path / "o"
    r = CliRunner().invoke(cli_app(), ["bench", "--url", server.url, "--prompts-file", str(pf), "--pattern",
                                       "concurrency", "--concurrency", "1", "--num-requests", "3", "--duration", "0",
                                       "--max-tokens", "2", "--warmup", "0", "--no-plots", "--out", str(out)])
    said = str(r.exception)
    assert isinstance(r.exception, LinesideError) and "\n" not in said, (r.output, said)
    assert "1 of 3 requests failed" in said and "HTTP 500: injected failure" in said and "2 that succeeded" in said
    data = json.loads((out / "report.json").read_text())
    assert (data["summary"]["completed"], data["summary"]["failed"]) == (2, 1)
    assert "injected failure" in (out / "report.md").read_text()


def test_cli_a_server_that_is_down_is_one_line_before_the_run_with_model_given(tmp_path):
    """With --model, nothing was asked of the server before the run: a server that was down cost the whole
    --duration, then ended as "no request succeeded". Now one line up front, and nothing written."""
    from lineside.bench.inprocess import free_port

    r = CliRunner().invoke(cli_app(), ["bench", "--url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                                       "--pattern", "concurrency", "--num-requests", "2", "--duration", "0",
                                       "--max-tokens", "2", "--warmup", "0", "--no-plots",
                                       "--out", str(tmp_path / "o")])
    said = str(r.exception)
    assert isinstance(r.exception, LinesideError) and "cannot reach" in said and "is the server running" in said, said
    assert not (tmp_path / "o").exists()


def test_cli_counts_output_tokens_of_a_server_without_usage_from_the_text(tmp_path):
    """A server that ignores include_usage and streams 2 tokens per chunk: one per chunk counted 4 of 8 tokens per
    request (half the output throughput, twice the TPOT) with no word of it. With --tokenizer the streamed text is
    counted (as vLLM's bench does); without one the run says its counts are chunks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    args = ["--pattern", "concurrency", "--concurrency", "1", "--num-requests", "2", "--duration", "0",
            "--max-tokens", "8", "--warmup", "0", "--no-plots"]
    with BackgroundServer(make_app(0.01, 0.002, tokens_per_chunk=2, usage=False), startup_timeout=20) as srv:
        r = CliRunner().invoke(cli_app(), ["bench", "--url", srv.url, *args, "--tokenizer",
                                           str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "a")])
        assert r.exit_code == 0, (r.output, r.exception)
        assert "counted one per streamed chunk" not in r.output
        data = json.loads((tmp_path / "a" / "report.json").read_text())
        assert data["summary"]["output_tokens"] == 16 and data["meta"]["output_tokens_from"] == {"tokenizer": 2}
        r = CliRunner().invoke(cli_app(), ["bench", "--url", srv.url, *args, "--out", str(tmp_path / "b")])
        assert r.exit_code == 0, (r.output, r.exception)
        assert "counted one per streamed chunk" in " ".join(r.output.split()) and "--tokenizer" in r.output
        data = json.loads((tmp_path / "b" / "report.json").read_text())
        assert data["summary"]["output_tokens"] == 8 and data["meta"]["output_tokens_from"] == {"chunks": 2}


def test_cli_goodput_with_an_e2el_target(server, tmp_path):
    """--e2el-ms (vLLM's --goodput e2el:MS): every request here takes over 30 ms (the fake's TTFT), so a 1 ms target
    leaves no goodput and a 10 s one keeps every request; the report names the target."""
    args = ["bench", "--url", server.url, "--pattern", "concurrency", "--concurrency", "1", "--num-requests", "2",
            "--duration", "0", "--max-tokens", "3", "--warmup", "0", "--no-plots"]
    for ms, want in (("1", 0.0), ("10000", 2.0)):
        out = tmp_path / ms
        r = CliRunner().invoke(cli_app(), [*args, "--e2el-ms", ms, "--out", str(out)])
        assert r.exit_code == 0, (r.output, r.exception)
        summary = json.loads((out / "report.json").read_text())["summary"]
        assert summary["e2e_target"] == float(ms) / 1000
        assert summary["goodput"] * summary["duration"] == pytest.approx(want)
        assert f"E2E ≤ {float(ms):.1f} ms" in (out / "report.md").read_text()


def test_cli_speculative_counters_leave_the_warm_up_out(tmp_path):
    """The report's acceptance numbers are the run's, like every other number: the server's counters are read after
    the warm-up. Each request drafts 4 and keeps 3 in one step: 2 measured requests are 8 drafted, 6 kept, 2 steps
    (with the 2 warm-ups read in, as before, 16 / 12 / 4)."""
    args = ["--pattern", "concurrency", "--concurrency", "1", "--num-requests", "2", "--duration", "0",
            "--max-tokens", "3", "--warmup", "2", "--no-plots", "--out", str(tmp_path / "o")]
    app = make_app(0.01, 0.002, spec=(4, 3))
    with BackgroundServer(app, startup_timeout=20) as srv:
        r = CliRunner().invoke(cli_app(), ["bench", "--url", srv.url, *args])
        assert r.exit_code == 0, r.output
    assert app.state.requests == 4  # 2 warm-ups + 2 measured
    spec = json.loads((tmp_path / "o" / "report.json").read_text())["meta"]["speculative"]
    assert spec == {"draft_tokens": 8.0, "accepted_tokens": 6.0, "verify_steps": 2.0, "acceptance": 0.75,
                    "tokens_per_verify_step": 4.0}  # 6/8 kept; (6 + 2) / 2 tokens per step
    assert "6/8 proposed tokens accepted (75%)" in r.output


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def test_chat_answer_of_tool_calls_only_is_output(server):
    """A chat answer that is only a tool call (`delta.tool_calls`, no content) is generated output: its first chunk
    is the TTFT, its chunks the ITL (vLLM's bench times every chunk with choices). It had no TTFT, TPOT or ITL."""
    sched = load.Schedule("poisson", (load.Arrival(0.0),), duration=1.0, max_requests=1)
    cfg = ClientConfig(base_url="", endpoint="chat", max_tokens=5, timeout=10)
    prompt = Prompt("find it", messages=({"role": "user", "content": "find it"},), tools=(TOOL,))
    (r,) = run(server.url, sched, PromptPool([prompt]), cfg, deadline=10).records
    assert r.ok and len(r.chunk_times[0]) == 5 and r.output_tokens == 5
    assert ttft(r) >= TTFT and tpot(r) is not None


def test_cli_prompts_file_with_tools_counts_tool_call_text(tmp_path):
    """A prompts file's "tools" are sent; a server without usage answering with a tool call only had "no output
    tokens" for every request (run failed). The call's text is counted: name "lookup" + arguments " t1 .. t5" is
    6 words with a whitespace tokenizer, 12 over 2 requests. A completions run refuses tools in one line."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "find it"}], "tools": [TOOL]}) + "\n")
    args = ["--pattern", "concurrency", "--concurrency", "1", "--num-requests", "2", "--duration", "0",
            "--max-tokens", "6", "--warmup", "0", "--no-plots", "--prompts-file", str(prompts),
            "--tokenizer", str(tmp_path / "tokenizer.json")]
    with BackgroundServer(make_app(0.01, 0.002, usage=False), startup_timeout=20) as srv:
        r = CliRunner().invoke(cli_app(), ["bench", "--url", srv.url, "--endpoint", "chat", *args,
                                           "--out", str(tmp_path / "a")])
        assert r.exit_code == 0, (r.output, r.exception)
        data = json.loads((tmp_path / "a" / "report.json").read_text())
        assert data["summary"]["completed"] == 2 and data["summary"]["output_tokens"] == 12
        assert data["summary"]["ttft"]["p50"] is not None
        r = CliRunner().invoke(cli_app(), ["bench", "--url", srv.url, *args])
        assert isinstance(r.exception, LinesideError) and "--endpoint chat" in str(r.exception)


def test_cli_prompt_tokens_of_a_server_without_usage_and_no_tokenizer_are_unknown_not_zero(tmp_path):
    """A prompts file, no tokenizer, a server that sends no usage: nothing counts the prompts, and the report said
    "0" prompt tokens and a total token throughput of the output alone. They are unknown: null in report.json,
    "n/a" in report.md, and one warning line; the output tokens (counted per chunk) are still reported."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "one two three four"}) + "\n")
    args = ["--pattern", "concurrency", "--concurrency", "1", "--num-requests", "2", "--duration", "0",
            "--max-tokens", "4", "--warmup", "0", "--no-plots", "--prompts-file", str(prompts)]
    with BackgroundServer(make_app(0.01, 0.002, usage=False), startup_timeout=20) as srv:
        r = CliRunner().invoke(cli_app(), ["bench", "--url", srv.url, *args, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, (r.output, r.exception)
    said = " ".join(r.output.split())
    assert "prompt tokens are unknown" in said and "--tokenizer" in said, said
    summary = json.loads((tmp_path / "a" / "report.json").read_text())["summary"]
    assert summary["completed"] == 2 and summary["output_tokens"] == 8
    assert summary["prompt_tokens"] is None and summary["total_token_throughput"] is None
    assert "| Prompt tokens / output tokens | n/a / 8 |" in (tmp_path / "a" / "report.md").read_text()


@pytest.mark.parametrize(("args", "needles", "code"), [
    (["--rate", "1e308"], ["--rate", "out of range"], 2),  # × --duration was infinity: int() raised OverflowError
    (["--prompt-len", "99999999999999999999:99999999999999999999"], ["--prompt-len", "at most"], 1),  # numpy int64
    (["--prompts-per-request", "1:99999999999"], ["--prompts-per-request", "at most"], 1),
])
def test_cli_huge_numbers_are_one_line_before_the_run(args, needles, code, capsys):
    """Numbers past what a run can hold were tracebacks (an OverflowError, numpy's "high is out of bounds for
    int64"); each is one line, before anything is sent (the URL has no server)."""
    import subprocess

    from lineside.cli import run_app
    from tests.cli.cli_run import assert_one_line_error, lineside_app

    rc = run_app(lineside_app(), ["bench", "--url", "http://127.0.0.1:9", "--no-plots", *args])
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), *needles, code=code)
