"""Seeded random mixes of requests (tests/runtime/consistency_mix.py) on the tiny fp32 bundle: every answer — token
ids, text, finish reason, logprobs — is the one the same request gets alone on a fresh engine, whatever the slots,
chunk, block size, speculation, sessions, cancellations and arrival order of its mix."""

from __future__ import annotations

import random

import pytest

from lineside.bundle import open_bundle
from lineside.runtime.request import Mode, Priority
from tests.runtime.conftest import run
from tests.runtime.consistency_mix import Answer, Ask, check_mix, compare, draw_mix


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_mix_answers_as_alone(tiny_bundle, seed, speculative):
    bundle = open_bundle(tiny_bundle)
    rng = random.Random(1000 * seed + speculative)
    setup, asks, diffs = run(check_mix(bundle, rng, bundle.config.vocab_size, bundle.max_seq_len,
                                       speculative=speculative))
    assert setup.speculative == speculative and len(asks) >= 4
    assert diffs == [], f"{setup}:\n" + "\n".join(diffs)


def test_the_mixes_cover_what_they_claim(tiny_bundle):
    """The draws of the seeds above (and more) hold each kind of request the README's promise is about."""
    bundle = open_bundle(tiny_bundle)
    mixes = [draw_mix(random.Random(s), bundle.config.vocab_size, bundle.max_seq_len) for s in range(40)]
    asks = [a for _, mix in mixes for a in mix]
    assert any(setup.kv_blocks is not None for setup, _ in mixes) and any(setup.speculative for setup, _ in mixes)
    assert any(a.mode == Mode.BATCH for a in asks) and any(a.priority == Priority.HIGH for a in asks)
    assert any(a.repetition_penalty != 1.0 or a.presence_penalty for a in asks)
    assert any(len(a.prompt) == 1 for a in asks) and any(len(a.prompt) >= bundle.max_seq_len - 12 for a in asks)
    # the context's edge: a prompt one token short of it, and answers that fill it (a server's default max_tokens)
    assert any(len(a.prompt) == bundle.max_seq_len - 1 for a in asks)
    assert any(len(a.prompt) + a.max_tokens == bundle.max_seq_len and a.max_tokens > 1 for a in asks)
    assert any(a.max_tokens == 1 for a in asks) and any(a.cancel_after is not None for a in asks)
    assert any(a.stop_from_answer for a in asks) and any(a.logprobs is not None for a in asks)
    assert any(a.session and a.use_session for a in asks) and any(a.session and a.release_session for a in asks)
    assert any(a.session and not a.use_session and not a.release_session for a in asks)
    assert any(a.seed is not None and a.temperature > 0 for a in asks)


def test_compare_sees_a_difference():
    """The check can fail: another token, a longer cancelled stream, or a logprob off by more than the tolerance."""
    a = Ask("r", [5, 6], 3)
    want = Answer("abc", [1, 2, 3], "length", [-0.5, -1.0, -2.0])
    assert compare(a, want, want, 1e-4) is None
    assert compare(a, Answer("abd", [1, 2, 4], "length", []), want, 1e-4)
    assert compare(a, Answer("abc", [1, 2, 3], "length", [-0.5, -1.0, -2.1]), want, 1e-4)
    cancelled = Ask("c", [5, 6], 3, cancel_after=1)
    assert compare(cancelled, Answer("ab", [1, 2], "cancelled", []), want, 1e-4) is None
    assert compare(cancelled, Answer("ax", [1, 9], "cancelled", []), want, 1e-4)
