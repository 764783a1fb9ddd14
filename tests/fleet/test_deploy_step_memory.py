"""A step's memory as the datacenter engines reserve it (lineside.deploy.step_memory): fused attention (no
per-head scores), logits for one row per sequence and draft token (not every batched token), vLLM's sampler
temporaries over those rows. Was 26 GiB for a 70B at 8192 tokens, which refused it on 3xH100 at 0.90."""

from __future__ import annotations

import pytest

from lineside.deploy.engines import build_deployment
from lineside.deploy.sizing import GIB, plan_datacenter, raw_config
from lineside.deploy.step_memory import LOGIT_BYTES, logit_rows, step_memory
from lineside.errors import LinesideError
from tests.fleet.test_deploy_pipeline import LLAMA_70B, llama70b  # noqa: F401  (fixture)


def test_a_70b_step_is_its_layer_activations_and_one_logits_row_per_sequence():
    s = step_memory(LLAMA_70B, tokens=8192, max_num_seqs=128, draft_tokens=0, tp=1)
    # residual + normed input, q/k/v + attention output (64 heads, 8 KV heads of 128), gate-up + activated MLP
    assert s.forward == 8192 * (2 * 8192 + 2 * 8192 + 2 * 1024 + 3 * 28672) * 2
    assert s.logits == 128 * 128256 * LOGIT_BYTES  # 128 rows, not 8192
    assert s.total < 3 * GIB  # the old estimate: 26.5 GiB (every token's fp16 logits + fp32 attention scores)
    # more batched tokens grow the activations, never the logits; more sequences grow the logits
    wider = step_memory(LLAMA_70B, tokens=16384, max_num_seqs=128, draft_tokens=0, tp=1)
    assert wider.logits == s.logits and wider.forward == 2 * s.forward
    assert step_memory(LLAMA_70B, tokens=8192, max_num_seqs=256, draft_tokens=0, tp=1).logits == 2 * s.logits


def test_tensor_parallelism_shards_activations_but_every_rank_samples_the_whole_vocabulary():
    one = step_memory(LLAMA_70B, tokens=8192, max_num_seqs=128, draft_tokens=0, tp=1)
    four = step_memory(LLAMA_70B, tokens=8192, max_num_seqs=128, draft_tokens=0, tp=4)
    assert four.logits == one.logits
    assert one.forward // 4 < four.forward < one.forward  # the residual stream stays full width
    eight_kv = step_memory(LLAMA_70B, tokens=1, max_num_seqs=1, draft_tokens=0, tp=16)
    assert eight_kv.forward == (2 * 8192 + 2 * 512 + 2 * 128 + 3 * 28672 // 16) * 2  # a KV head is whole


def test_logit_rows_are_sequences_times_verified_tokens_bounded_by_the_batch():
    assert logit_rows(128, 0, 8192) == 128
    assert logit_rows(32, 3, 8192) == 128  # MTP: each sequence's next token and its 3 drafts
    assert logit_rows(1024, 1, 512) == 512  # never more rows than tokens in the step
    assert logit_rows(0, 0, 0) == 1


def test_mtp_drafts_add_logits_rows_to_a_v4_plan():
    raw = raw_config("deepseek-v4-flash")
    one = step_memory(raw, tokens=8192, max_num_seqs=128, draft_tokens=1, tp=1)
    none = step_memory(raw, tokens=8192, max_num_seqs=128, draft_tokens=0, tp=1)
    assert one.logits == 2 * none.logits and one.forward == none.forward
    p1 = plan_datacenter("deepseek-v4-flash", "8xH200", draft_tokens=1)
    p3 = plan_datacenter("deepseek-v4-flash", "8xH200", draft_tokens=3)
    assert p3.overhead_per_gpu_bytes - p1.overhead_per_gpu_bytes == 2 * 128 * 129280 * LOGIT_BYTES


def test_the_plan_overhead_is_the_base_and_one_step_per_gpu(llama70b):  # noqa: F811
    p = plan_datacenter(llama70b, "4xH100", gpu_memory_utilization=0.90)
    assert (p.tp, p.pp) == (4, 1)
    step = step_memory(LLAMA_70B, tokens=8192, max_num_seqs=128, draft_tokens=0, tp=4)
    assert p.overhead_per_gpu_bytes == 3 * GIB + step.total
    v4 = plan_datacenter("deepseek-v4-flash", "8xH200")
    assert v4.attention_dp  # each rank runs its own batch at TP 1: its step is not divided by the group
    raw = raw_config("deepseek-v4-flash")
    assert v4.overhead_per_gpu_bytes == 3 * GIB + step_memory(raw, tokens=8192, max_num_seqs=128, draft_tokens=1,
                                                              tp=1).total


def test_the_70b_on_3xh100_plans_at_the_default_utilization(llama70b):  # noqa: F811
    """Was refused ('use --gpus 4xH100'): 45 GiB of weights a stage + 29.5 GiB of overhead over 71.7 usable."""
    for engine in ("vllm", "sglang", "trtllm"):
        d = build_deployment(llama70b, "3xH100", engine)
        assert d.plan.fits and d.plan.max_model_len == 131072, engine
        assert d.plan.weights_per_gpu_bytes + d.plan.overhead_per_gpu_bytes < d.plan.gpu_memory_bytes * 0.9


def test_a_model_that_truly_does_not_fit_is_still_refused(llama70b):  # noqa: F811
    """131 GiB of bf16 weights on one 80 GB H100; V4-Pro's experts on 8xH100."""
    with pytest.raises(LinesideError) as e:
        build_deployment(llama70b, "1xH100", "vllm")
    assert "does not fit 1xH100" in str(e.value) and str(e.value).endswith("use --gpus 2xH100")
    with pytest.raises(LinesideError) as e:
        build_deployment("deepseek-v4-pro", "8xH100", "vllm")
    assert "does not fit 8xH100" in str(e.value) and "\n" not in str(e.value)
