"""DeepSeek-V4 config parsing: transformers' own folding of legacy fields, and one-line refusals."""

from __future__ import annotations

import json

import pytest

from lineside.build.models.deepseek_v4 import parse_config, required_tensors
from lineside.build.models.deepseek_v4.config import CSA, HCA, SLIDING
from lineside.config import ModelConfig
from lineside.errors import ConfigError

BASE = dict(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=128, hidden_size=64,
            moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, q_lora_rank=64,
            num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=32, index_n_heads=8,
            index_head_dim=16, index_topk=3, sliding_window=8)


def test_saved_config_parses_like_transformers(v4):
    d = json.loads((v4.hf_dir("b") / "config.json").read_text())
    c = parse_config(d)
    m = v4.model("b").config
    assert c.layer_types == m.layer_types and c.mlp_layer_types == m.mlp_layer_types
    assert c.compress_rates == m.compress_rates and c.rope_dim == m.qk_rope_head_dim == 8
    assert c.rope["compress"]["rope_type"] == "yarn" and c.rope["compress"]["attention_factor"] == 1.0
    assert c.rope["main"]["rope_type"] == "default" and c.scoring_func == "sigmoid" and c.hc_mult == 3


def test_legacy_fields_fold_like_transformers():
    from transformers import DeepseekV4Config

    legacy = dict(BASE, compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1, compress_rate_csa=4,
                  compress_rate_hca=128, qk_rope_head_dim=16, num_nextn_predict_layers=1,
                  rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64})
    ours = parse_config(legacy)
    ref = DeepseekV4Config(**{k: v for k, v in legacy.items() if k not in ("model_type", "architectures")})
    assert ours.layer_types == ref.layer_types == [SLIDING, CSA, HCA, CSA]
    assert ours.mlp_layer_types == ref.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert ours.compress_rates == ref.compress_rates
    assert ours.rope_dim == ref.qk_rope_head_dim == 16
    assert ours.rope["compress"]["factor"] == ref.rope_parameters["compress"]["factor"] == 16
    assert ours.rope["compress"]["attention_factor"] == ref.rope_parameters["compress"]["attention_factor"]
    assert ours.rope["compress"]["rope_theta"] == ref.rope_parameters["compress"]["rope_theta"]


def test_defaults_match_transformers():
    from transformers import DeepseekV4Config

    d = {k: v for k, v in BASE.items() if k not in ("model_type", "architectures")}
    ours, ref = parse_config(dict(BASE)), DeepseekV4Config(**d)
    assert ours.layer_types == ref.layer_types and ours.mlp_layer_types == ref.mlp_layer_types
    assert ours.compress_rates == {CSA: 4, HCA: 128}


def test_model_config_route():
    """The pipeline passes a ModelConfig; the V4 module reads its raw dict."""
    mc = ModelConfig.from_hf_dict(dict(BASE, layer_types=[SLIDING, CSA, HCA, SLIDING]))
    names = required_tensors(mc)
    assert "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight" in names
    assert "model.layers.2.self_attn.compressor.position_bias" in names
    assert not any("layers.0.self_attn.compressor" in n for n in names)


