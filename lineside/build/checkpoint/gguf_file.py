"""GGUF files (llama.cpp) read through gguf.GGUFReader's mmap, presented with Hugging Face names."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from lineside.build.checkpoint import gguf_names as gn
from lineside.build.tensors import GGML_BLOCKS, GGMLBlocks
from lineside.errors import CheckpointError


class GGUFCheckpoint:
    """A llama/qwen2 GGUF: tensors keep their block format (get_raw) or come back as float32 (get)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        splits = self.meta("split.count")
        if splits and int(splits) > 1:
            raise CheckpointError(
                f"{self.path}: part of a {splits}-file split GGUF; merge it first "
                "(llama-gguf-split --merge FIRST.gguf OUT.gguf) and pass the merged file"
            )
        arch = self.meta("general.architecture")
        if arch not in gn.ARCHS:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(gn.ARCHS)})"
            )
        self.arch: str = arch
        self._tensors: dict[str, Any] = {}  # HF name → gguf ReaderTensor
        extra = []
        for t in self._reader.tensors:
            hf = gn.hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t
            elif not gn.IGNORED.match(t.name):
                extra.append(t.name)
        if extra:
            raise CheckpointError(
                f"{self.path}: GGUF tensor {extra[0]!r} (and {len(extra) - 1} more) has no Hugging Face "
                f"equivalent for architecture {arch!r}; this GGUF variant is not supported"
            )
        self.hf_config: dict[str, Any] = self._synth_config()
        self._n_head = int(self.hf_config["num_attention_heads"])
        self._n_kv = int(self.hf_config["num_key_value_heads"])
        self._permuted = gn.ARCHS[arch][2]

    # ---- metadata -------------------------------------------------------------------------------

    def meta(self, key: str, default: Any = None) -> Any:
        """A GGUF metadata value as a plain Python value (str, int, float, bool, list)."""
        f = self._reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents() if hasattr(f, "contents") else _field_value(f)
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is unreadable ({e}); re-download it") from None

    def _a(self, key: str, default: Any = None) -> Any:
        return self.meta(f"{self.arch}.{key}", default)

    def _synth_config(self) -> dict[str, Any]:
        hf_arch, model_type, _ = gn.ARCHS[self.arch]
        hidden = self._req("embedding_length")
        heads = self._req("attention.head_count")
        kv = _uniform(self._a("attention.head_count_kv", heads), self.path, "attention.head_count_kv")
        head_dim = int(self._a("attention.key_length") or (hidden // heads if heads else 0))  # 0 heads: refused
        emb = self._tensors.get("model.embed_tokens.weight")
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._a("vocab_size") or (len(tokens.data) if tokens is not None else None)
        if vocab is None and emb is not None:
            vocab = int(emb.shape[-1])
        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": int(vocab or 0),
            "hidden_size": int(hidden),
            "intermediate_size": int(self._req("feed_forward_length")),
            "num_hidden_layers": int(self._req("block_count")),
            "num_attention_heads": int(heads),
            "num_key_value_heads": int(kv),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._a("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._a("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._a("context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "hidden_act": "silu",
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "mlp_bias": "model.layers.0.mlp.gate_proj.bias" in self._tensors,
            "torch_dtype": "float32",
        }
        rs = self._rope_scaling(head_dim, cfg["rope_theta"])
        if rs is not None:
            cfg["rope_scaling"] = rs
        for key, field in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
            v = self.meta(f"tokenizer.ggml.{field}")
            if v is not None:
                cfg[key] = int(v)
        eos = self._eos_ids()
        if eos:
            cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        name = self.meta("general.name")
        if name:
            cfg["_name_or_path"] = str(name)
        return cfg

    def _eos_ids(self) -> list[int]:
        """The ids llama.cpp ends generation on (eos, eot, <|im_end|>, <|endoftext|>, ...)."""
        from lineside.build.checkpoint.gguf_tokenizer import eog_ids, special_id

        tokens = self.meta("tokenizer.ggml.tokens") or []
        return eog_ids(self, tokens, special_id(self, "eos_token_id", tokens))

    def check_model_metadata(self) -> None:
        """What llama.cpp refuses to load a llama/qwen2 GGUF without, beyond the sizes _synth_config requires: the
        RMSNorm epsilon (the config's 1e-6 stand-in moved a 1e-5 model's logits 0.9%) and the trained context
        (4096 stood in for it, so a bundle could claim more context than the model has). A build needs both; opening
        the file for its tokenizer or sizes does not."""
        for key in ("attention.layer_norm_rms_epsilon", "context_length"):
            if self._a(key) is None:
                raise CheckpointError(f"{self.path}: GGUF metadata {self.arch}.{key} is missing (llama.cpp refuses "
                                      "such a file too); re-convert the model")
        self._check_head_dims()
        self._check_token_count()

    def _check_head_dims(self) -> None:
        """The config has one head_dim, rotated whole: a GGUF rotating part of each head (rope.dimension_count below
        key_length, which llama.cpp's qwen2 honours) or with values sized apart from keys built silently into a
        model that computes something else, or failed on a tensor shape without saying why."""
        head_dim = int(self.hf_config["head_dim"])
        for key, what in (("rope.dimension_count", "rotates"), ("attention.value_length", "has values of")):
            v = self._a(key)
            if v is not None and v != head_dim:
                raise CheckpointError(f"{self.path}: GGUF {self.arch}.{key} is {v!r} but its heads are {head_dim} wide; "
                                      f"a model that {what} {v!r} of them per head is not supported "
                                      "(lineside builds Llama/Qwen2 heads rotated whole, values as wide as keys)")

    def _check_token_count(self) -> None:
        """More tokens than embedding rows: the tokenizer would give ids the model has no row for (llama.cpp refuses
        the file; lineside built it, and a prompt holding such a token failed at serve time instead)."""
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        emb = self._tensors.get("model.embed_tokens.weight")
        if tokens is None or emb is None:
            return
        n, rows = len(tokens.data), int(emb.shape[-1])
        if n > rows:
            raise CheckpointError(f"{self.path}: GGUF tokenizer has {n} tokens but token_embd.weight has {rows} rows, "
                                  f"so ids {rows}..{n - 1} have no embedding (llama.cpp refuses such a file too); "
                                  "re-convert the model")

    def _req(self, key: str) -> int:
        """A size the config is made of: an integer (a string or a per-layer array reached arithmetic as it was:
        tracebacks, not a line). Zero passes (a vocabulary-only GGUF has no blocks); the model config refuses it
        when a build needs it."""
        v = self._a(key)
        if v is None:
            raise CheckpointError(f"{self.path}: GGUF metadata {self.arch}.{key} is missing; re-convert the model")
        if type(v) is not int or v < 0:
            raise CheckpointError(f"{self.path}: GGUF metadata {self.arch}.{key} is {v!r}, not a non-negative "
                                  "integer; the GGUF is corrupt or not a llama/qwen2 model lineside reads (re-convert "
                                  "it)")
        return v

    def _rope_scaling(self, head_dim: int, theta: float) -> dict[str, Any] | None:
        """As llama.cpp's load_hparams reads it: the factor is rope.scaling.factor or the older rope.scale_linear,
        and applies as "linear" when rope.scaling.type is missing; "none" never scales."""
        kind = self._a("rope.scaling.type")
        factor = self._a("rope.scaling.factor") or self._a("rope.scale_linear")
        if kind is None and factor:
            kind = "linear"
        if kind not in (None, "none", "linear", "yarn"):
            raise CheckpointError(f"{self.path}: GGUF {self.arch}.rope.scaling.type {kind!r} is not supported "
                                  "(supported: none, linear, yarn)")
        if kind in ("linear", "yarn"):
            rs: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
            orig = self._a("rope.scaling.original_context_length")
            if orig:
                rs["original_max_position_embeddings"] = int(orig)
            return rs
        freqs = next((t for t in self._reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is None:
            return None
        return _fit_llama3(np.asarray(freqs.data, dtype=np.float64).reshape(-1), head_dim, theta, self.path)

    # ---- tensors --------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def ggml_type(self, name: str) -> str:
        """The GGML type name (Q4_1, Q8_0, F32, ...) of a tensor, for callers choosing a path."""
        return self._tensor(name).tensor_type.name

    def get_raw(self, name: str) -> np.ndarray | GGMLBlocks:
        """Q4_0/Q4_1/Q8_0 2-D weights as GGMLBlocks (rows un-permuted), anything else as float32."""
        t = self._tensor(name)
        shape = self.shape(name)
        heads = gn.permuted_heads(name, self._n_head, self._n_kv) if self._permuted else None
        kind = t.tensor_type.name
        try:
            if kind in GGML_BLOCKS and len(shape) == 2:
                rows = np.asarray(t.data).reshape(shape[0], -1)
                bad = GGMLBlocks(kind, (shape[0], shape[1]), rows).non_finite_scale()
                if bad is not None:
                    r, b, what, v = bad
                    raise CheckpointError(f"{self.path}: tensor {t.name!r} ({kind}) has a non-finite {what} ({v}) in "
                                          f"block {b} of row {r}; the GGUF is corrupt (llama.cpp's --check-tensors "
                                          "refuses it too); re-download or re-convert it")
                if heads:
                    rows = gn.unpermute_rows(rows, heads)
                return GGMLBlocks(ggml_type=kind, shape=(shape[0], shape[1]), data=rows)
            w = self._dequant(t).reshape(shape)
            return gn.unpermute_rows(w, heads) if heads else w
        except ValueError as e:
            raise CheckpointError(f"{self.path}: tensor {name!r} {list(shape)} does not match the config ({e})") from None

    def get(self, name: str) -> np.ndarray:
        raw = self.get_raw(name)
        return raw.dequantize() if isinstance(raw, GGMLBlocks) else raw

    def write_tokenizer(self, out_dir: Path) -> dict[str, Any]:
        from lineside.build.checkpoint.gguf_tokenizer import write_gguf_tokenizer

        return write_gguf_tokenizer(self, Path(out_dir))

    def close(self) -> None:
        self._tensors = {}
        self._reader = None  # type: ignore[assignment]  # the mmap closes with its last view

    def _tensor(self, name: str) -> Any:
        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in this checkpoint")
        return t

    def _dequant(self, t: Any) -> np.ndarray:
        """float32 values in GGUF order; a NaN or inf (a corrupt scale or value) is refused here, naming where: an
        fp32 build would carry it into a bundle computing NaN, a quantizer would stop without naming the tensor."""
        kind = t.tensor_type.name
        if kind in ("F32", "F16"):
            w = np.asarray(t.data, dtype=np.float32)
        else:
            from gguf.quants import dequantize

            try:
                with np.errstate(over="ignore", invalid="ignore"):  # a corrupt d: reported below, in one line
                    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            except NotImplementedError:  # the gguf package has no dequantizer for this GGML type
                raise CheckpointError(f"{self.path}: tensor {t.name!r} has GGML type {kind}, which gguf cannot "
                                      "dequantize; re-export the GGUF as F16, Q8_0 or Q4_0, or build from the Hugging "
                                      "Face checkpoint") from None
        i = _first_non_finite(w)
        if i is not None:
            cols = int(t.shape[0])  # ne0: the values of one row, contiguous
            at = f"row {i // cols}, column {i % cols}" if len(t.shape) > 1 else f"element {i}"
            raise CheckpointError(f"{self.path}: tensor {t.name!r} ({kind}) has a non-finite value "
                                  f"({w.reshape(-1)[i]}) at {at}; the GGUF is corrupt (llama.cpp's --check-tensors "
                                  "refuses it too); re-download or re-convert it")
        return w


def _open_reader(path: Path) -> Any:
    """GGUFReader with every failure (missing, not GGUF, truncated, corrupt) turned into one line."""
    from gguf import GGUFReader

    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (bad magic {magic!r}); pass a .gguf file or a HF directory")
    try:
        reader = GGUFReader(path, "r")
    except Exception:  # the reader raises ValueError/IndexError/struct errors on damaged files
        raise CheckpointError(
            f"{path}: corrupt or truncated GGUF (its {size} bytes do not hold the header and metadata it "
            "declares); re-download it"
        ) from None
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CheckpointError(
                f"{path}: truncated GGUF: tensor {t.name!r} ends at byte {int(t.data_offset) + int(t.n_bytes)} "
                f"but the file has {size} bytes; re-download it"
            )
    return reader


def _field_value(f: Any) -> Any:
    """ReaderField → Python value for gguf versions without ReaderField.contents() (< 0.11)."""
    from gguf import GGUFValueType

    def one(part: Any, kind: Any) -> Any:
        return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part.tolist()[0]

    if f.types[0] == GGUFValueType.ARRAY:
        return [one(f.parts[i], f.types[-1]) for i in f.data]
    return one(f.parts[f.data[0]], f.types[0])


def _first_non_finite(w: np.ndarray, chunk: int = 1 << 22) -> int | None:
    """Flat index of the first NaN/inf in w, else None; checked in chunks so no tensor-sized mask is made."""
    flat = w.reshape(-1)
    for start in range(0, flat.size, chunk):
        bad = np.flatnonzero(~np.isfinite(flat[start : start + chunk]))
        if bad.size:
            return start + int(bad[0])
    return None


def _uniform(v: Any, path: Path, key: str) -> int:
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise CheckpointError(f"{path}: GGUF {key} varies per layer ({v[:4]}...); not supported")
        v = v[0]
    return int(v)


def _fit_llama3(freqs: np.ndarray, head_dim: int, theta: float, path: Path) -> dict[str, Any]:
    """Recover Llama-3 rope_scaling from llama.cpp's rope_freqs tensor (the converter's formula)."""
    factor = float(freqs.max())
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv
    for orig in (8192, 4096, 2048, 16384, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0), (1.0, 8.0)):
            smooth = (orig / wavelen - low) / (high - low)
            want = np.where(
                wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth))
            )
            if want.shape == freqs.shape and np.allclose(want, freqs, rtol=1e-4, atol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise CheckpointError(f"{path}: rope_freqs.weight does not match Llama-3 rope scaling; this GGUF is not supported")
