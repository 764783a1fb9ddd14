import numpy as np
import pytest

from lineside.errors import LinesideError
from lineside.runtime.sampling import Sampler, SamplingParams


def test_greedy_and_top_k_one():
    x = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams())(x) == 1
    assert Sampler(SamplingParams(temperature=5.0, top_k=1, seed=3))(x) == 1


@pytest.mark.parametrize("row", [[0.1, 3.0, 3.0, -1.0], [-np.inf, -np.inf, 1.0, np.inf], [np.inf, 2.0, np.inf, 0.0],
                                 [np.nan, 1.0, 5.0, np.nan], [-np.inf, np.nan, -np.inf, -np.inf],
                                 [np.nan, np.nan, np.nan, np.nan]])
def test_greedy_shortcut_picks_what_the_float64_path_picks(row):
    """Plain greedy takes the float32 argmax; on a NaN it falls back to the full path (NaN counts as -inf); a row
    with no number in it is the same error on both."""
    x = np.array(row, dtype=np.float32)

    def pick(**kw) -> int | str:
        try:
            return Sampler(SamplingParams()).step(x, **kw).token
        except LinesideError as e:
            return str(e)

    assert pick() == pick(logprobs=0)  # logprobs: never the shortcut


def test_repetition_penalty_sees_prompt_presence_only_output():
    x = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    # token 0 is only in the prompt: repetition penalty pushes it below token 1 ...
    assert Sampler(SamplingParams(repetition_penalty=1.2))(x, [0, 2], prompt_len=2) == 1
    # ... but presence / frequency penalties ignore the prompt (generated part is empty)
    assert Sampler(SamplingParams(presence_penalty=1.0))(x, [0, 2], prompt_len=2) == 0
    assert Sampler(SamplingParams(frequency_penalty=0.06))(x, [2, 0, 0], prompt_len=1) == 1  # 2 - 2×0.06 < 1.9


def test_top_p_and_min_p_cut_the_tail():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    assert {s(x) for _ in range(300)} == {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.35, seed=0))
    assert {s(x) for _ in range(300)} == {0, 1}


def test_seed_reproduces():
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)

    def draw(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s(x) for _ in range(20)]

    assert draw(7) == draw(7) != draw(8)


@pytest.mark.parametrize("kw,msg", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                    (dict(min_p=2), "min_p"), (dict(top_k=-1), "top_k"),
                                    (dict(repetition_penalty=0), "repetition_penalty")])
def test_bad_params_one_line(kw, msg):
    with pytest.raises(LinesideError, match=msg):
        SamplingParams(**kw).validate()


# ---- vLLM's min_tokens ------------------------------------------------------------------------------
EOS_FIRST = np.array([0.5, 1.0, 4.0, 3.0, 2.0], dtype=np.float32)  # EOS (2) is the argmax, then 3, then 4


@pytest.mark.parametrize("logprobs", [None, 2])
def test_min_tokens_masks_the_stop_tokens_until_enough_are_generated(logprobs):
    """vLLM's MinTokensLogitsProcessor: while fewer than min_tokens tokens are generated (history past the prompt),
    EOS and the stop token ids are -inf; from then on they are sampled as ever. Greedy takes its shortcut only
    when it lands on an allowed token."""
    s = Sampler(SamplingParams(min_tokens=2), stop_ids={2, 3})
    pick = [s.step(EOS_FIRST, [9] + [4] * n, 1, logprobs=logprobs) for n in range(3)]
    assert [r.token for r in pick] == [4, 4, 2]
    if logprobs is not None:  # what the sampler used: the held tokens are not among the alternatives
        assert [t for t, _ in pick[0].logprob.top] == [4, 1] and [t for t, _ in pick[2].logprob.top] == [2, 3]
    assert Sampler(SamplingParams(), stop_ids={2, 3}).step(EOS_FIRST, [9], 1).token == 2  # min_tokens 0: no mask
    assert Sampler(SamplingParams(min_tokens=5)).step(EOS_FIRST, [9], 1).token == 2  # nothing to hold back
    # ids outside the vocabulary (an EOS id past it, a negative one) hold nothing back
    last_first = np.array([0.0, 1.0, 2.0, 3.0, 9.0], dtype=np.float32)
    assert Sampler(SamplingParams(min_tokens=5), stop_ids={-1, 7}).step(last_first, [9], 1, logprobs=0).token == 4


def test_min_tokens_holds_sampled_tokens_and_the_distribution_back():
    s = Sampler(SamplingParams(temperature=1.0, seed=0, min_tokens=1), stop_ids={2})
    assert 2 not in {s.step(EOS_FIRST, [9], 1).token for _ in range(200)}
    d = s.distribution(EOS_FIRST, [9], 1)
    assert d[2] == 0 and d.sum() == pytest.approx(1.0)
    assert s.distribution(EOS_FIRST, [9, 4], 1)[2] > 0.5
    assert s.logprob(EOS_FIRST, 2, [9], 1).logprob == -9999.0  # the floor: impossible here


def test_min_tokens_lets_a_complete_grammar_end():
    """A grammar that allows only a stop token (it is complete) keeps it: vLLM lets the grammar win (its PR #54218)
    rather than sample outside the grammar; a grammar that allows more loses only the stop tokens."""
    s = Sampler(SamplingParams(min_tokens=3), stop_ids={2})
    only_eos = np.array([False, False, True, False, False])
    assert s.step(EOS_FIRST, [9], 1, allowed=only_eos).token == 2
    assert s.step(EOS_FIRST, [9], 1, allowed=only_eos | np.array([1, 0, 0, 0, 0], dtype=bool)).token == 0
    assert s.distribution(EOS_FIRST, [9], 1, allowed=only_eos) == 2


# ---- OpenAI's logit_bias ------------------------------------------------------------------------------
def test_logit_bias_is_added_to_the_logits_before_sampling():
    """OpenAI: "the bias is added to the logits generated by the model prior to sampling"; -100 bans a token,
    +100 makes it the only choice. The distribution sampled and the logprobs reported are softmax(logits + bias)."""
    x = np.array([2.0, 1.0, 0.5, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),)))(x) == 1
    assert Sampler(SamplingParams(logit_bias=((3, 100.0),)))(x) == 3
    bias = ((1, 1.5), (2, -0.25))
    s = Sampler(SamplingParams(temperature=1.0, logit_bias=bias, seed=0))
    want = x.astype(np.float64) + np.array([0.0, 1.5, -0.25, 0.0])
    want = np.exp(want - want.max()) / np.exp(want - want.max()).sum()
    np.testing.assert_allclose(s.distribution(x), want, rtol=1e-12)
    np.testing.assert_allclose([np.exp(s.logprob(x, t).logprob) for t in range(4)], want, rtol=1e-9)
    assert x[1] == 1.0  # the model's row is left as it was


def test_logit_bias_must_be_token_ids_and_finite():
    for bias in (((-1, 1.0),), ((1, float("nan")),), (("1", 1.0),)):
        with pytest.raises(LinesideError, match="logit_bias"):
            SamplingParams(logit_bias=bias).validate()
