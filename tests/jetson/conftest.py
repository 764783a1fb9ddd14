"""Shared helpers for the jetson tests: small real bundles and an sshd on loopback."""

from __future__ import annotations

import getpass
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lineside.bundle import Manifest, write_manifest
from lineside.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def make_bundle(path: Path, seed: int, weight_bytes: int = 3 << 20, name: str = "tiny") -> Path:
    """A bundle with random 'weights', a tokenizer file and a config, hashed by write_manifest."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    (path / "model.onnx.data").write_bytes(rng.integers(0, 256, weight_bytes, dtype=np.uint8).tobytes())
    (path / "tokenizer").mkdir()
    (path / "tokenizer" / "tokenizer.json").write_text(json.dumps({"version": "1.0", "seed": seed}))
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, name=name)
    (path / "config.json").write_text(cfg.to_json())
    write_manifest(path, Manifest(architecture="llama", config="config.json", max_seq_len=128, extra={"name": name},
                                  flavors={}, quantization={"scheme": "w4a16"}))
    return path


@pytest.fixture
def bundle_factory():
    """make_bundle(path, seed, weight_bytes=..., name=...)."""
    return make_bundle


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_device_python(bin_dir: Path, lineside: Path | None = REPO, name: str = "python3") -> Path:
    """`bin_dir/name`: this test's Python seeing only the lineside under ``lineside`` (None: none at all), and
    `bin_dir/lineside`, a console script run by it, as pip writes them."""
    run = f"PYTHONPATH={shlex.quote(str(lineside))} exec {shlex.quote(sys.executable)}" if lineside else \
        f"exec {shlex.quote(sys.executable)} -S"  # -S: not even the venv's installed lineside
    exe = _script(bin_dir / name, f"#!/bin/sh\n{run} \"$@\"\n")
    # pip's shebang, or for a path a shebang cannot hold (one with a blank) its /bin/sh trampoline
    bang = (f"#!/bin/sh\n'''exec' {shlex.quote(str(exe))} \"$0\" \"$@\"\n' '''\n" if " " in str(exe)
            else f"#!{exe}\n")
    _script(bin_dir / "lineside", f"{bang}import sys\nfrom lineside.cli import main\nsys.exit(main())\n")
    return exe


def fake_systemctl(bin_dir: Path, exec_start: str) -> Path:
    """`systemctl` on the device's PATH whose `cat lineside.service` shows a unit running ``exec_start``."""
    unit = f"# /etc/systemd/system/lineside.service\n[Service]\nExecStart={exec_start}\n"
    return _script(bin_dir / "systemctl", f"#!/bin/sh\n[ \"$1 $2\" = 'cat lineside.service' ] || exit 1\n"
                                          f"cat <<'EOF'\n{unit}EOF\n")


@pytest.fixture
def sshd(sshd_device):
    """(user@127.0.0.1, ssh command) of a loopback sshd whose device PATH has a python3 with this lineside."""
    return sshd_device[:2]


@pytest.fixture
def sshd_device(tmp_path_factory):
    """Start sshd on 127.0.0.1 with a throwaway key; yields (user@127.0.0.1, ssh command, bin dir first on the ssh
    session's PATH, holding a python3 with this checkout's lineside). Skips if it can't."""
    exe = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    if exe is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("openssh-server/openssh-client not installed (apt-get install openssh-server)")
    if shutil.which("rsync") is None:
        pytest.skip("rsync not installed (apt-get install rsync)")
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    (d / "authorized_keys").chmod(0o600)
    (d / "bin").mkdir()
    fake_device_python(d / "bin")
    if not os.path.isdir("/run/sshd"):
        try:
            os.makedirs("/run/sshd", mode=0o755)
        except OSError:
            pytest.skip("sshd needs its privilege-separation directory /run/sshd and it cannot be created")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nPermitRootLogin prohibit-password\n"
        f"SetEnv PATH={d / 'bin'}:/usr/local/bin:/usr/bin:/bin\n"
    )
    proc = subprocess.Popen([exe, "-D", "-e", "-f", str(d / "sshd_config")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    ssh = (f"ssh -p {port} -i {d / 'client_key'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
           "-o LogLevel=ERROR -o ConnectTimeout=5")
    host = f"{getpass.getuser()}@127.0.0.1"
    deadline = time.monotonic() + 10
    while True:
        ok = subprocess.run([*ssh.split(), "-o", "BatchMode=yes", host, "true"], capture_output=True, text=True)
        if ok.returncode == 0:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0] if proc.poll() is not None else ""
            pytest.skip(f"sshd could not be started on loopback: {(out or ok.stderr).strip()[-200:]}")
        time.sleep(0.2)
    yield host, ssh, d / "bin"
    proc.terminate()
    proc.wait(timeout=10)
