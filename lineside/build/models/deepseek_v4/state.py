"""The DeepSeek-V4 decode state: what the runtime keeps per sequence between steps, with fixed shapes.

Per layer (D = head_dim, W = sliding_window, m = the layer's compression rate, Di = index_head_dim,
Nc = max_seq // m + 1 compressed slots):

  window     [batch, W, D]      the last W keys (K = V) in position order, ending at the newest token
  comp_kv    [batch, L, C]      compressor kv projections of the last L tokens (L = 2m, C = 2D for CSA;
  comp_gate  [batch, L, C]      L = m, C = D for HCA): the open window plus the previous one's overlap half
  comp       [batch, Nc, D]     compressed entries, slot w = window [w·m, (w+1)·m)
  idx_kv / idx_gate [batch, 2m, 2Di], idx_keys [batch, Nc, Di]   the CSA indexer's own compressor

With ``--kv-dtype int8`` the entries attention reads (window, comp) are stored as uint8 grid values plus
one fp16 scale per entry (``past_scale.<layer>.<key>`` [batch, N, 1]). The indexer keys stay float32: they
only pick which entries a query reads, and a rounding that flips a top-k pick changes the output by a
whole entry; so do the compressor buffers (comp_kv/comp_gate/idx_kv/idx_gate: raw projections a softmax
pools, fixed size, not growing with the context).

Every tensor is updated in mode "replace": the graph reads the old value and outputs the whole new
one. Slots whose position is negative or not yet reached are masked in the graph, so zeros are a valid
initial state for a new sequence.
"""

from __future__ import annotations

from lineside.build.models.deepseek_v4.config import CSA, HCA, V4Config
from lineside.build.quant.kv import KvFormat
from lineside.graph_io import StateTensor, StateUpdate


def n_entries(max_seq: int, m: int) -> int:
    """Compressed slots per layer: every window that can complete, plus one that is still open."""
    return max_seq // m + 1


def layer_state(cfg: V4Config, layer: int, max_seq: int) -> dict[str, list]:
    """State key → shape (batch symbolic) for one layer."""
    d, t = cfg.head_dim, cfg.layer_types[layer]
    out: dict[str, list] = {"window": ["batch", cfg.sliding_window, d]}
    if t == CSA:
        m, di = cfg.compress_rates[CSA], cfg.index_head_dim
        nc = n_entries(max_seq, m)
        out.update(comp_kv=["batch", 2 * m, 2 * d], comp_gate=["batch", 2 * m, 2 * d], comp=["batch", nc, d],
                   idx_kv=["batch", 2 * m, 2 * di], idx_gate=["batch", 2 * m, 2 * di], idx_keys=["batch", nc, di])
    elif t == HCA:
        m = cfg.compress_rates[HCA]
        out.update(comp_kv=["batch", m, d], comp_gate=["batch", m, d], comp=["batch", n_entries(max_seq, m), d])
    return out


def state_names(layer: int, key: str) -> tuple[str, str]:
    return f"past.{layer}.{key}", f"present.{layer}.{key}"


QUANTIZABLE = ("window", "comp")  # the K=V entries attention reads; indexer keys and compressor buffers stay float32


def state_tensors(cfg: V4Config, max_seq: int, fmt: KvFormat | None = None) -> list[StateTensor]:
    """The manifest's state list, in graph-input order (``fmt``: quantized entries + their fp16 scales)."""
    from lineside.build.graph.kv_cache import scale_name

    out = []
    for i in range(cfg.num_layers):
        for key, shape in layer_state(cfg, i, max_seq).items():
            a, b = state_names(i, key)
            if fmt is not None and key in QUANTIZABLE:
                d = shape[2]
                out += [StateTensor(input=a, output=b, shape=[*shape[:2], fmt.stored_dim(d)], dtype=fmt.element,
                                    update=StateUpdate.REPLACE, seq_axis=1),
                        StateTensor(input=scale_name(a), output=scale_name(b),
                                    shape=[*shape[:2], fmt.scale_state_dim(d)],
                                    dtype="float16", update=StateUpdate.REPLACE, seq_axis=1)]
            else:
                out.append(StateTensor(input=a, output=b, shape=shape, dtype="float32", update=StateUpdate.REPLACE,
                                       seq_axis=1))
    return out


def state_bytes(cfg: V4Config, max_seq: int) -> dict[str, int]:
    """Bytes per sequence (float32): fixed part, and the part that grows with max_seq (per token)."""
    fixed = per_token = 0.0
    for i in range(cfg.num_layers):
        for key, shape in layer_state(cfg, i, max_seq).items():
            n = 4 * shape[1] * shape[2]
            if key in ("comp", "idx_keys"):
                per_token += 4 * shape[2] / cfg.compress_rates[cfg.layer_types[i]]
            else:
                fixed += n
    return {"fixed": int(fixed), "per_token": int(round(per_token))}
