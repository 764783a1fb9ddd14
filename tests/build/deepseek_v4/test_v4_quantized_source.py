"""Official-named FP8 (128×128 block scales) + MXFP4-expert checkpoints build to the dequantized reference."""

from __future__ import annotations

import numpy as np
import pytest

from tests.build.deepseek_v4.helpers import dequantized_reference_model, reference, rel_err

CASES = [("a", "ue8m0", "cpu"), ("b", "float", "trt")]


@pytest.mark.parametrize("schedule,fp8,flavor", CASES)
def test_fp8_mxfp4_official_checkpoint(v4, schedule, fp8, flavor):
    ids, float_ref, _ = v4.ref(schedule)
    d = v4.official_dir(schedule, fp8, True)
    ref, gap = reference(dequantized_reference_model(d, schedule), ids)
    assert gap > 1e-4, f"indexer tie at the top-k cut in the dequantized model (gap {gap:.2e})"
    r = v4.runner(d, flavor)
    pre, _ = r.prefill(ids)
    dec, _ = r.decode(ids)
    e_pre, e_dec = rel_err(pre[0], ref), rel_err(dec, ref)
    drift = rel_err(ref, float_ref)
    print(f"official {fp8}+mxfp4 {schedule}/{flavor}: prefill {e_pre:.2e}, decode {e_dec:.2e}; "
          f"dequantized vs float reference {drift:.2e}")
    assert e_pre < 1e-4 and e_dec < 1e-4
    assert 0 < drift < 1.0  # the source format really is lossy (MXFP4 on tiny random experts: ~0.4)


def test_source_dtypes_are_really_shipped(v4):
    """The official copy holds F8_E4M3 linears with ue8m0 scales and packed MXFP4 experts, as DeepSeek ships."""
    from lineside.build.checkpoint import open_checkpoint

    ck = open_checkpoint(v4.official_dir("a", "ue8m0", True))
    try:
        assert str(ck.get_raw("layers.1.attn.wq_a.weight").dtype) == "float8_e4m3fn"
        assert str(ck.get_raw("layers.1.attn.wq_a.scale").dtype) == "float8_e8m0fnu"
        packed = ck.get_raw("layers.1.ffn.experts.2.w1.weight")
        assert packed.dtype == np.int8 and packed.shape == (64, 32)
        assert ck.get_raw("layers.1.ffn.experts.2.w1.scale").shape == (64, 2)
        assert not ck.has("model.embed_tokens.weight") and ck.has("embed.weight")
    finally:
        ck.close()
