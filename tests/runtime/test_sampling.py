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
    """Plain greedy takes the float32 argmax; on a NaN it falls back to the full path (NaN counts as -inf)."""
    x = np.array(row, dtype=np.float32)
    fast = Sampler(SamplingParams()).step(x).token
    full = Sampler(SamplingParams()).step(x, logprobs=0).token  # logprobs: never the shortcut
    assert fast == full


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
