"""In-process decode and prompt speed of several lineside bundles, interleaved in one run.

For comparing two ways of building the same model (e.g. two representations of the Q4_1 carry):
every round runs each bundle in turn, so a busy spell on a shared machine hits all of them alike.
Prints per bundle: decode tokens/s (greedy, 128 tokens after a short chat prompt, first to last
generated token), 512-token prompt tokens/s, weight bytes, and the memory-bandwidth floor
(numpy copy bandwidth / weight bytes, measured in the same run); medians and the ratio to the first.

  python benchmarks/bundle_ab.py BUNDLE_A BUNDLE_B [...] --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_side_by_side import (  # noqa: E402
    copy_bandwidth,
    load_lineside,
    prompt_ids,
    short_ids,
    weight_bytes,
    write_gguf_tokenizer,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", type=Path, nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--no-prompt", action="store_true", help="skip the prompt-processing measurement")
    args = ap.parse_args()
    tok = args.bundles[0] / "tokenizer" / "tokenizer.json"
    if not tok.is_file():
        tok = write_gguf_tokenizer(args.bundles[0], Path("/tmp/lineside-ab-tok"))
    long, short = prompt_ids(tok, args.prompt_tokens), short_ids(tok)
    runners = {str(b): load_lineside(b, args.threads, short, long, args.decode_tokens) for b in args.bundles}
    for pp_once, decode_once, _ in runners.values():  # warm-up
        pp_once()
        decode_once()
    dec: dict[str, list[float]] = {n: [] for n in runners}
    pp: dict[str, list[float]] = {n: [] for n in runners}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, (pp_once, decode_once, _) in runners.items():
            if not args.no_prompt:
                pp[name].append(pp_once())
            dec[name].append(decode_once())
            time.sleep(0.1)
    bandwidth = copy_bandwidth(args.threads)
    print(f"threads {args.threads}; {args.rounds} interleaved rounds; load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; numpy copy {bandwidth / 1e9:.1f} GB/s")
    first = next(iter(runners))
    tokens0 = runners[first][2]
    print(f"{'bundle':<40} {'decode tok/s':>12} {'ratio':>6} {'pp tok/s':>9} {'weights MB':>10} {'floor':>6} "
          f"{'of floor':>8}  same tokens")
    for name in runners:
        d = statistics.median(dec[name])
        p = statistics.median(pp[name]) if pp[name] else float("nan")
        wb = weight_bytes([Path(name) / "graphs" / "cpu"])
        floor = bandwidth / wb
        print(f"{name:<40} {d:>12.1f} {d / statistics.median(dec[first]):>6.2f} {p:>9.1f} {wb / 1e6:>10.1f} "
              f"{floor:>6.0f} {d / floor:>8.0%}  {runners[name][2] == tokens0}")
        print(f"  decode runs {[round(x, 1) for x in dec[name]]}")


if __name__ == "__main__":
    main()
