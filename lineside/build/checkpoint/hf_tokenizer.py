"""Copy a Hugging Face directory's tokenizer into a bundle, filling in what the runtime needs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from lineside.errors import CheckpointError, LinesideError


def write_hf_tokenizer(src: Path, out_dir: Path, hf_config: dict[str, Any]) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json (+ generation_config.json); return the key facts."""
    tok_json = src / "tokenizer.json"
    if not tok_json.is_file():
        raise CheckpointError(
            f"{src}: no tokenizer.json; save the tokenizer with a fast tokenizer "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(dir)) and build again"
        )
    tok = _read_json(tok_json)
    vocab = _loaded_vocab(tok_json)
    tcfg = _read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    gen = _read_json(src / "generation_config.json") if (src / "generation_config.json").is_file() else {}
    _check_sampling(src / "generation_config.json")

    templates = _chat_templates(src, tcfg)
    chat_template = default_template(templates)
    # The tokenizer's own BOS before config.json's: R1-Distill-Qwen's config.json says bos_token_id 151643, its EOS,
    # while the tokenizer (what transformers and vLLM encode with) starts prompts with <｜begin▁of▁sentence｜>.
    bos_id = _first_int(gen.get("bos_token_id"), vocab.get(_tok_text(tcfg.get("bos_token"))),
                        hf_config.get("bos_token_id"))
    eos_ids = _id_list(gen.get("eos_token_id"))
    if not eos_ids:
        eos_ids = _id_list(hf_config.get("eos_token_id"))
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None:
        add_bos = _post_processor_adds_bos(tok)
    # the configured ends are checked alone: an id the model has no logit for there is a config mistake
    _check_in_vocabulary(src, hf_config.get("vocab_size"), bos_id if add_bos else None, eos_ids)
    eos_ids = _with_turn_ends(eos_ids, vocab.get(_tok_text(tcfg.get("eos_token"))), tok, chat_template)

    id_to_text = {v: k for k, v in vocab.items()}
    tcfg = dict(tcfg)
    if templates:
        tcfg["chat_template"] = template_record(templates)
    if tcfg.get("bos_token") is None and bos_id in id_to_text:
        tcfg["bos_token"] = id_to_text[bos_id]
    if tcfg.get("eos_token") is None and eos_ids and eos_ids[0] in id_to_text:
        tcfg["eos_token"] = id_to_text[eos_ids[0]]
    tcfg["add_bos_token"] = bool(add_bos)

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tok_json, out_dir / "tokenizer.json")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False), encoding="utf-8")
    if gen:
        shutil.copyfile(src / "generation_config.json", out_dir / "generation_config.json")
    return {
        "bos_token_id": bos_id,
        "eos_token_ids": eos_ids,
        "chat_template": chat_template,
        "add_bos_token": bool(add_bos),
    }


# End-of-turn tokens of the families served: a chat template that closes turns with one of these has the model end
# its answer with it, whatever generation_config.json lists (Qwen2.5 base lists <|endoftext|> alone).
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>")


def _with_turn_ends(eos_ids: list[int], eos_token_id: int | None, tok: dict[str, Any],
                    chat_template: str | None) -> list[int]:
    """The ids generation ends on: generation_config.json's (else config.json's), then tokenizer_config.json's
    eos_token (vLLM stops on the tokenizer's EOS too; a fine-tune often changes only that), then the special
    end-of-turn tokens the chat template writes (as llama.cpp ends on <|im_end|> / <|eot_id|>)."""
    ids = list(eos_ids)
    extra = [eos_token_id] if eos_token_id is not None else []
    if chat_template:
        special = {at.get("content"): at.get("id") for at in tok.get("added_tokens") or []
                   if isinstance(at, dict) and at.get("special") and isinstance(at.get("id"), int)}
        extra += [special[t] for t in TURN_ENDS if t in special and t in chat_template]
    for i in extra:
        if i not in ids:
            ids.append(i)
    return ids


def _check_in_vocabulary(src: Path, vocab_size: Any, bos_id: int | None, eos_ids: list[int]) -> None:
    """A BOS prepended to every prompt, or EOS ids of which none has a logit (the model could never stop), that
    lie past the model's vocabulary: the config and the model disagree (one line; an extra unused EOS is fine)."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        return
    where = "config.json / generation_config.json"
    if bos_id is not None and not 0 <= bos_id < vocab_size:
        raise CheckpointError(f"{src}: bos_token_id {bos_id} is outside the model's vocabulary (vocab_size "
                              f"{vocab_size}), yet every prompt starts with it; fix {where}")
    if eos_ids and not any(0 <= e < vocab_size for e in eos_ids):
        shown = eos_ids[0] if len(eos_ids) == 1 else eos_ids
        raise CheckpointError(f"{src}: eos_token_id {shown} is outside the model's vocabulary (vocab_size "
                              f"{vocab_size}), so the model could never end an answer; fix {where}")


def _check_sampling(gen_path: Path) -> None:
    """The recommended sampling serve takes from the copied generation_config.json (a temperature of "hot", a top_p
    of 5) is checked as serve reads it: the bundle would otherwise refuse to start under serve's defaults."""
    from lineside.runtime.sampling_defaults import read_sampling_defaults

    try:
        read_sampling_defaults(gen_path, advice="fix the field (or remove it) and build again")
    except LinesideError as e:
        raise CheckpointError(str(e)) from None


