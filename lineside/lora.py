"""LoRA adapters in Hugging Face PEFT's format, read and checked against a dense base model.

Shared by the builder (``lineside lora add`` copies an adapter into a bundle) and the runtime (adapters
loaded at serve time, from the bundle or from ``--lora-modules``). An adapter becomes per-layer ``(A, B)``
float32 pairs with its scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) folded into B, so the
graph computes ``y += (x @ A^T) @ B^T`` with no per-adapter constant.
"""

from __future__ import annotations

import json
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lineside.config import DENSE_FAMILIES, ModelConfig
from lineside.errors import LinesideError
from lineside.strenum import StrEnum

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"  # PEFT before 0.6 saved this pickle by default


class AdapterError(LinesideError):
    """An adapter that is malformed, or made for another base model."""


class LoraTarget(StrEnum):
    """A linear layer LoRA may adapt, named as PEFT's ``target_modules`` name it (without ``_proj``)."""

    Q = "q"
    K = "k"
    V = "v"
    O = "o"  # noqa: E741 (the projection's own name)
    GATE = "gate"
    UP = "up"
    DOWN = "down"

    @property
    def module(self) -> str:
        block = "mlp" if self in (LoraTarget.GATE, LoraTarget.UP, LoraTarget.DOWN) else "self_attn"
        return f"{block}.{self.value}_proj"


ALL_TARGETS = tuple(LoraTarget)
# The fused matmuls of the dense graphs (one site each per layer): the targets whose outputs each concatenates.
SITES: dict[str, tuple[LoraTarget, ...]] = {
    "qkv": (LoraTarget.Q, LoraTarget.K, LoraTarget.V),
    "o": (LoraTarget.O,),
    "gate_up": (LoraTarget.GATE, LoraTarget.UP),
    "down": (LoraTarget.DOWN,),
}


