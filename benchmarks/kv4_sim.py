"""Numpy simulation of 4-bit KV-cache formats on SmolLM2-135M's float weights (no bundle, no onnxruntime).

Runs the float32 forward of build/quant/calibrate.py (the GGUF dequantized) with every layer's post-RoPE keys and
values replaced by what a cache format stores and gives back — keys centred on their calibrated mean
(quant/kv_calib.py) and both rotated by the Hadamard matrix, as the trt graph does — and prints perplexity on
pydoc text in chunks of 512 and on one long document in a single chunk (benchmarks/quality_smollm2.py's texts),
each against the float cache, with the bytes one head vector takes.

    PYTHONPATH=. python benchmarks/kv4_sim.py [--tokens 1024] [--long-tokens 1024] [--formats sym16,asym16,...]
                                              [--sink N] [--int8-layers 0,29] [--per-layer | --only-layer L]

``--sink N`` keeps each sequence's first N positions unquantized (the built int4 keeps 4 in fp16);
``--int8-layers`` gives those layers the int8 format instead; ``--per-layer`` scores each format with one layer
quantized at a time (which layers the loss comes from).

Formats (K/V): ``sym<g>``: one fp16 scale amax/7 per g channels, grid ±7 (the shipped int4 before issue 17's
fix); ``half<g>``: 16 levels ±0.5..±7.5 with scale amax/7.5; ``asym<g>``: fp16 scale (max−min)/15 and fp16
minimum per g channels, 16 levels 0..15 over [min, max]; ``clip<c>sym<g>``: sym with the scale c·amax/7;
``K:V`` gives keys and values different formats (``asym16:sym16``).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from lineside.build.quant import calibrate as cal

HALF = np.float16


def _grouped(x: np.ndarray, g: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def q_sym(x: np.ndarray, g: int, clip: float = 1.0) -> np.ndarray:
    xg = _grouped(x, g)
    s = np.maximum(clip * np.abs(xg).max(-1, keepdims=True) / 7.0, 2.0 ** -20).astype(HALF).astype(np.float32)
    return (np.clip(np.round(xg / s), -7, 7) * s).reshape(x.shape)


def q_half(x: np.ndarray, g: int) -> np.ndarray:
    xg = _grouped(x, g)
    s = np.maximum(np.abs(xg).max(-1, keepdims=True) / 7.5, 2.0 ** -20).astype(HALF).astype(np.float32)
    return ((np.clip(np.floor(xg / s), -8, 7) + 0.5) * s).reshape(x.shape)


def q_asym(x: np.ndarray, g: int, clip: float = 1.0) -> np.ndarray:
    xg = _grouped(x, g)
    mn, mx = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    lo = (mn + 0.5 * (1 - clip) * (mx - mn)).astype(HALF).astype(np.float32)
    s = np.maximum(clip * (mx - mn) / 15.0, 2.0 ** -20).astype(HALF).astype(np.float32)
    return (np.clip(np.round((xg - lo) / s), 0, 15) * s + lo).reshape(x.shape)


def q_int8(x: np.ndarray) -> np.ndarray:
    s = np.maximum(np.abs(x).max(-1, keepdims=True) / 127.0, 2.0 ** -20).astype(HALF).astype(np.float32)
    return np.clip(np.round(x / s), -127, 127) * s


def quantizer(name: str):
    if name == "fp":
        return lambda x: x
    if name == "int8":
        return q_int8
    if name.startswith("asym"):
        g = int(name[4:])
        return lambda x: q_asym(x, g)
    if name.startswith("half"):
        g = int(name[4:])
        return lambda x: q_half(x, g)
    if name.startswith("clip") and "asym" in name:
        c, g = name[4:].split("asym")
        return lambda x: q_asym(x, int(g), float(c))
    if name.startswith("clip"):
        c, g = name[4:].split("sym")
        return lambda x: q_sym(x, int(g), float(c))
    if name.startswith("sym"):
        g = int(name[3:])
        return lambda x: q_sym(x, g)
    raise SystemExit(f"unknown format {name!r}")


def vector_bytes(name: str, d: int) -> int:
    if name == "fp":
        return 2 * d
    if name == "int8":
        return d + 2
    g = int(name.split("sym")[-1] if "sym" in name else name[4:])
    return d // 2 + (d // g) * (4 if "asym" in name else 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024, help="pydoc tokens, chunks of 512")
    ap.add_argument("--long-tokens", type=int, default=1024, help="tokens of the long document, one chunk")
    ap.add_argument("--formats", default="fp,sym16,asym16,sym8:sym16,asym16:sym16,half16,clip0.9sym16")
    ap.add_argument("--uncentred", action="store_true", help="do not subtract the mean key")
    ap.add_argument("--signs", action="store_true", help="Hadamard times random signs (numpy seed 0) instead of plain")
    ap.add_argument("--sink", type=int, default=0, help="keep the first N positions of a sequence unquantized")
    ap.add_argument("--int8-layers", default="", help="comma-separated layers whose cache is int8 instead")
    ap.add_argument("--only-layer", type=int, default=-1, help="quantize only this layer (sensitivity)")
    ap.add_argument("--per-layer", action="store_true", help="score each format with one layer quantized at a time")
    args = ap.parse_args()

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from quality_smollm2 import eval_text, long_text, smollm2_gguf
    from tokenizers import Tokenizer as HFTokenizer

    from lineside.build.checkpoint import open_checkpoint
    from lineside.build.graph.kv_cache import hadamard
    from lineside.build.quant.kv_calib import key_means
    from lineside.config import ModelConfig

    ckpt = open_checkpoint(smollm2_gguf())
    cfg = ModelConfig.from_hf_dict(ckpt.hf_config, name="smollm2")
    cache: dict[str, np.ndarray] = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = np.asarray(ckpt.get(name), np.float32)
        return cache[name]

    import tempfile
    with tempfile.TemporaryDirectory() as td:
        ckpt.write_tokenizer(Path(td))
        tok = HFTokenizer.from_file(str(Path(td) / "tokenizer.json"))
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    ids = np.asarray(enc(eval_text())[: args.tokens + 1])
    chunks = [ids[s:s + 513] for s in range(0, args.tokens, 512)]
    long_ids = np.asarray(enc(long_text())[: args.long_tokens + 1])
    means = key_means(cfg, get, cal.calibration_ids(enc, cal.default_calibration_text()))
    if args.uncentred:
        means[:] = 0
    h = hadamard(cfg.head_dim)
    if args.signs:
        h = (np.random.default_rng(0).choice([-1.0, 1.0], cfg.head_dim)[:, None] * h).astype(np.float32)
    d = cfg.head_dim
    orig_attention = cal._attention
    state = {"layer": -1, "kq": None, "vq": None, "only": args.only_layer}

    int8_layers = {int(x) for x in args.int8_layers.split(",") if x}

    def attention(q, k, v, window):  # k, v [B, S, KV, D]
        layer = state["layer"]
        if state["only"] >= 0 and layer != state["only"]:
            return orig_attention(q, k, v, window)
        kq, vq = (q_int8, q_int8) if layer in int8_layers else (state["kq"], state["vq"])
        m = means[layer][None, None]
        k2 = (kq((k - m) @ h) @ h.T) + m
        v2 = vq(v @ h) @ h.T
        n = args.sink
        if n:
            k2[:, :n], v2[:, :n] = k[:, :n], v[:, :n]
        return orig_attention(q, k2, v2, window)

    def hook(layer, group, *_a):
        if group == "qkv":
            state["layer"] = layer

    cal._attention = attention
    head = get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")

    def ppl(seqs: list[np.ndarray]) -> float:
        nll, n = 0.0, 0
        for s in seqs:
            x = cal.dense_forward(cfg, get, s[None, :-1], hook)
            x = cal._rms(x, get("model.norm.weight"), cfg.rms_norm_eps)[0]
            logits = (x @ head.T).astype(np.float64)
            logits -= logits.max(-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            nll -= float(logp[np.arange(len(s) - 1), s[1:]].sum())
            n += len(s) - 1
        return math.exp(nll / n)

    print(f"SmolLM2 float weights, {args.tokens} pydoc tokens in chunks of 512, long doc {args.long_tokens} tokens "
          f"in one chunk; keys {'uncentred' if args.uncentred else 'centred'}, Hadamard-rotated; head_dim {d}")
    ref = None
    for f in args.formats.split(","):
        kf, _, vf = f.partition(":")
        vf = vf or kf
        state["kq"], state["vq"] = quantizer(kf), quantizer(vf)
        for only in range(cfg.num_layers) if args.per_layer and ref is not None else [args.only_layer]:
            state["only"] = only
            t0 = time.time()
            p, pl = ppl(chunks), ppl([long_ids])
            if ref is None:
                ref = (p, pl)
            where = f"layer {only:2d} " if only >= 0 else ""
            print(f"{where}K {kf:12s} V {vf:12s} bytes K {vector_bytes(kf, d):3d} V {vector_bytes(vf, d):3d}  "
                  f"ppl {p:8.3f} ({100 * (p / ref[0] - 1):+6.2f}%)  long {pl:8.3f} ({100 * (pl / ref[1] - 1):+6.2f}%)"
                  f"  [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
