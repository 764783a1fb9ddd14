"""`lineside deploy datacenter`: configs held to each engine's own schema (fixtures from its source), the
memory math behind them, and the combinations refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lineside.deploy.engines import build_deployment, graph_sizes
from lineside.deploy.sizing import GIB, plan_datacenter
from lineside.errors import LinesideError
from tests.cli.cli_run import run_cli

jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema (dev extra): checks trtllm configs")

FIXTURES = Path(__file__).parent / "fixtures"
VLLM = json.loads((FIXTURES / "vllm_args.json").read_text())
SGLANG = json.loads((FIXTURES / "sglang_args.json").read_text())
TRTLLM = json.loads((FIXTURES / "trtllm_serve_schema.json").read_text())
TRTLLM_PROPS = TRTLLM["properties"]

V4 = ["deepseek-v4-flash", "deepseek-v4-pro"]
DENSE = ["deepseek-r1-distill-qwen-32b", "deepseek-r1-distill-llama-8b", "deepseek-r1-distill-qwen-1.5b"]


def vllm_errors(cfg: dict) -> list[str]:
    """Each key of a `vllm serve --config` YAML against vLLM's EngineArgs/FrontendArgs fields."""
    errs = []
    opts, aliases = VLLM["options"], VLLM["literal_aliases"]
    for k, v in cfg.items():
        o = opts.get("--" + k)
        if o is None:
            errs.append(f"--{k}: not a vLLM option")
            continue
        t = o["type"]
        if isinstance(v, bool) and "bool" not in t:
            errs.append(f"--{k}: bool given, type is {t}")
        elif isinstance(v, int) and not isinstance(v, bool) and not any(x in t for x in ("int", "float")):
            errs.append(f"--{k}: int given, type is {t}")
        elif isinstance(v, dict) and "dict" not in t:
            errs.append(f"--{k}: mapping given, type is {t}")
        elif isinstance(v, list) and "list" not in t:
            errs.append(f"--{k}: list given, type is {t}")
        if "choices" in o and v not in o["choices"]:
            errs.append(f"--{k}: {v!r} not in {o['choices']}")
        for alias, values in aliases.items():  # a str value for a `Alias | str` field must still be a known one
            if isinstance(v, str) and t.split(" | ")[0] == alias and v not in values:
                errs.append(f"--{k}: {v!r} not in {alias}")
    spec = cfg.get("speculative-config")
    if spec and spec["method"] not in aliases["MTPModelTypes"]:
        errs.append(f"speculative method {spec['method']!r} is not one of vLLM's MTP model types")
    return errs


def sglang_errors(cfg: dict) -> list[str]:
    """Each key of a `sglang.launch_server --config` YAML against SGLang's field namespaces."""
    opts = SGLANG["options"]
    by_alias = {a: o for o in opts.values() for a in o.get("aliases", [])}
    errs = []
    for k, v in cfg.items():
        o = opts.get("--" + k) or by_alias.get("--" + k)
        if o is None:
            errs.append(f"--{k}: not an SGLang option")
            continue
        if o.get("deprecated"):
            errs.append(f"--{k}: deprecated in SGLang {SGLANG.get('x-version')}")
            continue
        t = o["type"]
        if isinstance(v, bool) and "bool" not in t:
            errs.append(f"--{k}: bool given, type is {t}")
        elif isinstance(v, int) and not isinstance(v, bool) and not any(x in t for x in ("int", "float")):
            errs.append(f"--{k}: int given, type is {t}")
        elif isinstance(v, float) and "float" not in t:
            errs.append(f"--{k}: float given, type is {t}")
        if "choices" in o and v not in o["choices"]:
            errs.append(f"--{k}: {v!r} not in {o['choices']}")
    return errs


def trtllm_errors(cfg: dict) -> list[str]:
    v = jsonschema.Draft202012Validator(TRTLLM)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(cfg)]


CHECK = {"vllm": vllm_errors, "sglang": sglang_errors, "trtllm": trtllm_errors}


