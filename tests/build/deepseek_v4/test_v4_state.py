"""The V4 decode-state contract the runtime relies on: fixed shapes, replace mode, zeros as a fresh start."""

from __future__ import annotations

from lineside.build.models.deepseek_v4 import parse_config, state_bytes, state_tensors
from lineside.graph_io import StateTensor, StateUpdate


def test_state_layout_is_fixed_shape_replace():
    c = parse_config(dict(vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64))
    states = state_tensors(c, 4096)
    assert all(isinstance(s, StateTensor) and s.update == StateUpdate.REPLACE and s.shape[0] == "batch" for s in states)
    assert all(all(isinstance(d, int) for d in s.shape[1:]) for s in states)  # capturable: no seq-dependent dims
    by = {s.input: s.shape for s in states}
    assert by["past.0.window"] == ["batch", 128, 512]
    assert by["past.0.comp"] == ["batch", 4096 // 128 + 1, 512]  # layers 0-1 are HCA by default
    assert by["past.3.comp"] == ["batch", 4096 // 4 + 1, 512] and by["past.3.idx_keys"] == ["batch", 1025, 128]
    assert by["past.3.comp_kv"] == ["batch", 8, 1024]
    # V4-Flash-sized: ~13 KB of compressed entries per token (fp32) on top of ~25 MB per sequence.
    b = state_bytes(c, 4096)
    assert b["per_token"] == 20 * (512 + 128) * 4 // 4 + 23 * 512 * 4 // 128
    assert 20e6 < b["fixed"] < 30e6


def test_manifest_entry(v4):
    r = v4.runner(v4.hf_dir("a"), "cpu")
    assert r.entry.inputs == ["input_ids", "past_lengths", "logits_positions"]
    assert r.entry.activation_dtype == "float32"
    names = {i.name for i in r.sess.get_inputs()}
    assert names == set(r.entry.inputs) | {s.input for s in r.entry.state}
    outs = [o.name for o in r.sess.get_outputs()]
    assert outs[0] == "logits" and set(outs[1:]) == {s.output for s in r.entry.state}
