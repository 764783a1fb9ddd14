"""Write a Hugging Face directory (float32 safetensors + config + tokenizer) from a GGUF file.

onnxruntime-genai's model builder reads HF directories; this gives it the same weights lineside
and llama.cpp read. All the GGUF knowledge (names, llama.cpp's q/k row permutation, dequantizing,
the rebuilt tokenizer) is lineside's checkpoint reader; this only writes what it returns.

    python benchmarks/gguf_to_hf.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF into an HF directory (float32 safetensors); returns out_dir."""
    from safetensors.numpy import save_file

    from lineside.build.checkpoint import open_checkpoint

    ckpt = open_checkpoint(gguf_path)
    try:
        weights = {name: ckpt.get(name) for name in ckpt.names()}
        config = dict(ckpt.hf_config, torch_dtype="float32", hidden_act="silu")
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(config, indent=1))
        info = ckpt.write_tokenizer(out_dir)
        if not (out_dir / "generation_config.json").exists():
            gen = {"bos_token_id": info.get("bos_token_id"), "eos_token_id": info.get("eos_token_ids")}
            (out_dir / "generation_config.json").write_text(json.dumps(gen))
    finally:
        ckpt.close()
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("gguf", type=Path, help="the .gguf file to read")
    ap.add_argument("out_dir", type=Path, help="directory to write (created; its parent must exist)")
    args = ap.parse_args(argv)
    if not args.gguf.is_file():
        ap.error(f"{args.gguf}: no such file")
    if not args.out_dir.parent.is_dir():
        ap.error(f"{args.out_dir}: directory {args.out_dir.parent} does not exist")
    from lineside.errors import LinesideError

    try:
        print(gguf_to_hf(args.gguf, args.out_dir))
    except LinesideError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
