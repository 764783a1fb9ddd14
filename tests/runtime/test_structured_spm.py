"""Grammar-constrained decoding on SentencePiece vocabularies (``▁`` word starts): with byte fallback (Llama 2 /
Mistral, ``<0xE2>`` byte tokens), with transformers' ``Metaspace`` decoder, and without byte fallback. Random
allowed paths through the mask, decoded as the server decodes them (after a prompt), must match the constraint;
EOS is allowed exactly when the output is complete."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from lineside.errors import LinesideError
from lineside.runtime.detokenize import IncrementalDetokenizer
from lineside.runtime.grammar_vocab import readable_tokenizer_json
from lineside.runtime.sampling import Sampler, SamplingParams
from lineside.runtime.structured import Constraint, ConstraintError, GrammarCompiler
from lineside.runtime.tokenizer import Tokenizer

SPACE = "\u2581"
EOS = 2
VOCAB = 400  # the model's rows: more than any tokenizer here (padding ids past it)
PIECES = [*"abcdefghijklmnopqrstuvwxyz0123456789{}[]\":,.-_", SPACE, f"{SPACE}{{", f"{SPACE}\"", "\":", f"{SPACE}the",
          "name", f"{SPACE}ok", "é", f"{SPACE}é", "ok"]


def _spm_dir(tmp_path, family: str):
    """A SentencePiece-style BPE saved as tokenizer.json: ``bytes`` (Llama 2: ``<0xNN>`` pieces, a Sequence decoder
    with ByteFallback), ``metaspace`` (the same vocabulary with the Metaspace decoder of transformers' generic SPM
    conversion) or ``no_bytes`` (no byte pieces: Replace/Fuse/Strip, as an SPM model trained without them)."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HF

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    if family != "no_bytes":
        vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for p in PIECES:
        vocab.setdefault(p, len(vocab))
    tok = HF(models.BPE(vocab=vocab, merges=[], byte_fallback=family != "no_bytes", unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    if family == "metaspace":
        tok.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    else:
        steps = [decoders.Replace(SPACE, " "), *([decoders.ByteFallback()] if family == "bytes" else []),
                 decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)]
        tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>"]])
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path, {"bos_token_id": 1, "eos_token_ids": [EOS]})
    return tokenizer, GrammarCompiler.for_tokenizer(tokenizer, VOCAB, [EOS])


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"enum": ["é", "a b", "ok"]},
                                                    "maxItems": 3}},
          "required": ["name", "tags"]}