def test_the_trtllm_fixture_is_the_source_schema_verbatim():
    """Without its provenance keys the fixture re-creates the source file byte for byte (the sha256 recorded
    with repository, path and commit), so nothing in it was transcribed or pruned by hand."""
    import hashlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("engine_schemas", Path(__file__).parents[2] / "scripts" / "engine_schemas.py")
    assert spec is not None and spec.loader is not None
    engine_schemas = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_schemas)
    src = TRTLLM["x-source"]
    assert src["repo"] == "NVIDIA/TensorRT-LLM" and src["path"] == engine_schemas.TRTLLM_SCHEMA
    assert len(src["commit"]) == 40 and TRTLLM["x-version"] == "1.4.0rc0" in TRTLLM["title"]
    text = engine_schemas.without_provenance(TRTLLM)
    assert hashlib.sha256(text.encode()).hexdigest() == src["sha256"] and len(text) == 304056
    assert TRTLLM["additionalProperties"] is False
    # the full schema: every nested config is there, closed like the source
    assert all(d.get("additionalProperties") is False for k, d in TRTLLM["$defs"].items()
               if d.get("type") == "object"), "a nested config accepts unknown keys"
    jsonschema.Draft202012Validator.check_schema({k: v for k, v in TRTLLM.items() if not k.startswith("x-")})


def test_the_schema_checks_can_fail():
    """Each checker rejects an option its engine lacks and a value outside its choices."""
    assert vllm_errors({"tensor-parallel-size": 8, "enable-dp-attention": True, "kv-cache-dtype": "fp9"}) == [
        "--enable-dp-attention: not a vLLM option", "--kv-cache-dtype: 'fp9' not in CacheDType"]
    assert sglang_errors({"tp-size": 8, "enable-dp-attention": True, "kv-cache-dtype": "fp8"}) == [
        "--enable-dp-attention: deprecated in SGLang 0.5.23", "--kv-cache-dtype: 'fp8' not in "
        "['auto', 'fp8_e5m2', 'fp8_e4m3', 'mxfp8', 'bf16', 'bfloat16', 'nvfp4', 'fp4_mx_block16']"]
    errs = trtllm_errors({"tensor_parallel_size": 8, "tp_size": 8, "kv_cache_config": {"tokens_per_block": "x"},
                          "speculative_config": {"decoding_type": "MTP", "num_draft": 1}})
    assert any("tp_size" in e for e in errs) and any("tokens_per_block" in e for e in errs)
    assert any("num_draft" in e for e in errs)


@pytest.mark.parametrize("model", V4)
@pytest.mark.parametrize(("gpus", "engine"), [("8xH200", "vllm"), ("8xH200", "sglang"), ("8xB200", "vllm"),
                                              ("8xB200", "sglang"), ("8xB200", "trtllm")])
def test_v4_configs_pass_the_engine_schema(model, gpus, engine, tmp_path):
    from lineside.deploy.compose import write_deployment

    d = build_deployment(model, gpus, engine)
    assert CHECK[engine](d.config) == []
    written = {p.name: p for p in write_deployment(d, tmp_path)}
    on_disk = yaml.safe_load(written[d.config_file].read_text())
    assert on_disk == d.config and CHECK[engine](on_disk) == []
    dc = yaml.safe_load(written["docker-compose.yaml"].read_text())
    engine_svc = dc["services"]["engine"]
    assert f"/config/{d.config_file}" in engine_svc["entrypoint"]
    assert any(v.endswith(f":/config/{d.config_file}:ro") for v in engine_svc["volumes"])
    assert dc["services"]["gateway"]["depends_on"] == {"engine": {"condition": "service_healthy"}}
    assert "http://engine:8000" in dc["services"]["gateway"]["command"][-1]
    # the options that matter for V4, in each engine's spelling
    c = d.config
    if engine == "vllm":
        assert c["kv-cache-dtype"] == "fp8" and c["enable-expert-parallel"] is True
        assert c["speculative-config"]["method"] == "mtp" and c["max-model-len"] == d.plan.max_model_len
        assert c["cudagraph-capture-sizes"] == graph_sizes(c["max-num-seqs"] * 2)
        assert c["scheduling-policy"] == "priority"  # the gateway's body `priority`: lower first
    elif engine == "sglang":
        assert c["kv-cache-dtype"] == "fp8_e4m3" and c["ep-size"] == 8 and c["speculative-algorithm"] == "EAGLE"
        assert c["enable-priority-scheduling"] is True and c["schedule-low-priority-values-first"] is True
    else:
        assert c["kv_cache_config"]["dtype"] == "fp8" and c["moe_expert_parallel_size"] == 8
        assert c["kv_cache_config"]["tokens_per_block"] == 128  # V4 needs 128 or 256 (its README)
        # max_draft_len is the draft length; num_nextn_predict_layers comes from the checkpoint
        assert c["speculative_config"] == {"decoding_type": "MTP", "max_draft_len": 1}
        assert "num_nextn_predict_layers" in TRTLLM["$defs"]["MTPDecodingConfig"]["properties"]
        assert c["custom_tokenizer"] == "deepseek_v4" and c["moe_config"] == {"backend": "TRTLLM"}
        assert_trtllm_takes_whole_context(c)


