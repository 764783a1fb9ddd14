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