# every character here has a piece in all three vocabularies (a byte-less one cannot spell "!" or "ö")
CASES = {
    "schema": (Constraint.json_schema(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
    "regex": (Constraint.regex(r"(é|ok)[a-z ]{1,4}\."), lambda t: re.fullmatch(r"(é|ok)[a-z ]{1,4}\.", t)),
    "choice": (Constraint.choice(["héllo", "a b", "ok the"]), lambda t: t in ("héllo", "a b", "ok the")),
    "lark": (Constraint.grammar('start: "ok " W\nW: /[a-zé ]{1,5}/'), lambda t: re.fullmatch("ok [a-zé ]{1,5}", t)),
}


def _walk(tok, comp, c: Constraint, seed: int) -> tuple[str, bool]:
    """Random logits through the sampler under the mask; the text as the server streams it after a prompt, and
    whether the walk ended on EOS or a finished grammar."""
    rng = np.random.default_rng(seed)
    m = comp.matcher(c)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    det = IncrementalDetokenizer(tok, prompt_ids=tok.encode("[INST] go [/INST]", add_special=True))
    text = ""
    for _ in range(120):
        allowed = m.allowed()
        assert allowed[EOS] == m.accepting  # EOS exactly when the output is complete
        assert not allowed[comp.tokenizer_size:].any()  # padding ids past the tokenizer
        logits = rng.standard_normal(VOCAB).astype(np.float32) * 3
        logits[3:259] += 2.0  # byte pieces (where there are) and the first pieces: multi-byte characters get built
        logits[EOS] += 2.0
        t = sampler.step(logits, allowed=allowed).token
        assert m.accept(t), m.error
        if t == EOS:
            return text + det.flush(), True
        text += det.add(t)
        if m.finished:
            return text + det.flush(), True
    return text + det.flush(), False


@pytest.mark.parametrize("family", ["bytes", "metaspace", "no_bytes"])
@pytest.mark.parametrize("case", list(CASES))
def test_random_allowed_paths_decode_to_valid_outputs(tmp_path, family, case):
    tok, comp = _spm_dir(tmp_path, family)
    c, valid = CASES[case]
    ended = 0
    for seed in range(12):
        text, done = _walk(tok, comp, c, seed)
        ended += done
        if done:
            assert valid(text), (family, case, seed, text)
    assert ended >= 6


def test_a_non_ascii_value_is_written_through_the_byte_pieces_that_spell_it(tmp_path):
    tok, comp = _spm_dir(tmp_path, "bytes")
    m = comp.matcher(Constraint.choice(["€uro"]))
    euro = tok.encode("€uro", add_special=False)[1:]  # without the normalizer's ▁ in front
    assert [tok.id_to_token(i) for i in euro[:3]] == ["<0xE2>", "<0x82>", "<0xAC>"]
    for i, t in enumerate(euro[:3]):
        allowed = m.allowed()
        assert allowed[t] and allowed.sum() == 1, i  # the only way on is the next byte of the character
        assert m.accept(t)
    assert all(m.accept(t) for t in euro[3:]) and m.allowed()[EOS] and tok.decode(euro) == "€uro"


def test_piece_named_like_a_byte_is_never_allowed_where_the_decoder_writes_it_literally():
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "</s>": 1, "<0x41>": 2, "a": 3, SPACE: 4}
    tok = HF(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    spec = json.loads(readable_tokenizer_json(tok.to_str()))
    assert spec["decoder"]["decoders"][1] == {"type": "ByteFallback"}
    assert {"<0x41>"} == {t["content"] for t in spec["added_tokens"] if t["special"]} - {"<unk>", "</s>"}


def test_a_decoder_llguidance_reads_is_left_alone(tmp_path):
    from tests.tiny_tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp_path, 300)
    text = (tmp_path / "tokenizer.json").read_text()
    assert readable_tokenizer_json(text) == text


def test_a_tokenizer_the_grammar_engine_cannot_read_is_one_line(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models

    tok = HF(models.WordPiece(vocab={"[UNK]": 0, "</s>": 1, "a": 2, "##b": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(LinesideError, match=r"^structured outputs and logprobs cannot read this model's tokenizer "
                                            r"\(can't determine decoder type[^\n]*\); they need a byte-level BPE"):
        GrammarCompiler(tok.to_str(), 8, [1])


@pytest.mark.parametrize("make", [lambda: Constraint.regex("!+"), lambda: Constraint.choice(["€uro"])])
def test_a_grammar_starting_with_text_the_vocabulary_cannot_spell_is_refused_at_compile(tmp_path, make):
    tok, comp = _spm_dir(tmp_path, "no_bytes")  # no piece for "!", "€" or "ö", and no byte pieces
    c = make()
    with pytest.raises(ConstraintError, match=rf"^{c.param}: this .* starts with text this model's vocabulary has "
                                              r"no tokens for \(a character with no piece and no byte fallback\)"):
        comp.compile(c)
    comp.compile(Constraint.regex("(ok)?"))  # a grammar it can write, or end at once, still compiles


def _sequence(tok, comp, c: Constraint, max_tokens: int = 40):
    from lineside.runtime.request import GenerationRequest, RequestHandle
    from lineside.runtime.sequence import Sequence

    req = GenerationRequest(prompt_ids=tok.encode("[INST] go [/INST]", add_special=True), max_tokens=max_tokens,
                            constraint=c)
    return Sequence(RequestHandle(req), tok, {EOS}, 256, matcher=comp.matcher(c))


def _only_allowed(seq) -> int:
    ids = np.flatnonzero(seq.matcher.allowed())
    return int(ids[0])


@pytest.mark.parametrize("make, needed", [
    (lambda: Constraint.regex("(o|k)!"), "'!' next"),  # not forced from the start: compiles, then a dead end
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"enum": ["x!", "y!"]}},
                                     "required": ["a"]}), "'!' next"),
])
def test_a_grammar_at_text_the_vocabulary_cannot_spell_ends_as_the_clients_error(tmp_path, make, needed):
    """Mid-output, the mask holds only <unk> (the tokenizer's encoding of "!"), which the grammar rejects: the request
    ends with one line naming its field, as the client's error (400 grammar_dead_end), not the engine's."""
    from lineside.runtime.request import FinishReason

    tok, comp = _spm_dir(tmp_path, "no_bytes")
    c = make()
    comp.compile(c)
    seq = _sequence(tok, comp, c)
    for _ in range(20):
        ev = seq.on_token(_only_allowed(seq), 0.0)
        if ev.finish_reason is not None:
            break
    assert ev.finish_reason == FinishReason.ERROR and ev.client_error and ev.error_code == "grammar_dead_end", ev
    assert ev.error.startswith(f"{c.param}: this ") and "cannot be completed with this model's vocabulary" in ev.error
    assert needed in ev.error and "\n" not in ev.error, ev.error


