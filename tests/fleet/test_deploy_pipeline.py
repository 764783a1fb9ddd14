"""`deploy datacenter` with pipeline parallelism: TP × PP when no TP alone fits (a 70B on 3xH100 at
--gpu-memory-utilization 0.85: its 64 heads split over 1, 2, 4 or 8 GPUs), or, for throughput, when it uses GPUs TP
leaves idle (the same 70B at the default 0.90); each engine's own
option (vLLM --pipeline-parallel-size, SGLang --pp-size, TensorRT-LLM pipeline_parallel_size) held to its
schema; V4 is never pipelined (MTP drafting under PP does not run in vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lineside.deploy.engines import build_deployment, format_deployment
from lineside.deploy.sizing import plan_datacenter
from lineside.errors import LinesideError
from tests.cli.cli_run import run_cli
from tests.fleet.test_deploy_datacenter import CHECK
from tests.fleet.test_deploy_gpu_counts import attention_tp

# Llama-3.3-70B's shape: 64 heads, 8 KV heads, 80 layers, bf16 131 GiB (no shipped config is this big and dense)
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
             "num_hidden_layers": 80, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "head_dim": 128}
PP_KEY = {"vllm": "pipeline-parallel-size", "sglang": "pp-size", "trtllm": "pipeline_parallel_size"}


@pytest.fixture
def llama70b(tmp_path) -> str:
    d = tmp_path / "Llama-3.3-70B-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_70B))
    return str(d)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_a_70b_too_big_for_every_tp_split_of_3_gpus_runs_as_3_pipeline_stages(llama70b, engine):
    """TP 1 holds 131 GiB, TP 2 66 GiB + a step's memory (over the 67.7 GiB usable at 0.85), TP 3 does not divide
    64 heads: it was refused; one server of TP 1 x PP 3 (27 of 80 layers a stage) fits, in each engine's own
    option name."""
    d = build_deployment(llama70b, "3xH100", engine, gpu_memory_utilization=0.85)
    p = d.plan
    assert p.fits and (p.tp, p.pp, p.idle_gpus) == (1, 3, 0)
    assert [r.gpu_ids for r in d.replicas] == [[0, 1, 2]]
    assert d.config[PP_KEY[engine]] == 3 and CHECK[engine](d.config) == []
    assert attention_tp(engine, d.config) == (3, 1)
    # a stage holds its 27 layers and one end (embedding or lm_head): about a third of the weights, not all
    end = p.breakdown["embedding"]
    assert p.weights_total_bytes // 3 < p.weights_per_gpu_bytes <= (p.weights_total_bytes - 2 * end) * 27 // 80 + end
    (note,) = [n for n in d.notes if n.startswith("pipeline parallel:")]
    assert "TP 1 x PP 3" in note and "fits no tensor-parallel split" in note and "27 of 80 layers" in note
    assert "TP 1, PP 3, DP 1" in format_deployment(d)


def test_the_70b_on_2_gpus_is_refused_naming_the_smallest_set_pipeline_stages_make_fit(llama70b):
    with pytest.raises(LinesideError) as e:
        build_deployment(llama70b, "2xH100", "vllm", gpu_memory_utilization=0.85)
    assert str(e.value).endswith("use --gpus 3xH100")  # was 4xH100: TP 4 was the only split that held it


def test_pipeline_stages_hold_the_kv_cache_of_their_own_layers(llama70b):
    """A stage keeps only its layers' KV: on TP 1 x PP 3 one sequence costs a GPU 27/80 of its KV."""
    from lineside.jetson.planner import load_model
    from lineside.jetson.sizes import check_kv_dtype

    p = plan_datacenter(llama70b, "3xH100", gpu_memory_utilization=0.98)
    assert (p.tp, p.pp) == (1, 3)
    whole = load_model(llama70b).kv(p.max_model_len, 1, check_kv_dtype("fp8", external=True)).total
    per_seq = -(-whole * 27 // 80)
    assert p.seqs_at_max_len == p.kv_budget_per_gpu_bytes // per_seq > 0


def test_throughput_takes_idle_gpus_with_stages_latency_keeps_tp_and_says_so(llama70b):
    """The 70B (64 heads) on 3xH100 at the default 0.90: TP 2 holds it (66 GiB of weights a GPU) but leaves GPU 2
    idle; throughput runs TP 1 x PP 3 on all three, latency keeps TP 2 (faster per token) and names the pipelined
    split that would use GPU 2. It was refused (told 4xH100) while every token's logits and unfused attention
    scores, 26 GiB, were counted as a step's memory."""
    d = build_deployment(llama70b, "3xH100", "sglang")
    assert (d.plan.tp, d.plan.pp, d.plan.idle_gpus) == (1, 3, 0) and d.config["pp-size"] == 3
    assert d.plan.max_model_len == 131072 and d.plan.overhead_per_gpu_bytes < 6 * (1 << 30)
    assert "uses the 1 GPU(s) TP 2 alone leaves idle" in " ".join(d.notes)
    lat = build_deployment(llama70b, "3xH100", "sglang", profile="latency")
    assert (lat.plan.tp, lat.plan.pp, lat.plan.idle_gpus) == (2, 1, 1) and "pp-size" not in lat.config
    (idle,) = [n for n in lat.notes if " idle: " in n]
    assert "--profile throughput runs 1 replica of 3 GPUs (TP 1 x PP 3) on 3 of 3" in idle


def test_pipelined_replicas_are_one_server_each(llama70b):
    """6xH100 at 0.85 (TP 2 too small): TP 4 alone fits but leaves 2 idle; throughput runs two replicas of
    TP 1 x PP 3, each its own server on GPUs 0-2 and 3-5 (no data-parallel option inside one), both behind the
    gateway."""
    for engine in ("vllm", "sglang", "trtllm"):
        d = build_deployment(llama70b, "6xH100", engine, gpu_memory_utilization=0.85)
        assert (d.plan.tp, d.plan.pp, d.plan.idle_gpus) == (1, 3, 0), engine
        assert [r.gpu_ids for r in d.replicas] == [[0, 1, 2], [3, 4, 5]], engine
        assert "data-parallel-size" not in d.config and "dp-size" not in d.config
        assert CHECK[engine](d.config) == [] and attention_tp(engine, d.config) == (3, 1)
        if engine == "sglang":
            assert d.config["max-running-requests"] == 128  # per server, not per plan


def test_v4_is_never_pipelined():
    for model in ("deepseek-v4-flash", "deepseek-v4-pro"):
        for n in range(1, 9):
            for profile in ("throughput", "latency"):
                assert plan_datacenter(model, f"{n}xH200", profile=profile).pp == 1


def test_the_cli_prints_the_pipeline_layout(llama70b, tmp_path):
    p = run_cli("deploy", "datacenter", llama70b, "--gpus", "3xH100", "--engine", "trtllm",
                "--gpu-memory-utilization", "0.98", "-o", tmp_path / "out")
    assert p.returncode == 0, p.stderr
    assert "TP 1, PP 3, DP 1, EP 1" in p.stdout
    assert "pipeline_parallel_size: 3" in Path(tmp_path / "out" / "trtllm.yaml").read_text()
    assert "CUDA_VISIBLE_DEVICES=0,1,2 " in (tmp_path / "out" / "launch.sh").read_text()
