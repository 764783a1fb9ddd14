"""`deploy datacenter` on any GPU count 1..8: every split is one the engine accepts (TP divides the heads, KV
heads and MLP; EP divides the experts), every server gets its own GPUs, idle GPUs are named with the reason, and
what cannot run is refused in one line that names a GPU set that can."""

from __future__ import annotations

import re

import pytest
import yaml

from lineside.deploy.engines import build_deployment
from lineside.deploy.parallel import Shape
from lineside.deploy.sizing import plan_datacenter, raw_config
from lineside.errors import LinesideError
from tests.cli.cli_run import run_cli
from tests.fleet.test_deploy_datacenter import CHECK, DENSE, V4

MODELS = [*V4, *DENSE, "deepseek-r1-distill-qwen-7b", "deepseek-r1-distill-qwen-14b"]


def attention_tp(engine: str, c: dict) -> tuple[int, int]:
    """(GPUs one server spans, ranks its attention heads are split over), read back from the engine's config."""
    if engine == "vllm":
        pp = c.get("pipeline-parallel-size", 1)
        return c["tensor-parallel-size"] * pp * c.get("data-parallel-size", 1), c["tensor-parallel-size"]
    if engine == "sglang":
        pp = c.get("pp-size", 1)
        return c["tp-size"] * pp * c.get("dp-size", 1), c["tp-size"] // c.get("attn-dp-size", 1)
    tp = c["tensor_parallel_size"]
    return tp * c.get("pipeline_parallel_size", 1), 1 if c.get("enable_attention_dp") else tp


def expert_ranks(engine: str, c: dict) -> int:
    if engine == "vllm":
        return c["tensor-parallel-size"] * c.get("data-parallel-size", 1) if c.get("enable-expert-parallel") else 1
    return c.get("ep-size", 1) if engine == "sglang" else c.get("moe_expert_parallel_size", 1)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpu", ["H100", "H200", "B200"])
