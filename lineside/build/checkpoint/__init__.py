"""Checkpoint readers: a Hugging Face directory or a GGUF file behind one lazy, mmap'd interface.

``open_checkpoint(path)`` returns a ``CheckpointReader`` whose tensor names, layout and config are
Hugging Face's whatever the source, so model modules only know one naming.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lineside.build.tensors import GGMLBlocks
from lineside.errors import CheckpointError

__all__ = ["CheckpointReader", "CheckpointError", "open_checkpoint"]


@runtime_checkable
class CheckpointReader(Protocol):
    """What every reader offers; all tensor names and layouts are Hugging Face's."""

    path: Path
    hf_config: dict[str, Any]

    def names(self) -> list[str]: ...

    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> np.ndarray:
        """float32, dequantized, HF layout; may be a read-only view of the file (copy to modify)."""
        ...

    def get_raw(self, name: str) -> np.ndarray | GGMLBlocks:
        """The stored form, read-only: safetensors dtype (bf16, fp8 via ml_dtypes ...), or for GGUF
        GGMLBlocks (Q4_0/Q4_1/Q8_0, rows un-permuted) and float32 for other GGML types."""
        ...

    def write_tokenizer(self, out_dir: Path) -> dict[str, Any]:
        """Write tokenizer.json / tokenizer_config.json / generation_config.json into out_dir.

        Returns {"bos_token_id", "eos_token_ids", "chat_template", "add_bos_token"}.
        """
        ...

    def close(self) -> None: ...


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """Open a Hugging Face checkpoint directory or a .gguf file; CheckpointError (one line) otherwise."""
    p = Path(path).expanduser()
    if (p / "manifest.json").is_file() and (p / "graphs").is_dir():
        raise CheckpointError(f"{p} is a lineside bundle (built already), not a checkpoint; run it as it is "
                              f"(`lineside serve {p}`) or build from the checkpoint it was made from")
    if p.is_dir():
        from lineside.build.checkpoint.hf import HFCheckpoint

        return HFCheckpoint(p)
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or p.suffix.lower() == ".gguf":
            from lineside.build.checkpoint.gguf_file import GGUFCheckpoint

            return GGUFCheckpoint(p)
        if p.name == "config.json" or p.suffix == ".safetensors":
            raise CheckpointError(f"{p}: pass the checkpoint directory ({p.parent}), not a file inside it")
        raise CheckpointError(f"{p}: not a checkpoint; pass a Hugging Face directory or a .gguf file")
    raise CheckpointError(f"{p}: no such file or directory; pass a Hugging Face directory or a .gguf file")
