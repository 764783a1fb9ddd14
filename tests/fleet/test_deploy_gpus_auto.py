"""`deploy datacenter --gpus auto`: the host's GPUs from nvidia-smi (a fake one on PATH here), mapped to the kinds
lineside sizes; an unknown GPU, a mix, no nvidia-smi or a failing one is one line asking for --gpus COUNTxKIND."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lineside.deploy.detect import detect_gpus
from lineside.deploy.engines import build_deployment
from lineside.errors import LinesideError
from tests.cli.cli_run import assert_one_line_error, run_cli

H100 = "NVIDIA H100 80GB HBM3, 81559 MiB"
H200 = "NVIDIA H200, 143771 MiB"
B200 = "NVIDIA B200, 183359 MiB"


def fake_smi(bin_dir: Path, out: str, rc: int = 0, err: str = "") -> Path:
    """An nvidia-smi that prints ``out`` only when asked exactly what detect_gpus asks (else exit 9)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "out.txt").write_text(out)
    (bin_dir / "err.txt").write_text(err)
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$*" = "--query-gpu=name,memory.total --format=csv,noheader" ] || exit 9\n'
                   f'cat "{bin_dir}/out.txt"; cat "{bin_dir}/err.txt" >&2; exit {rc}\n')
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.fixture
def smi_path(tmp_path, monkeypatch):
    """Point PATH at a directory holding only the fake nvidia-smi (and sh for it), so no real one is found."""
    def use(out: str, rc: int = 0, err: str = "") -> Path:
        d = fake_smi(tmp_path / "bin", out, rc, err)
        monkeypatch.setenv("PATH", f"{d}{os.pathsep}/bin{os.pathsep}/usr/bin")
        return d
    return use


@pytest.mark.parametrize(("lines", "label"), [
    ([H100] * 3, "3xH100"),
    ([H200] * 8, "8xH200"),
    (["NVIDIA H100 NVL, 95830 MiB"] * 2, "2xH100"),  # more memory than the 80 GB part: planned as H100
    (["NVIDIA H200 NVL, 143771 MiB"] * 4, "4xH200"),
    ([B200] * 6, "6xB200"),
])
def test_the_hosts_gpus_become_count_x_kind(smi_path, lines, label):
    smi_path("\n".join(lines) + "\n")
    assert detect_gpus() == label


@pytest.mark.parametrize(("out", "rc", "err", "needle"), [
    ("", 0, "", "lists no GPUs"),
    ("NVIDIA A100-SXM4-80GB, 81920 MiB\n", 0, "", "GPU 0 is 'NVIDIA A100-SXM4-80GB'"),
    ("NVIDIA GH200 480GB, 97871 MiB\n", 0, "", "not a kind lineside sizes"),
    ("NVIDIA H100 80GB HBM3, 40000 MiB\n", 0, "", "not a kind lineside sizes"),  # less memory than an H100 has
    (f"{H100}\n{H200}\n{H200}\n", 0, "", "mixed GPU kinds (1xH100, 2xH200)"),
    ("\n".join([H200] * 16) + "\n", 0, "", "16 GPUs; one node plans 1 to 8: pass --gpus 8xH200"),
    ("", 9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "exit 9: NVIDIA-SMI"),
    ("garbage without a comma\n", 0, "", "cannot read nvidia-smi's line"),
])
def test_what_auto_cannot_take_is_one_line_asking_for_count_x_kind(smi_path, out, rc, err, needle):
    smi_path(out, rc, err)
    with pytest.raises(LinesideError) as e:
        detect_gpus()
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("--gpus auto: "), msg
    assert "pass --gpus " in msg


def test_no_nvidia_smi_on_path_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(LinesideError, match=r"^--gpus auto: nvidia-smi is not on PATH .*pass --gpus COUNTxKIND"):
        detect_gpus()


def test_auto_plans_the_detected_set_and_says_so(smi_path):
    smi_path("\n".join([H200] * 6) + "\n")
    d = build_deployment("deepseek-v4-flash", "auto", "vllm")
    assert d.gpus == "6xH200" and d.notes[0] == "--gpus auto: nvidia-smi lists 6xH200"
    assert [r.gpu_ids for r in d.replicas] == [[0, 1], [2, 3], [4, 5]]  # as --gpus 6xH200 plans it
    assert d.config == build_deployment("deepseek-v4-flash", "6xH200", "vllm").config


def test_the_cli_takes_auto_and_refuses_a_mix_in_one_line(tmp_path):
    d = fake_smi(tmp_path / "bin", "\n".join([H100] * 4) + "\n")
    env = {**os.environ, "PATH": f"{d}{os.pathsep}{os.environ.get('PATH', '')}"}
    ok = run_cli("deploy", "datacenter", "deepseek-v4-flash", "--gpus", "auto", "--engine", "sglang",
                 "-o", tmp_path / "out", env=env)
    assert ok.returncode == 0, ok.stderr
    assert "on 4xH100 with sglang" in ok.stdout and "note: --gpus auto: nvidia-smi lists 4xH100" in ok.stdout
    fake_smi(tmp_path / "bin", f"{H100}\n{B200}\n")
    bad = run_cli("deploy", "datacenter", "deepseek-v4-flash", "--gpus", "auto", "--engine", "sglang",
                  "-o", tmp_path / "bad", env=env)
    assert_one_line_error(bad, "--gpus auto: mixed GPU kinds (1xH100, 1xB200)", code=1)
    assert not (tmp_path / "bad").exists()
