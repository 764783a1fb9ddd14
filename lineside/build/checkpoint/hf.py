"""Hugging Face checkpoint directories: config.json + safetensors (single file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lineside.build.checkpoint.fp8_mxfp4 import dequant_fp8_blocks, dequantize
from lineside.build.checkpoint.hf_tokenizer import write_hf_tokenizer
from lineside.build.checkpoint.safetensors_file import SafetensorsFile
from lineside.config import load_hf_config
from lineside.errors import CheckpointError, ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Companion tensors holding block scales for an FP8 weight ``<prefix>.weight``.
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
# compressed-tensors (FP8-dynamic, w8a8), FBGEMM FP8 and ModelOpt FP8: ``w = q × <prefix>.weight_scale``, the scale
# one per tensor ([] or [1]), per output channel ([out, 1]) or per group ([out, in/g]); never MXFP4.
MULTIPLIER_SUFFIX = ".weight_scale"


class HFCheckpoint:
    """Lazy reader over a Hugging Face directory; tensors are memory-mapped, never loaded whole."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.hf_config: dict[str, Any] = load_hf_config(self.path / "config.json")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}  # tensor name → file name
        layout = _layout(self.path)
        # The shards' headers say what each holds, as transformers and vLLM read them (the index only names the
        # files): a stale index entry, or one naming the wrong shard, must not refuse a checkpoint they load.
        for fname in layout:
            sf = self._files[fname] = SafetensorsFile(self.path / fname)
            for n in sf.names():
                self._where.setdefault(n, fname)
        for fname, names in layout.items():  # a tensor in several shards: the one the index names
            for n in names or ():
                if n in self._files[fname].tensors:
                    self._where[n] = fname

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).info(name).shape

    def dtype(self, name: str) -> str:
        """The safetensors dtype string (BF16, F8_E4M3, ...), for callers choosing a path."""
        return self._file(name).info(name).dtype

    def get_raw(self, name: str) -> np.ndarray:
        return self._file(name).get_raw(name)

    def get(self, name: str) -> np.ndarray:
        """float32 in HF layout; FP8 weights with a block-scale companion, and FP8/INT8 ones with a weight_scale,
        are dequantized."""
        raw = self.get_raw(name)
        if self.dtype(name) in ("F8_E4M3", "F8_E5M2", "I8", "U8") and name.endswith(".weight"):
            prefix = name[: -len(".weight")]
            if prefix + MULTIPLIER_SUFFIX in self._where:  # read as stored, these would be unscaled codes
                if prefix + ".weight_zero_point" in self._where:
                    raise CheckpointError(f"{self.path}: tensor {name!r} has a weight_zero_point (asymmetric "
                                          f"{self.dtype(name)}), which lineside cannot read; build from the "
                                          "original float checkpoint")
                return dequant_fp8_blocks(raw, self.get_raw(prefix + MULTIPLIER_SUFFIX), name)
            scale = self._scale_for(name)
            if scale is not None:  # FP8 with block scales, or MXFP4 (int8 e2m1 pairs) with ue8m0 scales
                return dequantize(raw, scale, name)
        return np.asarray(raw, dtype=np.float32)

    def write_tokenizer(self, out_dir: Path) -> dict[str, Any]:
        return write_hf_tokenizer(self.path, Path(out_dir), self.hf_config)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def _file(self, name: str) -> SafetensorsFile:
        fname = self._where.get(name)
        if fname is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in this checkpoint")
        return self._files[fname]

    def _scale_for(self, name: str) -> np.ndarray | None:
        prefix = name[: -len(".weight")]
        for suf in SCALE_SUFFIXES:
            if prefix + suf in self._where:
                return self.get_raw(prefix + suf)
        return None


def _layout(path: Path) -> dict[str, list[str] | None]:
    """File name → the tensor names the index assigns to it (None: take all in the file)."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; pass a Hugging Face checkpoint directory or a .gguf file")
    index = path / INDEX
    if index.is_file():
        try:
            wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: malformed index (needs a JSON object with a 'weight_map'); re-download it") from None
        files: dict[str, list[str] | None] = {}
        for tname, fname in wm.items():
            files.setdefault(str(fname), []).append(tname)  # type: ignore[union-attr]
        for fname in files:
            if not (path / fname).is_file():
                raise CheckpointError(f"{index}: names shard {fname}, which does not exist in {path}; download it")
        return files
    if (path / SINGLE).is_file():
        return {SINGLE: None}
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if found:
        return dict.fromkeys(found)
    other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" (found {', '.join(other[:3])}: re-save the model with safe_serialization=True)" if other else ""
    raise CheckpointError(f"{path}: no {SINGLE} or {INDEX}; lineside reads safetensors checkpoints{hint}")
