"""Checks on the fallback bundle before the server starts: it must tokenize exactly as the primary does
(requests are tokenized once, then routed), so a bundle with another tokenizer is refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

from lineside.errors import LinesideError
from lineside.host_memory import available_memory_bytes

# In the tokenizer folder but not the tokenizer: the model's sampling recommendation (the server samples with the
# primary's), which siblings of one family often set apart (Qwen2.5-0.5B-Instruct's repetition_penalty is not 7B's)
NOT_TOKENIZER = frozenset({"tokenizer/generation_config.json"})


def tokenizer_fingerprint(bundle: str | os.PathLike[str]) -> tuple:
    """The manifest's hashes of the tokenizer files and its tokenizer settings (BOS/EOS, chat template)."""
    from lineside.bundle import read_manifest

    manifest = read_manifest(bundle)
    files = tuple(sorted((rel, entry.sha256) for rel, entry in manifest.files.items()
                         if rel.startswith("tokenizer/") and rel not in NOT_TOKENIZER))
    settings = repr(sorted((manifest.tokenizer or {}).items()))
    return files, settings


def check_fallback(primary: str | os.PathLike[str], fallback: str | os.PathLike[str]) -> None:
    """Raise one LinesideError line unless ``fallback`` is a bundle with the primary's tokenizer."""
    from lineside.bundle import read_manifest, verify_files

    primary, fallback = Path(primary), Path(fallback)
    try:
        theirs = tokenizer_fingerprint(fallback)
        verify_files(fallback, read_manifest(fallback), check_hash=False)  # a missing file: here, as the primary's
    except LinesideError as e:
        raise LinesideError(f"--fallback {fallback}: {e}") from None
    ours = tokenizer_fingerprint(primary)
    if theirs[0] != ours[0]:
        raise LinesideError(f"--fallback {fallback}: its tokenizer differs from {primary.name}'s; a fallback must "
                            "use the same tokenizer (build it from the same model family)")
    if theirs[1] != ours[1]:
        raise LinesideError(f"--fallback {fallback}: its special tokens or chat template differ from "
                            f"{primary.name}'s; rebuild it from the same checkpoint's tokenizer")


def planned_bytes(bundle: str | os.PathLike[str], *, num_slots: int) -> int:
    """What `lineside jetson plan` counts for serving ``bundle``: weights at its quantization, the KV cache for
    ``num_slots`` sequences of its context, and the prefill activations (runtime overhead not included)."""
    from lineside.bundle import read_manifest
    from lineside.jetson.planner import load_model
    from lineside.jetson.sizes import check_kv_dtype, check_quant

    manifest = read_manifest(bundle)
    spec = load_model(str(bundle))
    weights = spec.weights(check_quant(spec.quantization or "w4a16"), 128).total
    ctx = int(manifest.max_seq_len)
    kv_dtype = (manifest.quantization or {}).get("kv_cache", {}).get("dtype", "fp16")
    return weights + spec.kv(ctx, num_slots, check_kv_dtype(kv_dtype)).total + spec.activations(ctx, num_slots, 512)


def available_bytes() -> int | None:
    """Memory the two engines load into: the host's MemAvailable (CPU backends and Jetson unified memory)."""
    return available_memory_bytes()


def check_fits(primary: str | os.PathLike[str], fallback: str | os.PathLike[str], *, num_slots: int,
               available: int | None) -> None:
    """Refuse (one line) a fallback that would not fit beside the primary when the primary alone fits."""
    if available is None:
        return
    ours = planned_bytes(primary, num_slots=num_slots)
    theirs = planned_bytes(fallback, num_slots=num_slots)
    if ours <= available < ours + theirs:
        gib = 1 << 30
        raise LinesideError(f"--fallback {Path(fallback)}: does not fit beside {Path(primary).name}: they need "
                            f"{ours / gib:.2f} + {theirs / gib:.2f} GiB, {available / gib:.2f} GiB is available; "
                            "use a smaller fallback or fewer --num-slots")