def parse_targets(text: str) -> tuple[LoraTarget, ...]:
    """``q,v`` / ``all`` → targets in the graphs' order; one line naming a bad one."""
    names = [t.strip().lower().removesuffix("_proj") for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return ALL_TARGETS
    bad = [n for n in names if n not in {t.value for t in ALL_TARGETS}]
    if bad or not names:
        raise LinesideError(f"--lora-targets {text!r}: choose from {','.join(t.value for t in ALL_TARGETS)} or all")
    return tuple(t for t in ALL_TARGETS if t.value in names)


def in_out(cfg: ModelConfig, target: LoraTarget) -> tuple[int, int]:
    """(in_features, out_features) of ``target`` in this model."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {LoraTarget.Q: (h, q), LoraTarget.K: (h, kv), LoraTarget.V: (h, kv), LoraTarget.O: (q, h),
            LoraTarget.GATE: (h, inter), LoraTarget.UP: (h, inter), LoraTarget.DOWN: (inter, h)}[target]


@dataclass
class LoraAdapter:
    """One adapter: ``weights[(layer, target)] = (A [r, in], B [out, r])`` as its file holds them (fp16 or fp32)
    and ``scalings[(layer, target)]`` (lora_alpha/r, rsLoRA's alpha/√r; 1 when absent). Kept in the file's dtype so
    an adapter costs its file's A/B in memory; the float32 B·scaling the graphs read is made when a slot is
    written (``scaled_pair``)."""

    name: str
    rank: int  # the largest rank of any of its layers
    alpha: float
    rslora: bool
    targets: tuple[LoraTarget, ...]
    weights: dict[tuple[int, LoraTarget], tuple[np.ndarray, np.ndarray]] = field(repr=False)
    source: str = ""
    scalings: dict[tuple[int, LoraTarget], float] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def scaled_pair(self, key: tuple[int, LoraTarget]) -> tuple[np.ndarray, np.ndarray] | None:
        """(A, B·scaling) of one linear in float32, or None when the adapter leaves it alone."""
        pair = self.weights.get(key)
        if pair is None:
            return None
        a, b = pair
        return (np.asarray(a, dtype=np.float32),
                np.multiply(b, np.float32(self.scalings.get(key, 1.0)), dtype=np.float32))

    def record(self) -> dict[str, Any]:
        """What a manifest lists about it (beside its files' checksums)."""
        return {"rank": self.rank, "lora_alpha": self.alpha, "use_rslora": self.rslora,
                "targets": [t.value for t in self.targets], "bytes": self.nbytes}


_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+?)_proj\.lora_([AB])(?:\.\w+)?\.weight$")


def _pattern(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name's tail (regex allowed)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _short(path: Path) -> str:
    """A path for a message: its middle elided when it is long (a path too long to look up is echoed back)."""
    text = str(path)
    return text if len(text) <= 160 else f"{text[:60]}...{text[-80:]}"


def _lookup_error(path: Path, e: OSError) -> AdapterError:
    """An adapter path the OS refuses to look up or read (too long, a symlink loop, no permission), in one line."""
    return AdapterError(f"{_short(path)}: the adapter directory cannot be read ({e.strerror or type(e).__name__}); "
                        f"give the PEFT adapter directory ({CONFIG_FILE} and {WEIGHTS_FILE}) by a path this process "
                        "can read")


def read_adapter_config(path: Path) -> dict[str, Any]:
    """adapter_config.json of ``path`` (a directory), refusing what these graphs cannot compute."""
    cfg_file = path / CONFIG_FILE
    try:
        # Path.is_dir() answers False for a symlink loop and raises for a name too long: stat says which
        is_dir = stat.S_ISDIR(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = False
    except OSError as e:
        raise _lookup_error(path, e) from None
    if not is_dir:
        raise AdapterError(f"{path}: not an adapter directory (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        if not cfg_file.is_file():
            raise AdapterError(f"{path}: no {CONFIG_FILE}; save the adapter with PEFT's save_pretrained")
        conf = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_file}: malformed JSON ({e})") from None
    except OSError as e:
        raise _lookup_error(path, e) from None
    if not isinstance(conf, dict):
        raise AdapterError(f"{cfg_file}: expected a JSON object")
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{cfg_file}: peft_type {conf.get('peft_type')!r}; only LoRA adapters are supported")
    # fan_in_fan_out is not refused: it only concerns GPT-2's Conv1D, and PEFT turns it off (with a warning) on the
    # nn.Linear projections of Llama and Qwen2, so such an adapter's tensors are a plain LoRA's
    for key, why in _REFUSED_FIELDS:
        if conf.get(key):
            raise AdapterError(f"{cfg_file}: {key} {_brief(conf[key])} ({why}) is not supported; train a plain LoRA "
                               f"adapter (without {key}) on q/k/v/o/gate/up/down_proj")
    if conf.get("bias", "none") != "none":
        raise AdapterError(f"{cfg_file}: bias {conf.get('bias')!r} is not supported; train with bias='none'")
    if not _is_number(conf.get("lora_alpha", 8)):
        raise AdapterError(f"{cfg_file}: lora_alpha {conf.get('lora_alpha')!r} is not a number; set it to the alpha "
                           "the adapter was trained with")
    patterns = conf.get("alpha_pattern") or {}
    if not (isinstance(patterns, dict) and all(_is_number(v) and _is_regex(k) for k, v in patterns.items())):
        raise AdapterError(f"{cfg_file}: alpha_pattern {patterns!r} must map module names (regular expressions) "
                           "to numbers")
    return conf


# adapter_config.json fields whose adapters these graphs cannot compute: (field, what it is)
_REFUSED_FIELDS = (
    ("use_dora", "DoRA: a per-column magnitude renormalises the update"),
    ("modules_to_save", "full trained copies of layers"),
    ("trainable_token_indices", "trained rows of the token embedding"),
    ("lora_bias", "a bias on lora_B"),
    ("layer_replication", "layers stacked more than once"),
    ("target_parameters", "LoRA on raw parameters, such as MoE experts"),
    ("use_qalora", "QA-LoRA"),
    ("alora_invocation_tokens", "activated LoRA: it adapts only the tokens from its invocation sequence on"),
)


def _brief(value: Any) -> str:
    """A config value for a message: its JSON, cut short (a modules_to_save list can be long)."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)


def _is_regex(key: Any) -> bool:
    try:
        re.compile(key)
    except (re.error, TypeError):
        return False
    return True


def _base_architecture(conf: dict[str, Any]) -> str | None:
    mapping = conf.get("auto_mapping")  # PEFT writes an object or null; it only informs, so anything else is ignored
    cls = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    from lineside.config import ARCHITECTURES

    return ARCHITECTURES.get(cls, cls.lower()) if isinstance(cls, str) else None


def _check_local_base(path: Path, conf: dict[str, Any], cfg: ModelConfig) -> None:
    """Refuse an adapter whose base_model_name_or_path is a local checkpoint of another model. PEFT writes
    auto_mapping only for adapters made without a task_type, so an SFT adapter (task_type CAUSAL_LM) of another
    architecture or vocabulary whose A/B shapes happen to fit would otherwise pass; a Hub id is not looked up."""
    base = conf.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.startswith(("/", "~")):  # a relative path depends on the cwd
        return
    try:
        hf = json.loads((Path(base).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not there on this machine (or unreadable): nothing to compare with
        return
    if not isinstance(hf, dict):
        return
    from lineside.config import family_of
    from lineside.errors import ConfigError

    try:
        family: str | None = family_of(hf)
    except ConfigError:  # a family lineside does not build: named by its model_type, else its first class
        archs, model_type = hf.get("architectures"), hf.get("model_type")
        names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
        family = model_type if isinstance(model_type, str) else names[0] if names else None
    theirs: dict[str, Any] = {"architecture": family,
                              "hidden_size": hf.get("hidden_size"), "num_hidden_layers": hf.get("num_hidden_layers"),
                              "vocab_size": hf.get("vocab_size")}
    ours = {"architecture": cfg.architecture, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "vocab_size": cfg.vocab_size}
    wrong = [k for k, v in theirs.items() if v is not None and v != ours[k]]
    if wrong:
        raise AdapterError(f"{path}: the adapter was trained on {_short(Path(base))} (adapter_config.json "
                           f"base_model_name_or_path), whose " + ", ".join(f"{k} is {theirs[k]}" for k in wrong)
                           + " where the bundle's is " + ", ".join(str(ours[k]) for k in wrong)
                           + "; use an adapter trained on the bundle's base model")


def _load_tensors(path: Path) -> dict[str, np.ndarray]:
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors.numpy reads bf16 adapters then)
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    wf = path / WEIGHTS_FILE
    try:
        present = wf.is_file()
    except OSError as e:
        raise _lookup_error(path, e) from None
    if not present:
        if (path / BIN_FILE).is_file():  # a pickle (older PEFT's default): reading it would run its code
            raise AdapterError(f"{path}: {BIN_FILE} is not read (a pickle), only {WEIGHTS_FILE}; convert it in that "
                               "directory with python -c \"import torch; from safetensors.torch import save_file; "
                               f"save_file(torch.load('{BIN_FILE}'), '{WEIGHTS_FILE}')\"")
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}; save the adapter with PEFT's save_pretrained")
    try:
        return {k: _widened(v) for k, v in load_file(str(wf)).items()}
    except OSError as e:
        raise (_lookup_error(path, e) if e.errno is not None else _unreadable(wf, e)) from None
    except (SafetensorError, ValueError, TypeError) as e:
        raise _unreadable(wf, e) from None


def _unreadable(wf: Path, e: Exception) -> AdapterError:
    return AdapterError(f"{wf}: cannot read it ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                        "it must hold float32, float16 or bfloat16 tensors")


def _widened(arr: np.ndarray) -> np.ndarray:
    """bfloat16 widened to float32 (exact: a bf16 is the top half of a float32; fp16 would clip its range)."""
    return arr.astype(np.float32) if arr.dtype.name == "bfloat16" else arr


def read_adapter(path: str | Path, cfg: ModelConfig, name: str) -> LoraAdapter:
    """Read the PEFT adapter in ``path`` for the base model ``cfg``; one line for any mismatch."""
    path = Path(path)
    if cfg.architecture not in DENSE_FAMILIES:
        raise AdapterError(f"LoRA adapters apply to Llama and Qwen2 bundles; this one is {cfg.architecture}")
    conf = read_adapter_config(path)
    arch = _base_architecture(conf)
    if arch is not None and arch != cfg.architecture:
        raise AdapterError(f"{path}: the adapter was made for a {arch} model (adapter_config.json auto_mapping), "
                           f"the bundle is {cfg.architecture}; use an adapter trained on the bundle's base model")
    _check_local_base(path, conf, cfg)
    alpha = float(conf.get("lora_alpha", 8))
    rslora = bool(conf.get("use_rslora", False))
    alpha_pattern = conf.get("alpha_pattern") or {}  # ranks come from the tensors (what rank_pattern set)
    pairs: dict[tuple[int, LoraTarget], dict[str, np.ndarray]] = {}
    for key, arr in _load_tensors(path).items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A/B of a q/k/v/o/gate/up/down projection "
                               f"(adapter_config.json target_modules {_brief(conf.get('target_modules'))}); only "
                               "those layers can be adapted: train with target_modules limited to them (no "
                               "embed_tokens or lm_head)")
        layer, target = int(m.group(1)), m.group(3)
        if target not in {t.value for t in ALL_TARGETS}:
            raise AdapterError(f"{path}: tensor {key!r} adapts {target}_proj, which is not a linear of this model")
        if layer >= cfg.num_layers:
            raise AdapterError(f"{path}: tensor {key!r} is for layer {layer}, but the base model has "
                               f"{cfg.num_layers} layers; the adapter was made for another model")
        pairs.setdefault((layer, LoraTarget(target)), {})[m.group(4)] = arr
    if not pairs:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA tensors")
    weights: dict[tuple[int, LoraTarget], tuple[np.ndarray, np.ndarray]] = {}
    scalings: dict[tuple[int, LoraTarget], float] = {}
    for (layer, target), ab in sorted(pairs.items()):
        where = f"layer {layer} {target.value}_proj"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: {where} has lora_{next(iter(ab))} but not its pair")
        a, b = ab["A"], ab["B"]
        if a.dtype.kind != "f" or b.dtype.kind != "f":
            raise AdapterError(f"{path}: {where} is {a.dtype}; LoRA weights must be float tensors")
        if a.size == 0 or b.size == 0:  # peft itself warns of these at save time
            raise AdapterError(f"{path}: {where} has empty tensors (A {list(a.shape)}, B {list(b.shape)}): the "
                               "adapter was saved from DeepSpeed ZeRO-3 or FSDP shards that were not gathered; save "
                               "it again inside deepspeed.zero.GatheredParameters or FSDP's summon_full_params")
        fin, fout = in_out(cfg, target)
        r = a.shape[0] if a.ndim == 2 else -1
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fin or b.shape != (fout, r) or r < 1:
            raise AdapterError(f"{path}: {where} has shapes A {list(a.shape)}, B {list(b.shape)}, but the base model "
                               f"needs A [r, {fin}] and B [{fout}, r]; the adapter was made for another model")
        module = f"model.layers.{layer}.{target.module}"
        a_alpha = _pattern(alpha_pattern, module)
        a_alpha = alpha if a_alpha is None else float(a_alpha)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterError(f"{path}: {where} holds a non-finite value")
        weights[(layer, target)] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
        scalings[(layer, target)] = a_alpha / (r ** 0.5 if rslora else r)
    targets = tuple(t for t in ALL_TARGETS if any(k[1] == t for k in weights))
    return LoraAdapter(name=name, rank=max(a.shape[0] for a, _ in weights.values()), alpha=alpha, rslora=rslora,
                       targets=targets, weights=weights, source=str(path), scalings=scalings)


def check_fits(adapter: LoraAdapter, max_rank: int, targets: tuple[LoraTarget, ...], where: str, *,
               rebuild: bool = False) -> None:
    """Refuse an adapter above the slot rank or on a layer the LoRA graphs leave out (one line). ``rebuild``: the
    rank is the bundle's own (``lora add``), which only a rebuild raises; else it is a flag of the command run."""
    if adapter.rank > max_rank:
        fix = f"rebuild the bundle with --max-lora-rank {adapter.rank} or more" if rebuild else \
            f"raise --max-lora-rank to at least {adapter.rank}"
        raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.rank}, above the largest rank {max_rank} that "
                           f"{where} holds; {fix}")
    missing = [t.value for t in adapter.targets if t not in targets]
    if missing:
        raise AdapterError(f"adapter {adapter.name!r} adapts {','.join(missing)}, which {where}'s LoRA graphs "
                           f"leave out (they adapt {','.join(t.value for t in targets)}); rebuild with "
                           "--lora-targets all")


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(name: str) -> str:
    """An adapter name is a model name and a directory: the whole of it must match (``$`` let a trailing newline in)."""
    if not NAME.fullmatch(name or ""):
        raise LinesideError(f"adapter name {name!r}: use 1-64 letters, digits, '.', '_' or '-' (it becomes a model "
                            "name and a directory)")
    return name


@dataclass(frozen=True)
class LoraSite:
    """One fused matmul of one layer that the LoRA graphs adapt: where its targets' outputs sit in its output."""

    layer: int
    site: str  # a key of SITES
    parts: tuple[LoraTarget, ...]  # the adapted targets of this site, in order (the graph's column blocks)
    in_features: int
    out_features: int  # of the whole fused output
    offsets: tuple[int, ...]  # output column where each part starts
    part_widths: tuple[int, ...]  # out_features of each part (its block of the fused output starts at offsets)

    @property
    def a_input(self) -> str:
        return f"lora_a.{self.layer}.{self.site}"

    @property
    def b_inputs(self) -> tuple[str, ...]:
        """One B^T per part (``lora_b.L.SITE.PART``, [that part's out, K]): no zero blocks for the others."""
        return tuple(f"lora_b.{self.layer}.{self.site}.{p.value}" for p in self.parts)


def lora_sites(cfg: ModelConfig, targets: tuple[LoraTarget, ...]) -> list[LoraSite]:
    """The sites a LoRA graph built for ``targets`` has (build and runtime derive them the same way)."""
    out = []
    for layer in range(cfg.num_layers):
        for site, members in SITES.items():
            parts = tuple(t for t in members if t in targets)
            if not parts:
                continue
            widths = [in_out(cfg, t)[1] for t in members]
            starts = dict(zip(members, np.cumsum([0, *widths[:-1]]).tolist(), strict=True))
            out.append(LoraSite(layer=layer, site=site, parts=parts, in_features=in_out(cfg, members[0])[0],
                                out_features=sum(widths), offsets=tuple(int(starts[t]) for t in parts),
                                part_widths=tuple(in_out(cfg, t)[1] for t in parts)))
    return out


LORA_SLOTS_INPUT = "lora_slots"  # int64 [batch]: each row's adapter slot, 0 = none


def cols_input(parts: int) -> str:
    """int64 [P·K]: the adapter slot (1..N) that owns each column of a P-part site's A (K: the stack's live
    width, every part's block holding the same K columns)."""
    return f"lora_cols.{parts}"
