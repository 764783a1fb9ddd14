"""Design arithmetic (prints a table): bytes of KV cache moved per decode step for the three TensorRT 10.3 KV designs (DESIGN.md open question).

(a) fixed ``max_len`` buffer + mask: attention always reads ``max_len`` entries;
(b) cache rebuilt inside the graph: ``Concat`` reads the past and writes past+1 (then attention reads it),
    or ``ScatterND`` into a fixed ``max_len`` buffer (output is a full copy: read + write + attention read);
(c) graph returns only the new K/V, the runtime writes them into its arena (chosen): attention reads the
    length bucket ``P ≥ T+1``, plus the one new entry written, read and written again, plus the amortized
    re-layout when the longest slot crosses a bucket (the arena copied once per ``step`` tokens).
Counts are KV-cache bytes only (weights are the same for every option), summed over layers, per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from lineside.runtime.tensorrt.graphs import length_buckets, pick_bucket


@dataclass
class KvShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def entry(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def kv_bytes_per_decode_step(m: KvShape, context: int, max_len: int, first: int = 64, step: int = 512) -> dict[str, float]:
    """KV bytes moved by one decode step of one sequence with ``context`` cached tokens."""
    if context + 1 > max_len:
        raise ValueError("context + 1 must fit max_len")
    e, t = m.entry * m.layers, context
    buckets = length_buckets(max_len, first, step)
    p = pick_bucket(t + 1, buckets)
    i = buckets.index(p)
    prev = buckets[i - 1] if i else 0
    tokens_in_bucket = max(p - prev, 1)
    relayout = 2 * prev / tokens_in_bucket  # read+write the arena at the old pitch, once per bucket
    return {
        "a_fixed_max_len": e * (max_len + 3),
        "b_concat": e * (t + (t + 1) + (t + 1)),
        "b_scatternd": e * (3 * max_len),
        "c_new_only_buckets": e * (p + 3 + relayout),
        "c_bucket": p,
    }


MODELS = [
    KvShape("SmolLM2-135M (30 L, 3 kv x 64, fp16)", 30, 3, 64),
    KvShape("R1-Distill-Llama-8B (32 L, 8 kv x 128, fp16)", 32, 8, 128),
    KvShape("R1-Distill-Qwen-7B (28 L, 4 kv x 128, fp16)", 28, 4, 128),
]


def table(context: int = 4096, max_lens: tuple[int, ...] = (8192, 32768)) -> str:
    """Markdown table of MB moved per decode step (batch 1) at ``context`` tokens."""
    rows = ["| model | max_len | (a) fixed+mask | (b) Concat | (b) ScatterND | (c) new-only, bucket P |",
            "|---|---|---|---|---|---|"]
    for m in MODELS:
        for ml in max_lens:
            r = kv_bytes_per_decode_step(m, context, ml)
            mb = {k: v / 2**20 for k, v in r.items()}
            rows.append(f"| {m.name} | {ml} | {mb['a_fixed_max_len']:.1f} | {mb['b_concat']:.1f} | "
                        f"{mb['b_scatternd']:.1f} | {mb['c_new_only_buckets']:.1f} (P={r['c_bucket']}) |")
    return "\n".join(rows)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.strip().splitlines()[0]).parse_args()
    print(table())
