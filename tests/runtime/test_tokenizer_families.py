"""Generation ends where the model family's own servers end it: on every id generation_config.json lists, on the
tokenizer's EOS (vLLM's primary stop) and on the end-of-turn token the chat template writes (llama.cpp's EOG),
checked on tiny bundles built from checkpoints that carry each family's tokenizer look-alike."""

from __future__ import annotations

import shutil

import pytest

from tests.tiny_tokenizer import CHATML_TEMPLATE, write_family_tokenizer

QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>"]
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
                   "{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CASES = {
    # Qwen2.5 base: generation_config.json and the tokenizer end on <|endoftext|>; its ChatML template on <|im_end|>
    "qwen2-base": dict(special=QWEN, bos=None, eos="<|endoftext|>", template=CHATML_TEMPLATE,
                       gen_eos=["<|endoftext|>"]),
    # a Llama 3 fine-tune that moved only the tokenizer's EOS to <|eot_id|>
    "llama3-finetune": dict(special=LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA3_TEMPLATE,
                            gen_eos=["<|end_of_text|>", "<|eom_id|>"]),
}


def _checkpoint(tiny_dense, tmp_path, case: str):
    ckpt = tmp_path / case
    shutil.copytree(tiny_dense("qwen2-bias-tied" if case.startswith("qwen") else "llama-gqa"), ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (ckpt / f).unlink(missing_ok=True)
    return ckpt, write_family_tokenizer(ckpt, **CASES[case])


@pytest.mark.parametrize("case", list(CASES))
def test_the_tokenizers_eos_and_the_templates_turn_end_end_generation(tiny_dense, tmp_path, case):
    """Every generation_config.json id stays an end, and the turn end is added: a chat's answer ended on it, where
    the model went on past <|im_end|> / <|eot_id|> until max_tokens (writing the next turn's markup)."""
    from lineside.build.checkpoint import open_checkpoint

    ckpt, ids = _checkpoint(tiny_dense, tmp_path, case)
    info = open_checkpoint(ckpt).write_tokenizer(tmp_path / "tok")
    gen = [ids[t] for t in CASES[case]["gen_eos"]]
    turn_end = ids["<|im_end|>" if case.startswith("qwen") else "<|eot_id|>"]
    assert info["eos_token_ids"] == [*gen, turn_end]


def test_a_chat_answer_ends_on_the_templates_turn_end(tiny_dense, tmp_path):
    """On the built bundle: the model made to write <|im_end|> first (logit_bias) gives an empty answer that ends
    there, as does one made to write generation_config.json's <|endoftext|>."""
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.runtime.generate import Generator
    from lineside.runtime.sampling import SamplingParams
    from tests.conftest import TINY_BUNDLE

    ckpt, ids = _checkpoint(tiny_dense, tmp_path, "qwen2-base")
    options = {**{k: v for k, v in TINY_BUNDLE.items() if k != "variant"}, "max_seq_len": 128}
    bundle = build_bundle(ckpt, tmp_path / "bundle", BuildOptions(**options))
    gen = Generator(bundle)
    prompt = gen.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert prompt[:1] == [ids["<|im_start|>"]]
    bias = SamplingParams(temperature=0.0, logit_bias=((ids["<|im_end|>"], 100.0),))
    assert list(gen.stream(prompt, max_tokens=8, params=bias)) == []
    ended = SamplingParams(temperature=0.0, logit_bias=((ids["<|endoftext|>"], 100.0),))
    assert list(gen.stream(prompt, max_tokens=8, params=ended)) == []