@pytest.mark.parametrize("patch,words", [
    (dict(layer_types=[SLIDING, CSA]), "layer_types has 2 entries but num_hidden_layers is 4"),
    # 5 entries are the 4 layers' and the MTP layer's (num_nextn_predict_layers defaults to 1): accepted
    (dict(mlp_layer_types=["moe"] * 6), "mlp_layer_types has 6 entries"),
    (dict(layer_types=[SLIDING, "full_attention", CSA, HCA]), "'full_attention' is not one of"),
    (dict(compress_ratios=[0, 4, 16, 0]), "compress_ratios value 16"),
    (dict(compress_ratios=[0, [4], 128, 0]), "compress_ratios value [4]"),  # was a TypeError traceback
    (dict(compress_ratios=[0, 4]), "compress_ratios has 2 entries"),
    # both rates equal: a ratio cannot say which type (was: every such layer became HCA, transformers makes 4 CSA)
    (dict(compress_ratios=[0, 4, 4, 0], compress_rate_hca=4), "compress_ratios cannot tell"),
    (dict(num_key_value_heads=2), "one shared KV head"),
    (dict(o_groups=3), "o_groups 3 does not divide"),
    (dict(num_experts_per_tok=8), "exceeds n_routed_experts"),
    (dict(scoring_func="relu"), "scoring_func 'relu'"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8}), "rope type 'llama3' is not supported"),
    (dict(hidden_size=0), "'hidden_size' must be a positive integer"),
    # wrong types: one line naming the field, not a ValueError/TypeError traceback or a truthy string
    (dict(rms_norm_eps="1e-6"), "'rms_norm_eps' must be a positive number"),
    (dict(hc_eps=None, swiglu_limit=-1.0), "'swiglu_limit' must be a positive number"),
    (dict(routed_scaling_factor="2.5"), "'routed_scaling_factor' must be a positive number"),
    (dict(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false"),
    (dict(max_position_embeddings="4096"), "'max_position_embeddings' must be a positive integer"),
    (dict(n_shared_experts="1"), "n_shared_experts is '1'"),
    (dict(rope_theta="1e4"), "'rope_theta' must be a positive number"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 16}),
     "'factor' must be a positive number"),
    (dict(partial_rotary_factor=None, qk_rope_head_dim="8"), "'qk_rope_head_dim' must be a positive integer"),
    (dict(compress_ratios=[0, 4, 4, 0], num_nextn_predict_layers="1"), "'num_nextn_predict_layers'"),
])
def test_inconsistent_configs_are_one_line_errors(patch, words):
    with pytest.raises(ConfigError) as e:
        parse_config(dict(BASE, **patch))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_official_style_config_parses_like_transformers():
    """DeepSeek's own config.json spelling: compress_ratios (+ MTP entry), flat rope_scaling, num_hash_layers."""
    from transformers import DeepseekV4Config

    d = dict(vocab_size=512, hidden_size=256, moe_intermediate_size=512, num_hidden_layers=6, num_attention_heads=16,
             num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=128, o_lora_rank=128, o_groups=4,
             max_position_embeddings=4096, sliding_window=16, rope_theta=10000, compress_rope_theta=160000,
             rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32,
                           "beta_slow": 1},
             num_nextn_predict_layers=1, compress_ratios=[0, 0, 4, 128, 4, 128, 0], index_n_heads=64,
             index_head_dim=128, index_topk=16, hc_mult=4, n_routed_experts=8, num_experts_per_tok=2,
             scoring_func="sqrtsoftplus", topk_method="noaux_tc", num_hash_layers=2)
    ref = DeepseekV4Config(**d)
    ours = parse_config(dict(d, model_type="deepseek_v4"))
    assert ours.layer_types == ref.layer_types and ours.mlp_layer_types == ref.mlp_layer_types
    assert ours.rope_dim == ref.qk_rope_head_dim == 64
    for key in ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "rope_theta",
                "attention_factor"):
        assert ours.rope["compress"][key] == ref.rope_parameters["compress"][key], key
    assert ours.rope["main"]["rope_theta"] == ref.rope_parameters["main"]["rope_theta"]


_ROPE_BASE = dict(BASE, num_hidden_layers=3, partial_rotary_factor=0.25, max_position_embeddings=8192,
                  layer_types=[SLIDING, CSA, HCA])