def test_every_gpu_count_plans_a_split_the_engine_takes_or_says_what_would(model, gpu, tmp_path):
    from lineside.deploy.compose import compose, deployment_files

    shape = Shape.of(raw_config(model))
    for n in range(1, 9):
        for engine in ("vllm", "sglang", "trtllm"):
            for profile in ("throughput", "latency"):
                where = f"{model} {n}x{gpu} {engine} {profile}"
                try:
                    d = build_deployment(model, f"{n}x{gpu}", engine, profile=profile)
                except LinesideError as e:
                    msg = str(e)
                    if "SM100+" in msg:  # TensorRT-LLM runs V4 on Blackwell only (its own test)
                        continue
                    assert "does not fit" in msg and "\n" not in msg, where
                    assert "use --gpus " in msg, f"{where}: {msg}"  # every shipped model fits some node
                    alt = msg.rsplit("use --gpus ", 1)[1]
                    assert plan_datacenter(model, alt, profile=profile).fits, f"{where}: {alt} does not fit"
                    continue
                c = d.config
                assert CHECK[engine](c) == [], where
                ids = [i for r in d.replicas for i in r.gpu_ids]
                assert ids == list(range(len(ids))), f"{where}: servers share or skip GPUs: {d.replicas}"
                assert len(ids) + d.plan.idle_gpus == n, where
                for r in d.replicas:
                    span, tp = attention_tp(engine, c)
                    assert span == len(r.gpu_ids), f"{where}: config spans {span} GPUs, server has {r.gpu_ids}"
                    assert shape.heads % tp == 0, f"{where}: TP {tp} over {shape.heads} heads"
                    assert shape.kv_heads % tp == 0 or tp % shape.kv_heads == 0, where
                    assert not shape.intermediate or shape.intermediate % tp == 0, where
                    ep = expert_ranks(engine, c)
                    assert not shape.experts or shape.experts % ep == 0, f"{where}: EP {ep}"
                idle = [x for x in d.notes if " idle: " in x]
                assert len(idle) == (1 if d.plan.idle_gpus else 0), f"{where}: {d.notes}"
                if idle:
                    assert idle[0].startswith(f"GPU{'s' if d.plan.idle_gpus > 1 else ''} {len(ids)}"), idle[0]
                    assert "(" in idle[0], f"{where}: no reason given: {idle[0]}"
                dc = compose(d)
                reserved = [dc["services"][r.name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
                            for r in d.replicas]
                assert reserved == [[str(i) for i in r.gpu_ids] for r in d.replicas], where
                assert set(dc["services"]["gateway"]["depends_on"]) == {r.name for r in d.replicas}
                assert yaml.safe_load(deployment_files(d)[d.config_file].split("\n", 1)[1]) == c


def test_six_gpus_for_v4_flash_split_into_whole_replicas_or_leave_two_idle_with_the_reason():
    """256 experts and 64 heads split over 1, 2, 4 or 8 GPUs only: throughput runs 3 servers of EP 2 (all 6
    busy); latency runs TP 4 and names GPUs 4-5 idle, why, and the profile that would use them."""
    d = build_deployment("deepseek-v4-flash", "6xH200", "vllm")
    assert [r.gpu_ids for r in d.replicas] == [[0, 1], [2, 3], [4, 5]] and d.plan.idle_gpus == 0
    assert d.config["data-parallel-size"] == 2 and d.config["tensor-parallel-size"] == 1
    lat = build_deployment("deepseek-v4-flash", "6xH200", "sglang", profile="latency")
    assert [r.gpu_ids for r in lat.replicas] == [[0, 1, 2, 3]] and lat.config["tp-size"] == 4
    (idle,) = [x for x in lat.notes if "idle" in x]
    assert idle.startswith("GPUs 4-5 idle: 1 replica(s) of 4 GPU(s) use 4 of 6")
    assert "256 routed experts do not split evenly over 5 or 6 GPUs" in idle
    assert "--profile throughput runs 3 replicas of 2 GPUs (EP 2, attention-DP) on 6 of 6" in idle


def test_seven_gpus_for_a_40_head_model_run_three_tp2_replicas_and_say_why_one_is_idle():
    # at 0.80 one H100 (63.7 GiB usable) is too small for the 32B's 61 GiB and a step's memory: TP 2
    d = build_deployment("deepseek-r1-distill-qwen-32b", "7xH100", "trtllm", gpu_memory_utilization=0.8)
    assert [r.gpu_ids for r in d.replicas] == [[0, 1], [2, 3], [4, 5]]
    assert d.config["tensor_parallel_size"] == 2
    (idle,) = [x for x in d.notes if "idle" in x]
    assert idle.startswith("GPU 6 idle: 3 replica(s) of 2 GPU(s) use 6 of 7")
    assert "40 attention heads do not split evenly over 3, 6 or 7 GPUs" in idle
    assert "8 KV heads do not split evenly over 5 GPUs" in idle


def test_the_cli_prints_the_idle_line_and_writes_one_service_per_server(tmp_path):
    p = run_cli("deploy", "datacenter", "deepseek-r1-distill-qwen-32b", "--gpus", "3xH100", "--engine", "vllm",
                "--profile", "latency", "--gpu-memory-utilization", "0.8", "-o", tmp_path)  # 0.8: TP 1 too small;
    # throughput pipelines it over all three
    assert p.returncode == 0, p.stderr
    assert "note: GPU 2 idle: 1 replica(s) of 2 GPU(s) use 2 of 3" in p.stdout
    dc = yaml.safe_load((tmp_path / "docker-compose.yaml").read_text())
    devices = dc["services"]["engine"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert devices == ["0", "1"]  # GPU 2 is not reserved for a server that does not use it
    assert "CUDA_VISIBLE_DEVICES=0,1 " in (tmp_path / "launch.sh").read_text()


@pytest.mark.parametrize("gpus", ["0xH200", "9xH200", "16xB200"])
def test_a_gpu_count_outside_one_node_is_one_line(gpus, tmp_path):
    p = run_cli("deploy", "datacenter", "deepseek-v4-flash", "--gpus", gpus, "--engine", "vllm", "-o", tmp_path / "o")
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert "give 1 to 8" in p.stderr and "Traceback" not in p.stderr and not (tmp_path / "o").exists()


def test_what_does_not_fit_names_the_gpu_set_that_does():
    with pytest.raises(LinesideError) as e:
        build_deployment("deepseek-v4-flash", "3xH100", "vllm")
    assert str(e.value).endswith("use --gpus 4xH100")
    with pytest.raises(LinesideError) as e:
        build_deployment("deepseek-v4-pro", "6xB200", "sglang")  # 128 heads: no TP 6; attention-DP 6 too big
    assert str(e.value).endswith("use --gpus 8xB200")
    with pytest.raises(LinesideError) as e:
        build_deployment("deepseek-r1-distill-qwen-32b", "1xH100", "vllm", gpu_memory_utilization=0.8)
    assert str(e.value).endswith("use --gpus 2xH100")


def test_the_shape_rules_match_the_engines():
    """Qwen-1.5B (12 heads, 2 KV heads, MLP 8960): TP 4 replicates KV heads; 3 splits them unevenly; 6 splits
    the MLP unevenly (vLLM's divide() asserts on each)."""
    s = Shape.of(raw_config("deepseek-r1-distill-qwen-1.5b"))
    assert (s.heads, s.kv_heads, s.intermediate, s.experts) == (12, 2, 8960, 0)
    assert s.tp_problem(4) is None and s.kv_shard(4) == 2
    assert s.tp_problem(3) == "2 KV heads" and s.tp_problem(6) == "MLP width 8960"
    assert s.tp_problem(5) == "12 attention heads"
    v4 = Shape.of(raw_config("deepseek-v4-pro"))
    assert v4.ep_problem(6) is None and v4.ep_problem(5) == "384 routed experts" and v4.tp_problem(6)


@pytest.mark.parametrize(("model", "gpus", "engine"), [("deepseek-v4-flash", "6xH200", "vllm"),
                                                      ("deepseek-v4-flash", "6xB200", "sglang"),
                                                      ("deepseek-r1-distill-qwen-7b", "3xH200", "trtllm")])
def test_launch_sh_gives_each_server_on_the_host_its_own_port(model, gpus, engine):
    """launch.sh starts every server on one host: all on port 8000, every one after the first failed to bind."""
    import re

    from lineside.deploy.compose import deployment_files

    d = build_deployment(model, gpus, engine)
    assert len(d.replicas) == 3
    text = deployment_files(d)["launch.sh"]
    servers = [x for x in text.splitlines() if x.startswith("CUDA_VISIBLE_DEVICES=")]
    ports = [re.findall(r"--port (\d+)", x) for x in servers]
    assert ports == [["8000"], ["8001"], ["8002"]], servers
    assert "# 3 servers on ports 8000-8002" in text
    # compose keeps 8000 in each container: the gateway reaches them by service name
    assert all(a != "8001" for r in d.replicas for a in r.command)


def test_the_busier_split_an_idle_note_names_is_worse_the_way_it_says():
    """Throughput leaves GPUs idle only when each busier split runs fewer replicas or holds a shorter context; the
    note says which, with numbers that are so. The 32B on 5xH100 at 0.85 said "TP 1 x PP 1 would use them but runs
    5 replica(s), not 2": TP 1 runs more replicas, each too short of the 32K a split must hold."""
    p = plan_datacenter("deepseek-r1-distill-qwen-32b", "5xH100", gpu_memory_utilization=0.85)
    (idle,) = [x for x in p.notes if " idle: " in x]
    assert "TP 1 alone would use them but holds " in idle and "tokens a sequence, not 32768" in idle
    seen = 0
    for model in MODELS + ["deepseek-r1-distill-qwen-32b"]:
        for gpu in ("H100", "H200", "B200"):
            for n in range(1, 9):
                for util in (0.8, 0.85, 0.9):
                    p = plan_datacenter(model, f"{n}x{gpu}", gpu_memory_utilization=util)
                    for note in p.notes:
                        for fewer, than in re.findall(r"would use them but runs (\d+) replica\(s\), not (\d+)", note):
                            assert int(fewer) < int(than), note
                            seen += 1
                        for short, than in re.findall(r"would use them but holds (\d+) tokens a sequence, not (\d+)",
                                                      note):
                            assert int(short) < int(than) <= p.max_model_len, note
                            seen += 1
    assert seen >= 2
