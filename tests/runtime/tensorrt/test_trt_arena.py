"""The TensorRT backend's step plan, executed with numpy + onnxruntime on a real trt graph.

The executor below does what the device code does (swap rows, re-layout the pitch, feed the arena's
first rows, write the new K/V at each row's past length); decode through it must equal prefill.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from lineside.errors import BundleError, LinesideError
from lineside.graph_io import StateTensor, StateUpdate
from lineside.runtime.backend import StepBatch
from lineside.runtime.tensorrt.arena import ArenaLayout, Relayout, Swap, chunks, gather_chunk_logits
from lineside.runtime.tensorrt.buffers import plan_buffers
from lineside.runtime.tensorrt.graphs import batch_buckets, length_buckets


class NumpyTrtBackend:
    """Backend protocol with the TensorRT backend's arena semantics, on onnxruntime (CPU)."""

    def __init__(self, bundle, num_slots=3, first=4, step=8, max_chunk=64):
        fl = bundle.flavor("trt")
        self.sess = ort.InferenceSession(str(bundle.file(fl.graph)), providers=["CPUExecutionProvider"])
        self.states = list(fl.state)
        self.inputs = fl.inputs
        self.num_slots, self.max_seq = num_slots, bundle.max_seq_len
        self.layout = ArenaLayout(num_slots, self.max_seq, length_buckets(self.max_seq, first, step),
                                  batch_buckets(num_slots))
        self.max_chunk = max_chunk
        self.arena = {}
        for st in self.states:
            kv, hd = st.shape[1], st.shape[3]
            self.arena[st.input] = np.zeros((num_slots, kv, self.layout.pitch, hd), dtype=np.dtype(st.dtype))
        self.moves = []

    def _apply(self, moves):
        for mv in moves:
            self.moves.append(mv)
            for name, a in self.arena.items():
                if isinstance(mv, Relayout):
                    b = np.full(a.shape[:2] + (mv.new_pitch,) + a.shape[3:], np.nan, dtype=a.dtype)
                    n = min(mv.old_pitch, mv.new_pitch)
                    b[:, :, :n] = a[:, :, :n]
                    self.arena[name] = b
                else:
                    a[[mv.row_a, mv.row_b]] = a[[mv.row_b, mv.row_a]]

    def forward(self, batch):
        past, new = batch.past_lengths.astype(np.int64), batch.new_lengths.astype(np.int64)
        totals = past + new
        self._apply(self.layout.plan_moves(list(batch.slots), totals))
        parts = []
        for ch in chunks(batch.input_ids, new, batch.logits_positions, self.max_chunk):
            st = self.layout.step_inputs(ch.input_ids, past + np.minimum(ch.offset, new), ch.new_lengths,
                                         ch.logits_positions)
            feed = {"input_ids": st.input_ids, "position_ids": st.position_ids,
                    "attention_mask": st.attention_mask, "logits_positions": st.logits_positions}
            feed = {k: v for k, v in feed.items() if k in self.inputs}
            for s in self.states:
                # the engine sees the arena's first Bb rows at the current pitch; unwritten slots hold NaN
                # in this emulation, so any read of a masked-off position would poison the logits
                feed[s.input] = np.nan_to_num(self.arena[s.input][: st.batch_bucket], nan=1e4)
            outs = dict(zip([o.name for o in self.sess.get_outputs()], self.sess.run(None, feed), strict=True))
            for s in self.states:
                a, o = self.arena[s.input], outs[s.output]
                for b in range(st.batch_bucket):
                    if st.write_pos[b] >= 0:
                        p, n = st.write_pos[b], st.new_lengths[b]
                        a[b, :, p:p + n] = o[b, :, :n]
            parts.append((ch, outs["logits"][: st.rows]))
        self.layout.commit(list(batch.slots), totals)
        return gather_chunk_logits(parts, batch.logits_positions.shape[1])

    def reset_slot(self, slot):
        self.layout.reset(slot)


