from lineside.runtime.stop import StopMatcher


def feed_all(m: StopMatcher, pieces: list[str]) -> list[str]:
    return [m.feed(p) for p in pieces]


def test_stop_split_across_pieces_is_never_emitted():
    m = StopMatcher(["###"])
    out = feed_all(m, ["Hello #", "#", "# tail"])
    assert out == ["Hello ", "", ""]
    assert m.stopped and m.flush() == ""


def test_partial_prefix_released_when_it_stops_matching():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == "abc"
    assert m.feed("N") == ""
    assert m.feed("x") == "ENx"
    assert not m.stopped
    assert m.feed("EN") == ""
    assert m.flush() == "EN"  # generation ended without the stop string: held text is output


def test_earliest_of_several_stop_strings_wins():
    m = StopMatcher(["world", "o w"])
    assert m.feed("hello world") == "hell"
    assert m.stopped
    assert m.feed("more") == ""


def test_overlapping_prefixes_hold_the_longest():
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == "x"
    assert m.feed("a") == "a"  # "aaa": only the last "aa" can still start "aab"
    assert m.feed("b") == ""
    assert m.stopped


def test_no_stop_strings_pass_through():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


def test_unarmed_text_cannot_end_a_stop_string():
    """vLLM's min_tokens: a stop string that ends in the first min_tokens tokens' text is output; one that ends
    later stops, even when it began in that text (dropped from there on)."""
    m = StopMatcher(["ab"])
    assert m.feed("xab", armed=False) == "xab" and not m.stopped  # whole in unarmed text: kept
    assert m.feed("a", armed=False) == "" and m.feed("b") == "" and m.stopped  # straddles: stops at its start
    m = StopMatcher(["ab", "abc"])
    assert m.feed("ab", armed=False) == "" and m.feed("x") == "abx" and not m.stopped  # "ab" ended unarmed
    m = StopMatcher(["ab", "abc"])
    assert m.feed("ab", armed=False) == "" and m.feed("c") == "" and m.stopped


def test_where_a_stop_cuts_does_not_depend_on_how_the_text_arrives():
    """Generation stops as soon as a stop string is complete; one token's text may complete several at once. The
    cut was the earliest *start* among those a piece completed, so a stop string that began earlier but ended
    later won only when its end came in the same token: "x\\nUser: hi" with stops ["\\nUser:", "User"] gave "x" fed
    whole and "x\\n" fed a character at a time. Whatever the pieces, the answer is the one a character at a time
    gives (the stop that ends first; of those ending together, the one that starts first), and it names it."""
    cases = [("x\nUser: hi", ["\nUser:", "User"], "x\n", "User"), ("abcd", ["abcd", "b"], "a", "b"),
             ("abcd", ["b", "abcd"], "a", "b"), ("abc", ["c", "bc"], "a", "bc"), ("a\n\nb", ["\n\n", "\n"], "a", "\n"),
             ("日本語です", ["語です", "本語"], "日", "本語"), ("ok 👍🏽 yes", ["🏽 y", "👍"], "ok ", "👍")]
    for text, stops, expect, which in cases:
        for size in (1, 2, 3, len(text)):
            m = StopMatcher(stops)
            out = "".join(m.feed(text[i:i + size]) for i in range(0, len(text), size))
            assert (out, m.stopped, m.hit) == (expect, True, which), (text, stops, size)


