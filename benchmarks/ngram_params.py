"""Choosing the prompt-lookup proposer's n and window: greedy SmolLM2 outputs for benchmarks/speculative.py's
copy-heavy and open-chat prompts are generated once, then each (min_n, max_n, window, k) is replayed offline
against them (the model is deterministic, so a draft is kept exactly while it matches the real continuation).

Prints, per setting and prompt class: tokens per decode step (kept drafts + 1) and the share of proposed
tokens kept (what a wrong guess costs is one wider verification step; see speculative.py for time).

  python benchmarks/ngram_params.py [--bundle BUNDLE] [--tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from speculative import COPY_HEAVY, OPEN_CHAT  # noqa: E402

from lineside.runtime.generate import Generator  # noqa: E402
from lineside.runtime.speculative.ngram import NgramProposer  # noqa: E402


def replay(proposer: NgramProposer, prompt: list[int], out: list[int], k: int) -> tuple[int, int, int]:
    """(steps, drafted, kept) to produce ``out`` after ``prompt`` with greedy verification."""
    steps = drafted = kept = 0
    i = 0
    while i < len(out):
        d = proposer.propose(prompt + out[:i], min(k, len(out) - i - 1)) if i < len(out) - 1 else []
        n = 0
        while n < len(d) and d[n] == out[i + n]:
            n += 1
        steps, drafted, kept = steps + 1, drafted + len(d), kept + n
        i += n + 1
    return steps, drafted, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    g = Generator(a.bundle, threads=a.threads)
    data = {}
    for name, prompts in (("copy-heavy", COPY_HEAVY), ("open chat", OPEN_CHAT)):
        data[name] = []
        for p in prompts:
            ids = g.tokenizer.encode_chat([{"role": "user", "content": p}])
            data[name].append((ids, list(g.stream(ids, a.tokens))))
    print(f"SmolLM2 greedy, {a.tokens} tokens; offline replay of prompt lookup")
    print("| min_n | max_n | window | k | copy-heavy tokens/step | kept | open chat tokens/step | kept |")
    print("|---|---|---|---|---|---|---|---|")
    for min_n, max_n in ((1, 3), (2, 3), (2, 4), (3, 5), (2, 6)):
        for window in (256, 2048):
            for k in (2, 4, 8):
                row = [str(min_n), str(max_n), str(window), str(k)]
                for name in ("copy-heavy", "open chat"):
                    prop = NgramProposer(max_n=max_n, min_n=min_n, window=window)
                    s = d = kept = 0
                    for ids, out in data[name]:
                        a1, b1, c1 = replay(prop, ids, out, k)
                        s, d, kept = s + a1, d + b1, kept + c1
                    toks = sum(len(out) for _, out in data[name])
                    row += [f"{toks / s:.2f}", f"{kept / d:.0%}" if d else "-"]
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
