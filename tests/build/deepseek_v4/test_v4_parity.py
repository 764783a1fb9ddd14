"""DeepSeek-V4 graphs vs transformers' DeepseekV4ForCausalLM in float32: prefill, decode, and both mixed."""

from __future__ import annotations

import numpy as np
import pytest

from tests.build.deepseek_v4.helpers import SEQ_LEN, rel_err

TOL = 1e-4
SCHEDULES = ("a", "b", "c", "d", "e", "f", "g")  # helpers.SCHEDULES: d to g vary what a, b, c keep fixed
CASES = [(s, f) for s in SCHEDULES for f in ("cpu", "trt")]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_ties_at_indexer_cut(v4, schedule):
    """The lightning indexer's top-k must not cut inside a tie, or implementations may legally differ."""
    _, _, gap = v4.ref(schedule)
    assert np.isfinite(gap), "the test sequence never makes the indexer choose (too short for index_topk)"
    assert gap > 1e-4, f"indexer scores tie at the top-k cut (relative gap {gap:.2e}); change the seed"


@pytest.mark.parametrize("schedule,flavor", CASES)
def test_prefill_matches_transformers(v4, schedule, flavor):
    ids, ref, _ = v4.ref(schedule)
    logits, _ = v4.runner(v4.hf_dir(schedule), flavor).prefill(ids)
    err = rel_err(logits[0], ref)
    print(f"prefill {schedule}/{flavor}: max rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("schedule,flavor", CASES)
def test_decode_matches_transformers(v4, schedule, flavor):
    ids, ref, _ = v4.ref(schedule)
    logits, _ = v4.runner(v4.hf_dir(schedule), flavor).decode(ids)
    err = rel_err(logits, ref)
    print(f"decode {schedule}/{flavor}: max rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("split", [5, 13])
def test_prefill_then_decode(v4, split):
    """State handed from a prefill to token-by-token decode (windows open across the hand-off)."""
    ids, ref, _ = v4.ref("a")
    r = v4.runner(v4.hf_dir("a"), "cpu")
    head, st = r.prefill(ids[:split])
    tail, _ = r.decode(ids[split:], st, past=split)
    err = rel_err(np.concatenate([head[0], tail]), ref)
    print(f"prefill {split} + decode: max rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_batched_decode_rows_at_different_lengths(v4, flavor):
    """Two sequences decoded in one batch, each at its own past length, equal their single-row runs."""
    ids, ref, _ = v4.ref("b")
    r = v4.runner(v4.hf_dir("b"), flavor)
    n0, n1 = 11, 19  # prompt lengths: different window phases and compressed counts
    _, s0 = r.prefill(ids[:n0])
    _, s1 = r.prefill(ids[:n1])
    state = {k: np.concatenate([s0[k], s1[k]]) for k in s0}
    rows: list[list[np.ndarray]] = [[], []]
    for t in range(SEQ_LEN - n1):
        tok = np.array([[ids[n0 + t]], [ids[n1 + t]]], np.int64)
        lg, state = r.step(tok, np.array([n0 + t, n1 + t], np.int64), state, np.zeros((2, 1), np.int64))
        rows[0].append(lg[0, 0])
        rows[1].append(lg[1, 0])
    k = SEQ_LEN - n1
    e0 = rel_err(np.stack(rows[0]), ref[n0:n0 + k])
    e1 = rel_err(np.stack(rows[1]), ref[n1:n1 + k])
    print(f"batched decode {flavor}: max rel err {e0:.2e}, {e1:.2e}")
    assert max(e0, e1) < TOL


@pytest.mark.parametrize("flavor", ["cpu", "trt"])
def test_chunked_prefill(v4, flavor):
    """The runtime prefills long prompts in chunks (batch 1, past > 0): chunks of 7 cross every boundary kind."""
    ids, ref, _ = v4.ref("b")
    r = v4.runner(v4.hf_dir("b"), flavor)
    state, past, rows = r.zero_state(), 0, []
    for n in (7, 7, 7, 9):
        lg, state = r.prefill(ids[past:past + n], state, past=past)
        rows.append(lg[0])
        past += n
    err = rel_err(np.concatenate(rows), ref)
    print(f"chunked prefill {flavor}: max rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("schedule,max_seq,flavor", [("a", SEQ_LEN, "cpu"), ("c", 12, "trt")])
def test_prompt_that_fills_a_max_seq_no_compression_rate_divides(v4, schedule, max_seq, flavor):
    """max_seq 30 (a: rates 4 and 8 don't divide it) or 12 (c: below the HCA rate 16): a prompt filling it prefills
    (its windows stay within the compressed slots) and matches transformers."""
    ids, ref, _ = v4.ref(schedule)
    logits, _ = v4.runner(v4.hf_dir(schedule), flavor, max_seq=max_seq).prefill(ids[:max_seq])
    err = rel_err(logits[0], ref[:max_seq])
    print(f"prefill to max_seq {max_seq} {schedule}/{flavor}: max rel err {err:.2e}")
    assert err < TOL