def assert_trtllm_takes_whole_context(c: dict) -> None:
    """A prompt of max_seq_len tokens must be servable: past max_num_tokens only chunked prefill takes it,
    and the source schema's default for it is off, so the config must say so."""
    assert TRTLLM_PROPS["enable_chunked_prefill"]["default"] is False
    assert c["max_seq_len"] > c["max_num_tokens"] == TRTLLM_PROPS["max_num_tokens"]["default"]
    assert c["enable_chunked_prefill"] is True


@pytest.mark.parametrize("model", DENSE)
@pytest.mark.parametrize(("gpus", "engine"), [("8xH200", "vllm"), ("8xH200", "sglang"), ("8xH200", "trtllm"),
                                              ("8xB200", "trtllm")])
def test_dense_configs_pass_the_engine_schema(model, gpus, engine):
    d = build_deployment(model, gpus, engine)
    assert CHECK[engine](d.config) == []
    assert d.plan.mtp_layers == 0 and "speculative-config" not in d.config and "speculative_config" not in d.config
    if engine == "trtllm":
        assert_trtllm_takes_whole_context(d.config)
    assert sum(len(r.gpu_ids) for r in d.replicas) in (8, d.plan.tp)


def test_trtllm_v4_on_hopper_is_refused_with_the_alternative():
    for model in V4:
        with pytest.raises(LinesideError) as e:
            build_deployment(model, "8xH200", "trtllm")
        msg = str(e.value)
        assert "Blackwell (SM100+) only" in msg and "--engine vllm or --engine sglang" in msg and "8xB200" in msg
    p = run_cli("deploy", "datacenter", "deepseek-v4-flash", "--gpus", "8xH200", "--engine", "trtllm", "-o",
                "/tmp/unused-lineside-dc")
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "SM100+" in p.stderr
    assert not Path("/tmp/unused-lineside-dc").exists()


def test_a_rerun_keeps_files_edited_since(tmp_path):
    """The same deployment again is a no-op; one that would replace a file changed since (an edited config, or
    another engine's launch.sh beside its config) is one line until --force — it was replaced without a word."""
    args = ["deploy", "datacenter", "deepseek-v4-flash", "--gpus", "8xH200", "--engine", "vllm", "-o", tmp_path]
    assert run_cli(*args).returncode == 0
    assert run_cli(*args).returncode == 0  # unchanged: written again, nothing lost
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text(cfg.read_text() + "# tuned by hand\n")
    p = run_cli(*args)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert "vllm.yaml" in p.stderr and "--force" in p.stderr
    assert cfg.read_text().endswith("# tuned by hand\n")
    other = run_cli(*args[:6], "sglang", *args[7:])
    assert other.returncode == 1 and "launch.sh" in other.stderr and not (tmp_path / "sglang.yaml").exists()
    assert run_cli(*args, "--force").returncode == 0
    assert "# tuned by hand" not in cfg.read_text()


def test_what_does_not_fit_is_refused():
    with pytest.raises(LinesideError, match="does not fit 8xH100") as e:
        build_deployment("deepseek-v4-pro", "8xH100", "vllm")
    assert str(e.value).count("does not fit") == 1, str(e.value)  # the planner's note is not repeated word for word
    with pytest.raises(LinesideError, match="COUNTxGPU"):
        build_deployment("deepseek-v4-flash", "8xA7", "vllm")
    with pytest.raises(LinesideError, match="choose vllm, sglang or trtllm"):
        build_deployment("deepseek-v4-flash", "8xH200", "tgi")


