"""Write a Hugging Face directory (float32 safetensors + config + tokenizer) from a GGUF file.

onnxruntime-genai's model builder reads HF directories; this gives it the same weights lineside
and llama.cpp read. All the GGUF knowledge (names, llama.cpp's q/k row permutation, dequantizing,
the rebuilt tokenizer) is lineside's checkpoint reader; this only writes what it returns.

    python benchmarks/gguf_to_hf.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

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


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-1])
    print(gguf_to_hf(Path(sys.argv[1]), Path(sys.argv[2])))
