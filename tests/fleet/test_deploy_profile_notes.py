"""A plan's note that names the other --profile says exactly what that profile plans for the same model, GPUs and
settings: read back from the note (replicas, GPUs each, TP / PP / EP, GPUs used) and held to the plan
`plan_datacenter` makes with that profile. V4-Flash on 6xB200 latency said "throughput runs 6 replicas of 1" while
throughput planned 3 servers of EP 2."""

from __future__ import annotations

import json
import re

import pytest

from lineside.deploy.engines import build_deployment
from lineside.deploy.sizing import GPUS, DcPlan, plan_datacenter
from lineside.jetson.planner import shipped_configs
from tests.fleet.test_deploy_pipeline import LLAMA_70B

OTHER = re.compile(r"--profile (throughput|latency) runs (\d+) replicas? of (\d+) GPUs? \(([^)]*)\) on (\d+) of (\d+)")
OTHER_WORDS = re.compile(r"--profile (throughput|latency)\b")


def read_back(words: str) -> dict[str, int | bool]:
    """'TP 1 x PP 3' / 'TP 2' / 'EP 2, attention-DP' / 'TP 4, EP 4' as numbers."""
    out: dict[str, int | bool] = {"tp": 1, "pp": 1, "ep": 1, "attention_dp": False}
    for part in re.split(r", | x ", words):
        if part == "attention-DP":
            out["attention_dp"] = True
        else:
            key, value = part.split()
            out[key.lower()] = int(value)
    return out


def replicas_of(p: DcPlan) -> tuple[int, int]:
    """(replicas, GPUs each) of a plan, from its fields: V4 and pipelined plans run one server per replica,
    a dense TP-only plan one server whose data-parallel ranks are the replicas."""
    if p.architecture == "deepseek_v4" or p.pp > 1:
        return p.servers, p.gpus_per_server
    return p.dp, p.tp


def check_notes(model: str, gpus: str, util: float) -> int:
    """Every note naming the other profile in both profiles' plans; how many there were."""
    seen = 0
    plans = {prof: plan_datacenter(model, gpus, profile=prof, gpu_memory_utilization=util)
             for prof in ("throughput", "latency")}
    for prof, p in plans.items():
        for note in p.notes:
            named = OTHER_WORDS.findall(note)
            if not named:
                continue
            where = f"{model} {gpus} {prof} at {util}: {note}"
            assert prof not in named, where
            m = OTHER.search(note)
            assert m, f"{where}: names the other profile without its layout"
            other = plans[m.group(1)]
            assert other.fits, where
            replicas, group = replicas_of(other)
            assert (int(m.group(2)), int(m.group(3))) == (replicas, group), where
            shape = read_back(m.group(4))
            assert (shape["tp"], shape["pp"], shape["ep"], shape["attention_dp"]) == (
                other.tp, other.pp, other.ep, other.attention_dp), where
            n = int(gpus.split("x")[0])
            assert (int(m.group(5)), int(m.group(6))) == (n - other.idle_gpus, n), where
            assert replicas * group == n - other.idle_gpus, where
            seen += 1
    return seen


@pytest.mark.parametrize("util", [0.9, 0.8])
def test_a_note_naming_the_other_profile_says_what_that_profile_plans(util):
    seen = sum(check_notes(model, f"{n}x{gpu}", util)
               for model in shipped_configs() for gpu in GPUS for n in range(1, 9))
    assert seen > 0  # the sweep reaches such notes (V4-Flash on 6xB200, 7xH200, ...)


@pytest.mark.parametrize("util", [0.9, 0.85])
def test_a_dense_model_too_big_for_one_gpu_names_the_other_profile_exactly(tmp_path, util):
    d = tmp_path / "Llama-3.3-70B-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_70B))
    seen = sum(check_notes(str(d), f"{n}x{gpu}", util) for gpu in GPUS for n in range(1, 9))
    assert seen > 0


def test_v4_flash_on_6_b200_latency_names_throughput_s_3_servers_of_ep_2():
    thr = plan_datacenter("deepseek-v4-flash", "6xB200", profile="throughput")
    assert (thr.servers, thr.gpus_per_server, thr.ep, thr.idle_gpus) == (3, 2, 2, 0)
    lat = build_deployment("deepseek-v4-flash", "6xB200", "vllm", profile="latency")
    (idle,) = [x for x in lat.notes if " idle: " in x]
    assert "--profile throughput runs 3 replicas of 2 GPUs (EP 2, attention-DP) on 6 of 6" in idle