def test_memory_math_against_hand_numbers():
    """V4-Flash: experts at 4.25 bits, attention/shared at FP8 + block scales; per-GPU split by EP or DP."""
    p = plan_datacenter("deepseek-v4-flash", "8xH200")
    b = p.breakdown
    # 43 layers x 256 experts x 3 x 4096 x 2048 weights at 4.25 bits
    assert b["routed_experts (MXFP4)"] == int(43 * 256 * 3 * 4096 * 2048 * 4.25 / 8)
    assert 140 * GIB < p.weights_total_bytes < 160 * GIB  # published checkpoint: ~160 GB
    assert p.attention_dp and (p.tp, p.dp, p.ep) == (1, 8, 8)
    experts = b["routed_experts (MXFP4)"]
    assert p.weights_per_gpu_bytes == experts // 8 + (p.weights_total_bytes - experts)
    assert p.max_model_len == 1048576  # compressed V4 KV: a full 1M context fits per rank
    lat = plan_datacenter("deepseek-v4-flash", "8xH200", profile="latency")
    assert not lat.attention_dp and lat.tp == 8 and lat.seqs_at_max_len < p.seqs_at_max_len
    pro = plan_datacenter("deepseek-v4-pro", "8xH200")
    assert not pro.attention_dp and any("attention-DP does not fit" in n for n in pro.notes)
    dense = plan_datacenter("deepseek-r1-distill-qwen-32b", "8xH100")  # 61 GiB of bf16: one H100 holds 32K
    assert dense.tp == 1 and dense.dp == 8 and 32768 <= dense.max_model_len < 131072
    assert plan_datacenter("deepseek-r1-distill-qwen-32b", "8xH200").max_model_len == 131072


COMPOSE_NAME = r"[a-z0-9][a-z0-9_-]*"  # compose-spec 04-version-and-name.md: the top-level `name`


@pytest.mark.parametrize("model", [*V4, *DENSE, "deepseek-r1-distill-qwen-7b"])
def test_the_compose_project_name_is_one_compose_accepts(model):
    """docker compose refuses the whole file for a project name with a dot (Qwen-1.5B) or a capital."""
    import re

    from lineside.deploy.compose import compose

    d = build_deployment(model, "8xH200", "vllm")
    name = compose(d)["name"]
    assert re.fullmatch(COMPOSE_NAME, name), name
    assert name.startswith("lineside-deepseek-")


def test_a_checkpoint_directory_is_served_from_its_own_name(tmp_path):
    """A Hugging Face checkpoint directory (or its config.json): the engine loads MODEL_DIR/<its name> and serves
    it under that name (a guard beside the bundle refusal below, which shares the path handling)."""
    import shutil

    from lineside.jetson.planner import CONFIGS_DIR

    ckpt = tmp_path / "My-Qwen2.5-7B"
    ckpt.mkdir()
    shutil.copy(CONFIGS_DIR / "DeepSeek-R1-Distill-Qwen-7B" / "config.json", ckpt / "config.json")
    for model in (ckpt, ckpt / "config.json"):
        d = build_deployment(str(model), "2xH100", "vllm", model_dir="/ckpts/")
        assert d.config["model"] == "/ckpts/My-Qwen2.5-7B" and d.config["served-model-name"] == "my-qwen2.5-7b"
        assert vllm_errors(d.config) == []
        s = build_deployment(str(model), "2xH100", "sglang")
        assert s.config["model-path"] == "/models/My-Qwen2.5-7B" and sglang_errors(s.config) == []


def test_a_bundle_or_gguf_is_refused_in_one_line(tmp_path):
    """The engines load Hugging Face checkpoints, never lineside's INT4 bundle nor a GGUF: one line, no files."""
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for model in (bundle, bundle / "manifest.json", gguf):
        out = tmp_path / "out"
        p = run_cli("deploy", "datacenter", model, "--gpus", "1xH100", "--engine", "vllm", "-o", out)
        assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
        assert "Hugging Face checkpoint" in p.stderr and "Traceback" not in p.stderr
        assert not out.exists()
