"""Checkpoints with several named chat templates (Hermes-2-Pro's and Command-R's "default" + "tool_use"): the
bundle keeps each, and a chat with tools renders "tool_use" as transformers' apply_chat_template picks it (token
ids equal), from a Hugging Face directory and from a GGUF (``tokenizer.chat_template.<name>``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lineside.build.checkpoint import open_checkpoint
from lineside.runtime.tokenizer import Tokenizer
from tests.build.checkpoint.test_checkpoint_tokenizer import _tiny_bpe, _tiny_gguf

DEFAULT = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
           "{% if add_generation_prompt %}assistant:{% endif %}")
TOOL_USE = ("{{ bos_token }}{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
            "[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] <tool_call>{% endif %}")
NAMED = {"default": DEFAULT, "tool_use": TOOL_USE}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is line 4 running?"}]
TOOLS = [{"type": "function", "function": {"name": "line_status", "description": "A line's state",
                                           "parameters": {"type": "object", "properties": {"line": {"type": "integer"}}}}}]


def _hf_dir(tiny_llama, tmp_path: Path) -> Path:
    src, _ = tiny_llama
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = [{"name": k, "template": v} for k, v in NAMED.items()]
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return d


def _transformers_ids(tok, tools) -> list[int]:
    return list(tok.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_hf_named_templates_render_as_transformers(tiny_llama, tmp_path, tools):
    from transformers import AutoTokenizer

    d = _hf_dir(tiny_llama, tmp_path)
    info = open_checkpoint(d).write_tokenizer(tmp_path / "tok")
    ours = Tokenizer(tmp_path / "tok", info)
    assert ours.chat_templates == NAMED and ours.chat_template == DEFAULT
    theirs = AutoTokenizer.from_pretrained(d)
    assert ours.encode_chat(MESSAGES, tools=tools) == _transformers_ids(theirs, tools)
    # the bundle's tokenizer files load in transformers with the same templates
    assert AutoTokenizer.from_pretrained(tmp_path / "tok").chat_template == NAMED


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_gguf_named_templates_render_as_transformers(tiny_llama, tmp_path, tools):
    """gguf-py's add_chat_template writes the list as tokenizer.chat_template (default), tokenizer.chat_templates
    (the other names) and tokenizer.chat_template.<name>; llama.cpp's convert_hf_to_gguf.py passes it the list."""
    from transformers import PreTrainedTokenizerFast

    named = [{"name": k, "template": v} for k, v in NAMED.items()]
    path = _tiny_gguf(tmp_path, tiny_llama, **_tiny_bpe(), pre="qwen2", bos=1, eos=2, chat_template=named)
    info = open_checkpoint(path).write_tokenizer(tmp_path / "tok")
    assert info["chat_template"] == DEFAULT
    ours = Tokenizer(tmp_path / "tok", info)
    assert ours.chat_templates == NAMED
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"), bos_token="<|im_start|>",
                                     eos_token="<|im_end|>", chat_template=dict(NAMED))
    assert ours.encode_chat(MESSAGES, tools=tools) == _transformers_ids(theirs, tools)


def test_one_template_stays_one(tiny_llama, tmp_path):
    """A checkpoint with a single template (or an old bundle) keeps it as text; tools render with it."""
    src, _ = tiny_llama
    info = open_checkpoint(src).write_tokenizer(tmp_path / "tok")
    tcfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert isinstance(tcfg["chat_template"], str) and info["chat_template"] == tcfg["chat_template"]
    ours = Tokenizer(tmp_path / "tok", info)
    assert ours.chat_templates == {"default": tcfg["chat_template"]}
    assert ours.template_for(TOOLS) == ours.template_for(None) == tcfg["chat_template"]


def test_a_built_bundle_keeps_every_named_template(tiny_llama, tmp_path):
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import open_bundle

    out = build_bundle(_hf_dir(tiny_llama, tmp_path), tmp_path / "o",
                       BuildOptions(quant="fp32", flavors=("cpu",), max_seq_len=16))
    tok = Tokenizer.from_bundle(open_bundle(out))
    assert tok.chat_templates == NAMED
    assert tok.template_for(TOOLS) == TOOL_USE and tok.template_for(None) == tok.chat_template == DEFAULT
    tok.chat_template = "{{ messages[0].content }}"  # --chat-template on `lineside chat`: it renders every chat
    assert tok.template_for(TOOLS) == "{{ messages[0].content }}"


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_templates_saved_as_jinja_files_render_as_transformers(tiny_llama, tmp_path, tools):
    """transformers' save_pretrained writes several as chat_template.jinja (the default) and
    additional_chat_templates/<name>.jinja; the named ones were dropped."""
    from transformers import AutoTokenizer

    src, _ = tiny_llama
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    theirs = AutoTokenizer.from_pretrained(d)
    theirs.chat_template = {**NAMED, "rag": "{{ bos_token }}RAG"}
    theirs.save_pretrained(d)
    assert (d / "additional_chat_templates" / "tool_use.jinja").is_file()
    info = open_checkpoint(d).write_tokenizer(tmp_path / "tok")
    ours = Tokenizer(tmp_path / "tok", info)
    assert ours.chat_templates == {**NAMED, "rag": "{{ bos_token }}RAG"}
    theirs = AutoTokenizer.from_pretrained(d)
    assert ours.encode_chat(MESSAGES, tools=tools) == _transformers_ids(theirs, tools)


def test_chat_template_jinja_wins_over_tokenizer_config(tiny_llama, tmp_path):
    """transformers renders chat_template.jinja when tokenizer_config.json holds an (older) template too."""
    from transformers import AutoTokenizer

    d = _hf_dir(tiny_llama, tmp_path)
    (d / "chat_template.jinja").write_text(TOOL_USE)
    info = open_checkpoint(d).write_tokenizer(tmp_path / "tok")
    assert AutoTokenizer.from_pretrained(d).chat_template == TOOL_USE
    assert info["chat_template"] == TOOL_USE and Tokenizer(tmp_path / "tok", info).chat_templates == {"default": TOOL_USE}