IDS = [1, 17, 42, 5, 99, 250, 3, 77, 8, 150, 61, 12, 200, 33, 7, 9, 11, 13, 21]


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_decode_through_arena_equals_prefill(trt_bundle):
    be = NumpyTrtBackend(trt_bundle("fp16"))
    ref = be.forward(StepBatch.single(0, IDS, 0, all_logits=True))[0]
    be.reset_slot(0)
    be.reset_slot(1)
    dec = np.stack([be.forward(StepBatch.single(1, [t], i))[0, 0] for i, t in enumerate(IDS)])
    assert rel(dec, ref) < 1e-4
    assert any(isinstance(m, Relayout) for m in be.moves)  # pitch grew 4 → 8 → 16 → 24
    assert any(isinstance(m, Swap) for m in be.moves)  # slot 1 moved to row 0


def test_batched_decode_with_different_lengths_and_padding(trt_bundle):
    be = NumpyTrtBackend(trt_bundle("fp16"), num_slots=3, max_chunk=5)  # prefill is chunked by 5
    a, b = IDS[:11], IDS[3:9]
    ra = be.forward(StepBatch.single(2, a, 0, all_logits=True))[0]
    rb = be.forward(StepBatch.single(0, b, 0, all_logits=True))[0]
    # reference: each sequence alone, one more token
    solo = NumpyTrtBackend(trt_bundle("fp16"))
    ref_a = solo.forward(StepBatch.single(0, a + [5], 0, all_logits=True))[0][-1]
    ref_b = solo.forward(StepBatch.single(1, b + [6], 0, all_logits=True))[0][-1]
    # batch of 2 → bucket 2 is exact; then a batch of 3 slots pads nothing, batch of 2 reorders rows
    step = StepBatch(slots=[0, 2], input_ids=np.array([[6], [5]]), past_lengths=np.array([len(b), len(a)]),
                     new_lengths=np.array([1, 1]), logits_positions=np.zeros((2, 1), dtype=np.int64))
    out = be.forward(step)
    assert rel(out[0, 0], ref_b) < 1e-4 and rel(out[1, 0], ref_a) < 1e-4
    assert ra.shape[0] == len(a) and rb.shape[0] == len(b)


def test_padding_rows_are_not_written(trt_bundle):
    be = NumpyTrtBackend(trt_bundle("fp16"), num_slots=4)
    be.forward(StepBatch.single(3, IDS[:5], 0, all_logits=True))
    step = StepBatch(slots=[0, 1, 2], input_ids=np.array([[4], [5], [6]]), past_lengths=np.zeros(3, dtype=np.int64),
                     new_lengths=np.ones(3, dtype=np.int64), logits_positions=np.zeros((3, 1), dtype=np.int64))
    plan_rows = {s: None for s in range(4)}
    row3 = None
    before = None

    # snapshot slot 3's cache right after the moves of the padded step (it becomes padding row 3)
    orig_apply = be._apply

    def spy(moves):
        nonlocal row3, before
        orig_apply(moves)
        row3 = be.layout.phys_of[3]
        before = {k: v[row3, :, :5].copy() for k, v in be.arena.items()}

    be._apply = spy
    be.forward(step)
    assert row3 == 3 and plan_rows is not None  # bucket 4 for 3 rows: row 3 is padding
    for k, v in be.arena.items():
        assert np.array_equal(v[3, :, :5], before[k])
    # and slot 3 still continues correctly
    ref = NumpyTrtBackend(trt_bundle("fp16")).forward(StepBatch.single(0, IDS[:6], 0, all_logits=True))[0][-1]
    be._apply = orig_apply
    got = be.forward(StepBatch.single(3, [IDS[5]], 5))[0, 0]
    assert rel(got, ref) < 1e-4
    lay = ArenaLayout(8, 64, length_buckets(64, 4, 8), batch_buckets(8))
    st = lay.step_inputs(np.ones((3, 1), dtype=np.int64), np.array([2, 0, 5]), np.array([1, 1, 1]),
                         np.zeros((3, 1), dtype=np.int64))
    assert st.batch_bucket == 4 and st.write_pos.tolist() == [2, 0, 5, -1]
    assert st.attention_mask[3].sum() == 1  # padding row attends to one position only