@pytest.mark.parametrize("make", [
    lambda: Constraint.regex("(o|k)!"),
    lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"enum": ["x!", "y!"]}}, "required": ["a"]},
                                   param="tools[0].function.parameters"),
])
def test_a_dead_end_event_names_the_field_that_carried_the_grammar(tmp_path, make):
    """The mid-generation 400 names its field in the error's ``param``, as the compile-time 400s do."""
    tok, comp = _spm_dir(tmp_path, "no_bytes")
    c = make()
    seq = _sequence(tok, comp, c)
    for _ in range(20):
        ev = seq.on_token(_only_allowed(seq), 0.0)
        if ev.finish_reason is not None:
            break
    assert ev.client_error and ev.error_param == c.param, ev


def test_a_dead_end_is_answered_400_grammar_dead_end():
    from lineside.runtime.request import FinishReason, TokenEvent
    from lineside.server.responses import failure

    ev = TokenEvent("", [], FinishReason.ERROR, 3, 2, error="guided_regex: cannot be completed", client_error=True,
                    error_code="grammar_dead_end", error_param="guided_regex")
    err = failure(None, ev)  # type: ignore[arg-type] (a client error reads nothing of the server's state)
    assert (err.status, err.code, err.type, err.param) == (400, "grammar_dead_end", "invalid_request_error",
                                                           "guided_regex")


@pytest.mark.parametrize("speculative", [False, True])
def test_the_generator_ends_at_a_dead_end_with_the_servers_one_line(tmp_path, tiny_bundles, speculative):
    """The offline path (Generator, `lineside generate`'s) says what the server's 400 says, as a ConstraintError
    naming the field, not the engine's "grammar rejected token N" (plain and speculative loops alike)."""
    from lineside.runtime.generate import Generator
    from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig

    spec = SpeculativeConfig(SpecMethod.NGRAM, 2, max_rows=4) if speculative else None
    gen = Generator(tiny_bundles(quant="w4a16", accuracy_level=0, group_size=32, max_seq_len=256), threads=2,
                    speculative=spec)
    tok, _ = _spm_dir(tmp_path, "no_bytes")
    comp = GrammarCompiler.for_tokenizer(tok, gen.backend.vocab_size, [EOS])
    c = Constraint.regex("(o|k)!")
    with pytest.raises(ConstraintError) as e:
        list(gen.stream([1, 5, 6], 10, matcher=comp.matcher(c)))
    assert str(e.value).startswith("guided_regex: this regular expression cannot be completed with this model's vocabulary"), e.value
    assert "'!' next" in str(e.value) and "\n" not in str(e.value) and e.value.param == "guided_regex"


@pytest.mark.parametrize("make", [
    lambda: Constraint.regex("ok!"),
    lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"const": "x!"}}, "required": ["a"]}),
    lambda: Constraint.grammar('start: "ok" "!"'),
])
def test_forced_text_the_vocabulary_cannot_spell_is_refused_at_compile(tmp_path, make):
    """What every output must write is known before generating: its dead end is a 400 naming the field."""
    tok, comp = _spm_dir(tmp_path, "no_bytes")
    c = make()
    with pytest.raises(ConstraintError, match=rf"^{re.escape(c.param)}: this .* cannot be completed with this model's "
                                              r"vocabulary: it needs text no token spells \('!' next\)"):
        comp.compile(c)
    _, with_bytes = _spm_dir(tmp_path, "bytes")
    with_bytes.compile(c)  # byte pieces spell it
