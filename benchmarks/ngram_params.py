"""Choosing the prompt-lookup proposer's n and window and the draft length cap: greedy SmolLM2 outputs for
benchmarks/speculative.py's copy-heavy and open-chat prompts are generated once, then each (min_n, max_n,
window, k) is replayed offline against them (the model is deterministic, so a draft is kept exactly while it
matches the real continuation), with the adaptive draft length (speculative/adaptive.py) choosing k ≤ the cap.

Prints, per setting and prompt class: tokens per decode step (kept drafts + 1), the share of proposed tokens
kept, and the modelled speedup — tokens over time with a verification step of k drafts costing
``--verify-cost`` + k · ``--verify-token-cost`` plain steps (measure them with `speculative.py --step-cost`;
the defaults are onnxruntime's on SmolLM2), median over the prompts as speculative.py reports. The time itself
is speculative.py's to measure.

  python benchmarks/ngram_params.py [--bundle BUNDLE] [--tokens 128] [--threads 2] [--verify-cost 1.05]
      [--verify-token-cost 0.21]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from speculative import COPY_HEAVY, OPEN_CHAT  # noqa: E402

from lineside.runtime.generate import Generator  # noqa: E402
from lineside.runtime.speculative.adaptive import DraftLength  # noqa: E402
from lineside.runtime.speculative.ngram import NgramProposer  # noqa: E402


def replay(proposer: NgramProposer, prompt: list[int], out: list[int], length: DraftLength,
           token_cost: float) -> tuple[int, int, int, float]:
    """(steps, drafted, kept, modelled time in plain steps) to produce ``out`` after ``prompt`` with greedy
    verification, k chosen by ``length`` as the scheduler does (a 1-token shadow guess at k = 0)."""
    steps = drafted = kept = 0
    time_ = 0.0
    i = 0
    while i < len(out):
        room = len(out) - i - 1
        k = min(length.budget(True), room)
        d = proposer.propose(prompt + out[:i], k) if k > 0 else []
        n = 0
        while n < len(d) and d[n] == out[i + n]:
            n += 1
        if d:
            time_ += length.verify_cost + token_cost * len(d)
            length.observe(len(d), n)
        else:
            time_ += 1.0
            shadow = proposer.propose(prompt + out[:i], 1) if k == 0 and room > 0 else []
            if shadow:
                length.observe(1, int(shadow[0] == out[i]))
        steps, drafted, kept = steps + 1, drafted + len(d), kept + n
        i += n + 1
    return steps, drafted, kept, time_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verify-cost", type=float, default=1.05)
    ap.add_argument("--verify-token-cost", type=float, default=0.21)
    a = ap.parse_args()
    g = Generator(a.bundle, threads=a.threads)
    data = {}
    for name, prompts in (("copy-heavy", COPY_HEAVY), ("open chat", OPEN_CHAT)):
        data[name] = []
        for p in prompts:
            ids = g.tokenizer.encode_chat([{"role": "user", "content": p}])
            data[name].append((ids, list(g.stream(ids, a.tokens))))
    print(f"SmolLM2 greedy, {a.tokens} tokens; offline replay of prompt lookup, adaptive k ≤ cap, a verification "
          f"costing {a.verify_cost} + {a.verify_token_cost}·k plain steps")
    print("| min_n | max_n | window | k cap | copy-heavy tokens/step | kept | modelled speedup | "
          "open chat tokens/step | kept | modelled speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for min_n, max_n in ((1, 3), (2, 4), (3, 5), (2, 8)):
        for window in (256, 2048):
            for k in (2, 4, 8, 16):
                row = [str(min_n), str(max_n), str(window), str(k)]
                for name in ("copy-heavy", "open chat"):
                    prop = NgramProposer(max_n=max_n, min_n=min_n, window=window)
                    s = d = kept = 0
                    speedups = []
                    for ids, out in data[name]:
                        length = DraftLength(k, verify_cost=a.verify_cost, verify_token_cost=a.verify_token_cost)
                        a1, b1, c1, t1 = replay(prop, ids, out, length, a.verify_token_cost)
                        s, d, kept = s + a1, d + b1, kept + c1
                        speedups.append(len(out) / t1)
                    toks = sum(len(out) for _, out in data[name])
                    row += [f"{toks / s:.2f}", f"{kept / d:.0%}" if d else "-", f"{statistics.median(speedups):.2f}x"]
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