@pytest.mark.parametrize("rope", [
    # V4-Flash's flat rope_scaling (mscale keys included: transformers forces the compress attention_factor to 1)
    dict(rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096, "beta_fast": 32,
                       "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # truncate: false is not honoured by V4 (transformers reads it from the top level of rope_parameters, which V4
    # nests; DeepSeek's reference always floors / ceils the correction range). Was: our yarn table used it.
    dict(compress_rope_theta=10000, rope_parameters={"type": "yarn", "factor": 4.0, "truncate": False,
                                                     "original_max_position_embeddings": 4096}),
    dict(rope_parameters={"main": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "truncate": False,
                                   "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5},
                          "compress": {"rope_type": "linear", "rope_theta": 3000.0, "factor": 2.0}}),
])
def test_rope_tables_match_transformers(rope):
    """The graph's inverse frequencies and cos/sin factor per rope label equal DeepseekV4RotaryEmbedding's."""
    import numpy as np
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from lineside.build.models.deepseek_v4.graph import rope_frequencies

    kw = {k: v for k, v in dict(_ROPE_BASE, **rope).items() if k not in ("model_type", "architectures")}
    hf = DeepseekV4Config(**kw)
    emb = DeepseekV4RotaryEmbedding(hf)
    ours = rope_frequencies(parse_config(json.loads(hf.to_json_string())))
    for label in ("main", "compress"):
        inv, factor = ours[label]
        np.testing.assert_allclose(inv, getattr(emb, f"{label}_inv_freq").numpy(), rtol=1e-6, err_msg=label)
        assert factor == pytest.approx(getattr(emb, f"{label}_attention_scaling"), rel=1e-9), label


def test_per_layer_lists_may_carry_the_mtp_layers_entries_like_transformers():
    """layer_types / mlp_layer_types with the MTP layer's entry appended (as compress_ratios carries it) parse to the
    first num_hidden_layers entries, as transformers truncates them; was refused as a length mismatch."""
    from transformers import DeepseekV4Config

    d = dict(BASE, num_nextn_predict_layers=1, layer_types=[SLIDING, CSA, HCA, CSA, SLIDING],
             mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"])
    ours = parse_config(d)
    ref = DeepseekV4Config(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    assert ours.layer_types == ref.layer_types == [SLIDING, CSA, HCA, CSA]
    assert ours.mlp_layer_types == ref.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    with pytest.raises(ConfigError, match="layer_types has 6 entries but num_hidden_layers is 4"):
        parse_config(dict(d, layer_types=[SLIDING] * 6))  # more than the MTP layers add


def test_mtp_entries_without_num_nextn_predict_layers_use_transformers_default():
    """num_nextn_predict_layers absent means transformers' default, 1: compress_ratios with the MTP layer's ratio
    appended parses as transformers does (was refused: 'compress_ratios has 5 entries')."""
    from transformers import DeepseekV4Config

    d = dict(BASE, compress_ratios=[0, 4, 128, 4, 0])
    ours = parse_config(d)
    ref = DeepseekV4Config(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    assert ours.layer_types == ref.layer_types == [SLIDING, CSA, HCA, CSA]
    assert ours.mtp_layers == ref.num_nextn_predict_layers == 1
    assert parse_config(dict(d, num_nextn_predict_layers=0, compress_ratios=[0, 4, 128, 4])).mtp_layers == 0


def test_zero_sinkhorn_iterations_run_as_one():
    """transformers accepts hc_sinkhorn_iters 0 and normalises once, as with 1 (was refused); negative stays refused.
    (Checked against transformers end to end on schedule b with 0: max rel err 1.7e-6, cpu and trt.)"""
    assert parse_config(dict(BASE, hc_sinkhorn_iters=0)).hc_sinkhorn_iters == 1
    with pytest.raises(ConfigError, match="'hc_sinkhorn_iters' must be a positive integer, got -1"):
        parse_config(dict(BASE, hc_sinkhorn_iters=-1))


def test_an_unknown_compress_ratio_says_which_rate_to_set():
    """A smaller V4 whose compress_ratios use another heavy rate (8, not 128): the refusal names the field to set
    (was only 'is not 0, 4 or 128'), and with compress_rate_hca set the layers parse as transformers' (which has
    no mapping for 8 at all: KeyError) parses the same schedule given as layer_types."""
    from transformers import DeepseekV4Config

    d = dict(BASE, compress_ratios=[0, 4, 8, 0])
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert "compress_ratios value 8 is not 0, 4 or 128" in str(e.value) and "compress_rate_hca" in str(e.value)
    assert "\n" not in str(e.value)
    ours = parse_config(dict(d, compress_rate_hca=8))
    kw = {k: v for k, v in BASE.items() if k not in ("model_type", "architectures")}
    ref = DeepseekV4Config(**kw, layer_types=ours.layer_types, compress_rates={CSA: 4, HCA: 8})
    assert ours.layer_types == ref.layer_types == [SLIDING, CSA, HCA, SLIDING]
    assert ours.compress_rates == ref.compress_rates