def merged_byte_level(tmp_path):
    """A byte-level BPE vocabulary whose one merge puts a space and an emoji's first byte in one token (as
    SmolLM2's "Ġð"): a token whose text is whole up to a character it leaves unfinished."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from lineside.runtime.tokenizer import Tokenizer

    vocab = {"<s>": 0, "</s>": 1, **{ch: 2 + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    vocab["Ġð"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "ð")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(tmp_path, {"bos_token_id": 0, "eos_token_ids": [1]}), tok


def events(tok, generated, **request):
    from lineside.runtime.request import GenerationRequest, RequestHandle
    from lineside.runtime.sequence import Sequence

    req = GenerationRequest(prompt_ids=tok.encode("hi", add_special=False), **{"max_tokens": 16, **request})
    seq = Sequence(RequestHandle(req), tok, {1}, 256)
    out = []
    for i in generated:
        out.append(seq.on_token(i, 0.0))
        if out[-1].finish_reason is not None:
            break
    return out


def test_stop_reason_names_the_stop_string_or_token_that_ended_it(tmp_path):
    """vLLM's stop_reason: the stop string, or the request's stop token id; None for the model's EOS and length."""
    tok, _ = merged_byte_level(tmp_path)
    ids = tok.encode("ab. cd", add_special=False)
    last = events(tok, ids, stop=[". c", "d"])[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", ". c")
    dot = tok.encode(".", add_special=False)[0]
    evs = events(tok, ids, stop_token_ids=[dot])
    assert "".join(e.text for e in evs) == "ab" and (evs[-1].finish_reason, evs[-1].stop_reason) == ("stop", dot)
    assert [(e.finish_reason, e.stop_reason) for e in events(tok, [*ids[:2], 1])][-1] == ("stop", None)
    assert [(e.finish_reason, e.stop_reason) for e in events(tok, [*ids[:2], 1], stop_token_ids=[1])][-1] == \
        ("stop", None)  # the EOS sent as a stop token too is still the model's EOS, as vLLM checks it first
    assert [(e.finish_reason, e.stop_reason) for e in events(tok, ids, max_tokens=3)][-1] == ("length", None)


def test_text_released_at_the_end_is_still_checked_for_stop_strings(tmp_path):
    """The last token " \\xf0" (a space, then an emoji's first byte) is held back whole while the emoji may go on;
    when the answer ends there (length, EOS) the space is released and cut by stop [" "], but the answer said
    finish_reason length. The space is text the tokenizers decode has ("ab \ufffd"), so the answer stopped there."""
    tok, raw = merged_byte_level(tmp_path)
    ids = tok.encode("ab 😀", add_special=False)
    assert raw.id_to_token(ids[2]) == "Ġð" and tok.decode(ids[:3]) == "ab \ufffd"
    evs = events(tok, ids[:3], max_tokens=3, stop=[" "])
    assert ("".join(e.text for e in evs), evs[-1].finish_reason, evs[-1].stop_reason) == ("ab", "stop", " ")
    evs = events(tok, [*ids[:3], 1], stop=[" "])
    assert ("".join(e.text for e in evs), evs[-1].finish_reason, evs[-1].stop_reason) == ("ab", "stop", " ")
    evs = events(tok, ids[:3], max_tokens=3)
    assert ("".join(e.text for e in evs), evs[-1].finish_reason) == ("ab ", "length")  # no stop: the space stays


def test_include_stop_str_cuts_after_the_stop_string():
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it (nothing after it), the
    same stop winning as without it, however the pieces split the text; a stop that began in unarmed text counts."""
    cases = [("x\nUser: hi", ["\nUser:", "User"], "x\nUser", "User"), ("abcd", ["abcd", "b"], "ab", "b"),
             ("abc", ["c", "bc"], "abc", "bc"), ("Hello ### tail", ["###"], "Hello ###", "###"),
             ("ok 👍🏽 yes", ["🏽 y", "👍"], "ok 👍", "👍")]
    for text, stops, expect, which in cases:
        for size in (1, 2, 3, len(text)):
            m = StopMatcher(stops, include=True)
            out = "".join(m.feed(text[i:i + size]) for i in range(0, len(text), size)) + m.flush()
            assert (out, m.stopped, m.hit) == (expect, True, which), (text, stops, size)
    m = StopMatcher(["ab"], include=True)
    assert m.feed("xa", armed=False) == "xa" and m.feed("b") == "b" and m.stopped


def test_include_stop_str_holds_nothing_back():
    """Under include_stop_str_in_output text that may begin a stop string is in the answer whatever follows, so each
    piece goes out as it comes (as vLLM's detokenizer sends it, no stop buffer); the look-back still finds a stop
    string spanning pieces and cuts after it, and the text is the one held back text would have given."""
    cases = [(["Hello #", "#", "# tail"], ["###"], ["Hello #", "#", "#"]),
             (["a", "b", "c", "d"], ["abcd", "b"], ["a", "b"]),
             (["x\nUs", "er: hi"], ["\nUser:", "User"], ["x\nUs", "er"]),
             (["abcE", "N", "x", "EN"], ["END"], ["abcE", "N", "x", "EN"]),  # never completes: all sent at once
             (["日本", "語で", "す"], ["語です"], ["日本", "語で", "す"])]
    for pieces, stops, sent in cases:
        m = StopMatcher(stops, include=True)
        out = [m.feed(p) for p in pieces]
        assert out[:len(sent)] == sent and m.flush() == "", (pieces, stops)
        held = StopMatcher(stops)
        plain = "".join(held.feed(p) for p in pieces) + held.flush()
        assert "".join(out) == (plain + m.hit if m.stopped else plain)


def test_include_stop_str_keeps_the_stop_text_or_token(tmp_path):
    """Through a sequence: the stop string stays in the answer (stop_reason still names it), and a stop_token_ids
    token's text is kept, as vLLM decodes the stop token under include_stop_str_in_output; the model's EOS (a
    skipped special token) adds nothing."""
    tok, _ = merged_byte_level(tmp_path)
    ids = tok.encode("ab. cd", add_special=False)
    evs = events(tok, ids, stop=[". c", "d"], include_stop_str=True)
    assert ("".join(e.text for e in evs), evs[-1].finish_reason, evs[-1].stop_reason) == ("ab. c", "stop", ". c")
    assert evs[-1].completion_tokens == 5  # the token that completed the stop counts
    dot = tok.encode(".", add_special=False)[0]
    evs = events(tok, ids, stop_token_ids=[dot], include_stop_str=True)
    assert ("".join(e.text for e in evs), evs[-1].stop_reason) == ("ab.", dot)
    evs = events(tok, [*ids[:2], 1], include_stop_str=True)
    assert ("".join(e.text for e in evs), evs[-1].finish_reason, evs[-1].stop_reason) == ("ab", "stop", None)
    evs = events(tok, ids, stop_token_ids=[dot], stop=["b."], include_stop_str=True)  # the token completes a stop
    assert ("".join(e.text for e in evs), evs[-1].stop_reason) == ("ab.", "b.")


def test_special_tokens_kept_in_the_text_when_not_skipped(tmp_path):
    """vLLM's skip_special_tokens false: a special token's text is in the answer, where a stop string can match it;
    the stop token that ends the answer (the model's EOS) still adds its text only under include_stop_str."""
    tok, _ = merged_byte_level(tmp_path)
    ab, c = tok.encode("ab", add_special=False), tok.encode("c", add_special=False)
    text = lambda evs: "".join(e.text for e in evs)  # noqa: E731
    assert text(events(tok, [*ab, 0, *c, 1])) == "abc"
    assert text(events(tok, [*ab, 0, *c, 1], skip_special=False)) == "ab<s>c"
    assert text(events(tok, [*ab, 0, *c, 1], skip_special=False, include_stop_str=True)) == "ab<s>c</s>"
    evs = events(tok, [*ab, 0, *c, 1], skip_special=False, stop=["<s>"])
    assert (text(evs), evs[-1].stop_reason) == ("ab", "<s>")