def _read_json(p: Path) -> dict[str, Any]:
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{p}: malformed JSON ({e}); re-download or fix the file") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{p}: must hold a JSON object")
    return d


def _chat_templates(src: Path, tcfg: dict[str, Any]) -> dict[str, str]:
    """The checkpoint's templates by name (a single one is "default"), where transformers loads them from:
    chat_template.jinja (the default) and additional_chat_templates/<name>.jinja (save_pretrained's files for
    several) when there are any, winning over tokenizer_config.json's, else tokenizer_config.json's (a string or a
    list of named ones), else chat_template.json's."""
    files = {"default": src / "chat_template.jinja"}
    extra = src / "additional_chat_templates"
    if extra.is_dir():
        files.update({f.name.removesuffix(".jinja"): f for f in sorted(extra.glob("*.jinja"))})
    named = {name: _read_text(f) for name, f in files.items() if f.is_file()}
    named = {name: text for name, text in named.items() if text}
    if named:
        return named
    named = _template_value(tcfg.get("chat_template"), src / "tokenizer_config.json")
    if named:
        return named
    cj = src / "chat_template.json"
    if cj.is_file():
        return _template_value(_read_json(cj).get("chat_template"), cj)
    return {}


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{p}: not UTF-8 text ({e}); re-download or fix the file") from None


def default_template(templates: dict[str, str]) -> str | None:
    """The template a chat without tools renders: the one named "default", else the first (as before)."""
    return templates.get("default") or next((t for t in templates.values() if t), None)


def template_record(templates: dict[str, str]) -> str | list[dict[str, str]]:
    """tokenizer_config.json's ``chat_template`` as transformers saves it: the text of a lone default template,
    else the list of {"name", "template"} (every name kept: a request with tools renders "tool_use")."""
    if set(templates) == {"default"}:
        return templates["default"]
    return [{"name": k, "template": v} for k, v in templates.items()]


def _template_value(ct: Any, path: Path) -> dict[str, str]:
    """A chat_template value as ``path`` holds it: a string, or a list of {"name", "template"} objects (what
    transformers saves for several, e.g. "default" and "tool_use"); anything else is refused naming the file, as
    copied it would fail only when a chat is rendered (serve, chat, generate --chat)."""
    if isinstance(ct, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                    and isinstance(t.get("template"), str) for t in ct):
        return {t["name"]: t["template"] for t in ct}
    if ct is not None and not isinstance(ct, str):
        shown = json.dumps(ct)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise CheckpointError(f"{path}: chat_template must be a string or a list of "
                              f"{{\"name\": ..., \"template\": ...}} objects, not {shown}; fix it or remove the key")
    return {"default": ct} if ct else {}


def _loaded_vocab(tok_json: Path) -> dict[str, int]:
    """Text → id of every token (added ones included), as the tokenizers library loads the file: a tokenizer.json
    it cannot load (no model, a post-processor of another shape) is refused here, not when the bundle is served."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(tok_json))
    except Exception as e:  # the Rust parser raises plain Exception; its first line says what is wrong
        raise CheckpointError(f"{tok_json}: not a tokenizer the tokenizers library can load "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); re-download it or save "
                              "the tokenizer again (AutoTokenizer.from_pretrained(...).save_pretrained(dir))") from None
    return tok.get_vocab(with_added_tokens=True)


def _tok_text(t: Any) -> str | None:
    if isinstance(t, dict):
        return t.get("content")
    return t if isinstance(t, str) else None


def _first_int(*vals: Any) -> int | None:
    for v in vals:
        if isinstance(v, list) and v:
            v = v[0]
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _id_list(v: Any) -> list[int]:
    if isinstance(v, bool) or v is None:
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, list):
        return [int(x) for x in v if isinstance(x, int)]
    return []


def _post_processor_adds_bos(tok: dict[str, Any]) -> bool:
    """True when tokenizer.json's post-processor prepends a special token (Llama-3 style)."""
    pp = tok.get("post_processor") or {}
    procs = pp.get("processors", [pp]) if pp.get("type") == "Sequence" else [pp]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single") or []
            return bool(single) and "SpecialToken" in single[0]
    return False