def test_step_inputs_mask_and_positions():
    lay = ArenaLayout(4, 64, length_buckets(64, 4, 8), batch_buckets(4))
    lay.plan_moves([0, 1], np.array([7, 3]))
    assert lay.pitch == 8
    st = lay.step_inputs(np.array([[5, 6], [7, 0]]), np.array([5, 2]), np.array([2, 1]),
                         np.array([[1], [0]]))
    assert st.attention_mask.shape == (2, 10)
    assert st.attention_mask[0].tolist() == [1] * 5 + [0] * 3 + [1, 1]
    assert st.attention_mask[1].tolist() == [1, 1] + [0] * 6 + [1, 0]
    assert st.position_ids.tolist() == [[5, 6], [2, 3]]
    assert st.key == (2, 8) and not st.is_decode


def test_plan_moves_errors_and_shrink():
    lay = ArenaLayout(2, 32, length_buckets(32, 4, 8), batch_buckets(2))
    with pytest.raises(LinesideError, match="max_seq_len"):
        lay.plan_moves([0], np.array([33]))
    with pytest.raises(LinesideError, match="twice"):
        lay.plan_moves([0, 0], np.array([1, 1]))
    with pytest.raises(LinesideError, match="out of range"):
        lay.plan_moves([5], np.array([1]))
    lay.plan_moves([0], np.array([30]))
    lay.commit([0], np.array([30]))
    assert lay.pitch == 32
    lay.reset(0)
    moves = lay.plan_moves([1], np.array([3]))
    assert Relayout(32, 4) in moves and lay.pitch == 4


def test_chunks_cover_all_logits():
    ids = np.arange(20).reshape(2, 10)
    lp = np.array([[0, 4, 9], [2, 3, 7]])
    parts = chunks(ids, np.array([10, 8]), lp, 4)
    assert [c.offset for c in parts] == [0, 4, 8]
    fake = [(c, np.where(c.source[..., None] >= 0, (c.logits_positions + c.offset)[..., None], -1)
             .astype(np.float32)) for c in parts]
    got = gather_chunk_logits(fake, 3)[..., 0]
    assert got.tolist() == lp.tolist()


def test_state_update_kinds_supported(trt_bundle):
    """A dense trt graph's KV is append state whose sequence axis is the one ArenaLayout pitches; the TensorRT
    plan lays out append (rows grow with the pitch), replace and prefix (one fixed row) state, and refuses the cpu
    graph's in-place cache in one line. A new kind of state update fails here until TensorRT is told of it."""
    assert set(StateUpdate) == {StateUpdate.APPEND, StateUpdate.REPLACE, StateUpdate.PREFIX, StateUpdate.INPLACE}
    b = trt_bundle("fp16")
    states = list(b.flavor("trt").state)
    assert states and {st.update for st in states} == {StateUpdate.APPEND}
    assert all(st.shape[0] == "batch" and st.shape[st.seq_axis] == "past_seq" for st in states)

    def plan(sts):
        return plan_buffers(sts, b.config, num_slots=2, max_seq=64, max_prefill=8, max_logits=1, vocab=300,
                            input_names=[])

    kv = plan(states).states
    assert [lay.update for lay in kv] == [StateUpdate.APPEND] * len(states)
    assert all(lay.row_bytes(16) == 2 * lay.row_bytes(8) > 0 for lay in kv)
    fixed = plan([StateTensor("win", "win_out", ["batch", 8, "head_dim"], update=StateUpdate.REPLACE)]).states[0]
    assert fixed.update == StateUpdate.REPLACE
    assert fixed.row_bytes(8) == fixed.row_bytes(64) == 8 * b.config.head_dim * 4
    sink = plan([StateTensor("past_sink.0", "present_sink.0", ["batch", 4, 1, 16], dtype="float16",
                             update=StateUpdate.PREFIX)]).states[0]
    assert sink.update == StateUpdate.PREFIX and sink.row_bytes(8) == sink.row_bytes(64) == 4 * 16 * 2
    with pytest.raises(BundleError, match="a prefix state must have a fixed shape"):
        plan([StateTensor("s", "s_out", ["batch", "past_seq", 16], update=StateUpdate.PREFIX)])
    with pytest.raises(BundleError, match="only append/replace/prefix") as e:
        plan([StateTensor("past_key.0", "present_key.0", ["batch", 2, "max_seq", 16], update=StateUpdate.INPLACE)])
    assert "\n" not in str(e.value)
