"""The model creator's recommended sampling, from the bundle's ``generation_config.json``, for the fields a request
leaves out: vLLM's ``--generation-config auto`` (its default). DeepSeek-R1-Distill ships temperature 0.6 and top_p
0.95 because it repeats itself endlessly at OpenAI's default of 1.0 / 1.0 without them.

As vLLM reads it: only the sampling fields the file sets to something other than transformers' own defaults
(``GenerationConfig.to_diff_dict``), so a ``top_k: 50`` written out by ``save_pretrained`` changes nothing; and
``max_new_tokens`` (SmolLM-135M-Instruct ships 40), the length of a chat or responses answer whose request sends
no max_tokens (vLLM's ``get_max_tokens`` fallback; /v1/completions keeps OpenAI's 16, which its requests carry).
vLLM takes the smaller of it and a request's own max_tokens; here a request that asks for a length gets it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lineside.errors import LinesideError

# generation_config.json's field -> transformers' default (a field at its default is not a recommendation)
_TRANSFORMERS_DEFAULTS: dict[str, float | int | None] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0, "max_new_tokens": None}
# the fields that are SamplingParams' keywords (max_tokens is the request's length, not a sampling setting)
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for a sampling field it does not send (OpenAI's defaults unless the model says)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # generation_config's max_new_tokens; None: the context's room (chat, responses)

    def filled(self, **given: float | int | None) -> dict[str, float | int]:
        """Every field, as a request gives it (``given``, by name) or else this default: SamplingParams' keywords."""
        return {name: getattr(self, name) if given.get(name) is None else given[name] for name in _SAMPLING}

    def changed(self) -> dict[str, float | int | None]:
        """The fields that differ from OpenAI's defaults (what the startup log says was taken from the model)."""
        base = SamplingDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}


SERVE_ADVICE = "fix the file or serve with --generation-config none to ignore it"


def _checked(name: str, value: Any, where: str, advice: str = SERVE_ADVICE) -> float | int:
    """``value`` as generation_config.json's field ``name`` takes it, or one line naming ``where`` and ``advice``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = {"temperature": 0 <= value <= 2, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,  # a request's ranges
              "repetition_penalty": 0 < value,
              "top_k": float(value).is_integer() and value >= -1,
              "max_new_tokens": float(value).is_integer() and value >= 1}[name]
    if not ok:
        raise LinesideError(f"{where}: {name} is {value!r}, not a valid {name}; {advice}")
    return int(value) if name in ("top_k", "max_new_tokens") else float(value)


check_field = _checked  # the build checks a GGUF's recommended sampling keys, field by field, as serve will read them


def read_sampling_defaults(path: Path, advice: str = SERVE_ADVICE) -> SamplingDefaults:
    """``generation_config.json`` at ``path`` → SamplingDefaults (OpenAI's where the file is absent or silent);
    ``advice``: what a field out of range says to do (the build checks a checkpoint's file with its own)."""
    if not path.is_file():
        return SamplingDefaults()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LinesideError(f"{path}: not readable JSON ({e}); rebuild the bundle or serve with "
                            "--generation-config none") from None
    if not isinstance(config, dict):
        raise LinesideError(f"{path}: not a JSON object; rebuild the bundle or serve with --generation-config none")
    chosen: dict[str, float | int] = {}
    for name, default in _TRANSFORMERS_DEFAULTS.items():
        value = config.get(name)
        if value is None or value == default:
            continue
        chosen[name] = _checked(name, value, str(path), advice)
    if chosen.get("top_k") == -1:  # vLLM's and llama.cpp's "off"
        chosen["top_k"] = 0
    if "max_new_tokens" in chosen:  # transformers' name for a request's max_tokens
        chosen["max_tokens"] = chosen.pop("max_new_tokens")
    return SamplingDefaults(**chosen)  # type: ignore[arg-type]


def resolve_generation_config(option: str, tokenizer_dir: Path) -> SamplingDefaults:
    """``serve --generation-config``, as vLLM spells it: ``auto`` (the bundle's own file), ``vllm`` or ``none``
    (OpenAI's defaults), or a folder holding a generation_config.json (or the file itself)."""
    choice = option.strip()
    if choice.lower() == "auto":
        return read_sampling_defaults(tokenizer_dir / "generation_config.json")
    if choice.lower() in ("vllm", "none"):
        return SamplingDefaults()
    path = Path(choice).expanduser()
    if path.is_dir():
        path = path / "generation_config.json"
    if not path.is_file():
        raise LinesideError(f"--generation-config {option!r}: not auto, vllm or none, nor a folder with a "
                            "generation_config.json (or the file itself)")
    return read_sampling_defaults(path)
