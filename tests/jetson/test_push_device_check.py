"""`jetson push` over ssh asks the device's lineside (the one lineside.service runs) whether it can open the bundle,
and refuses before copying when it cannot; the device is a loopback sshd with fake Pythons on its PATH."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from lineside.bundle import FORMAT_VERSION, Manifest
from lineside.errors import LinesideError
from lineside.jetson.device_runtime import MIN_PYTHON, DeviceRuntime, Source, interpreter_of, refusal
from lineside.jetson.push import push, rollback
from tests.cli.cli_run import REPO, assert_one_line_error, run_cli, tree_snapshot
from tests.jetson.conftest import _script, fake_device_python, fake_systemctl


def _old_lineside(root: Path, version: str = "0.1.0", reads: int = 0) -> Path:
    """A lineside package as an older release would be: its own version and format, refusing a newer bundle."""
    pkg = root / "lineside"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "bundle.py").write_text(
        "import json, os\n"
        f"FORMAT_VERSION = {reads}\n"
        "def read_manifest(d):\n"
        "    fv = json.load(open(os.path.join(d, 'manifest.json')))['format_version']\n"
        "    if fv != FORMAT_VERSION:\n"
        "        raise ValueError('%s: bundle format %r, this lineside reads %d; rebuild the bundle'\n"
        "                         % (os.path.join(d, 'manifest.json'), fv, FORMAT_VERSION))\n")
    return root


def _old_python(bin_dir: Path, version: str = "3.8.10") -> Path:
    """A python3 as JetPack 5 ships it: answers the probe with its version, and its lineside would not import."""
    parts = [int(x) for x in version.split(".")]
    out = json.dumps({"python": parts, "import_error": "SyntaxError: invalid syntax"})
    exe = _script(bin_dir / "python3", f"#!/bin/sh\ncat >/dev/null\necho '{out}'\n")
    _script(bin_dir / "lineside", f"#!{exe}\nimport sys\n")
    return exe


def _cli_push(bundle: Path, target: str, ssh: str, *extra: str):
    return run_cli("jetson", "push", bundle, target, "--ssh", ssh, *extra)


def test_min_python_is_the_one_pyproject_requires():
    req = re.search(r'^requires-python = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert req and req.group(1) == ">=" + ".".join(map(str, MIN_PYTHON))


@pytest.mark.parametrize("head, interp", [
    ("#!/opt/lineside/venv/bin/python3\nimport sys\n", ("/opt/lineside/venv/bin/python3",)),
    ("#!/usr/bin/env python3.10\n", ("/usr/bin/env", "python3.10")),
    ("#!/usr/bin/env -S python3 -E\n", ("/usr/bin/env", "-S", "python3")),
    ("#!/opt/my venv/bin/python3\n", None),  # the kernel runs /opt/my with one argument: pip never writes it
    ("#!/bin/sh\n'''exec' \"/very/long/venv path/bin/python\" \"$0\" \"$@\"\n' '''\n", ("/very/long/venv path/bin/python",)),
    ("#!/bin/sh\nexec /opt/venv/bin/lineside \"$@\"\n", None),  # a shell wrapper: which Python is not said
    ("\x7fELF\x02\x01", None),
])
def test_interpreter_of_a_console_script(head, interp):
    assert interpreter_of(head) == interp


def test_a_device_lineside_reading_an_older_format_is_refused_with_the_upgrade_command():
    m = Manifest(architecture="llama", config="config.json", max_seq_len=8, lineside_version="0.2.0")
    rt = DeviceRuntime(("/opt/venv/bin/python3",), Source.UNIT, (3, 10, 12), "0.1.5", FORMAT_VERSION - 1)
    line = refusal(rt, m, "orin:/opt/lineside")
    assert line and "\n" not in line
    assert f"bundle format {FORMAT_VERSION - 1}" in line
    assert "`/opt/venv/bin/python3 -m pip install -U 'lineside>=0.2.0'`" in line
    ok = DeviceRuntime(("/opt/venv/bin/python3",), Source.UNIT, (3, 10, 12), "0.2.0", FORMAT_VERSION)
    assert refusal(ok, m, "orin:/opt/lineside") is None


def test_a_device_without_lineside_is_refused_before_copying_and_force_pushes_anyway(tmp_path, sshd_device,
                                                                                    bundle_factory):
    host, ssh, bin_dir = sshd_device
    py = fake_device_python(tmp_path / "venv" / "bin", lineside=None)  # a venv lineside was never installed into
    fake_systemctl(bin_dir, f"{py} -m lineside serve /opt/lineside/current")
    a = bundle_factory(tmp_path / "a", 1)
    device = tmp_path / "device"
    target = f"{host}:{device}"

    p = _cli_push(a, target, ssh)
    line = assert_one_line_error(p, "has no lineside", f"{py} -m pip install -U 'lineside>=", "--force")
    assert "nothing was copied" in line
    assert tree_snapshot(device) == set()  # not even versions/ or the lock

    p = _cli_push(a, target, ssh, "--force", "--json")
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("warning: pushed anyway (--force): ") and "has no lineside" in p.stderr
    r = json.loads(p.stdout)
    assert os.readlink(device / "current") == f"versions/{r['version']}"
    assert "has no lineside" in r["device_warning"] and r["device"].startswith("lineside none on Python ")
    p = _cli_push(a, target, ssh, "--force")  # already installed: still checked, still said
    assert p.returncode == 0 and "already installed" in p.stdout and "has no lineside" in p.stderr
    assert "  device runtime: lineside none on Python " in p.stdout and "ExecStart of lineside.service" in p.stdout


def test_an_unsupported_python_on_the_device_is_refused(tmp_path, sshd_device, bundle_factory):
    host, ssh, bin_dir = sshd_device
    _old_python(bin_dir, "3.8.10")
    a = bundle_factory(tmp_path / "a", 2)
    with pytest.raises(LinesideError) as e:
        push(a, f"{host}:{tmp_path / 'device'}", ssh=ssh)
    msg = str(e.value)
    assert "Python 3.8.10" in msg and "needs Python >= 3.10" in msg and "`python3.10 -m pip install 'lineside>=" in msg
    assert not (tmp_path / "device").exists()


def test_a_device_lineside_too_old_for_the_bundle_keeps_the_running_version(tmp_path, sshd_device, bundle_factory):
    host, ssh, bin_dir = sshd_device
    a, b = bundle_factory(tmp_path / "a", 3, name="model-a"), bundle_factory(tmp_path / "b", 4, name="model-b")
    device = tmp_path / "device"
    target = f"{host}:{device}"
    r1 = push(a, target, ssh=ssh)
    assert r1.device and r1.device.startswith("lineside 0.2.0 on Python ") and r1.device_warning is None

    py = fake_device_python(bin_dir, lineside=_old_lineside(tmp_path / "old"))  # the device was downgraded
    before = tree_snapshot(device)
    with pytest.raises(LinesideError) as e:
        push(b, target, ssh=ssh)
    msg = str(e.value)
    assert re.search(r"has lineside 0\.1\.0 .*cannot open this bundle \(manifest\.json: bundle format 1, this "
                     r"lineside reads 0", msg), msg
    assert f"`{py} -m pip install -U 'lineside>=" in msg and str(tmp_path / "tmp") not in msg
    assert tree_snapshot(device) == before and os.readlink(device / "current") == f"versions/{r1.version}"
    with pytest.raises(LinesideError, match="cannot open this bundle"):  # nor is it switched back onto an old copy
        push(a, target, ssh=ssh)


def test_the_interpreter_the_unit_runs_is_asked_not_the_one_on_path(tmp_path, sshd_device, bundle_factory):
    """PATH's python3 has a current lineside; the unit runs a venv whose lineside is old: the venv decides."""
    host, ssh, bin_dir = sshd_device
    venv = tmp_path / "opt venv" / "bin"
    venv_py = fake_device_python(venv, lineside=_old_lineside(tmp_path / "old"))
    fake_systemctl(bin_dir, f'"{venv / "lineside"}" serve /opt/lineside/current --port 8000 $LINESIDE_SERVE_ARGS')
    a = bundle_factory(tmp_path / "a", 5)
    target = f"{host}:{tmp_path / 'device'}"
    with pytest.raises(LinesideError) as e:
        push(a, target, ssh=ssh)
    assert "has lineside 0.1.0" in str(e.value) and "ExecStart of lineside.service" in str(e.value)
    assert f"'{venv_py}' -m pip install -U" in str(e.value)

    fake_device_python(venv)  # the venv upgraded; PATH's python3 now has none: the push goes through
    fake_device_python(bin_dir, lineside=None)
    r = push(a, target, ssh=ssh)
    assert r.device == f"lineside 0.2.0 on Python {r.device.split()[4]} ('{venv_py}', the ExecStart of lineside.service)"


def test_a_unit_running_a_missing_lineside_is_refused(tmp_path, sshd_device, bundle_factory):
    host, ssh, bin_dir = sshd_device
    fake_systemctl(bin_dir, "-/opt/gone/bin/lineside serve /opt/lineside/current")
    with pytest.raises(LinesideError) as e:
        push(bundle_factory(tmp_path / "a", 6), f"{host}:{tmp_path / 'device'}", ssh=ssh)
    assert "has no /opt/gone/bin/lineside" in str(e.value)
    assert "`/opt/gone/bin/python3 -m pip install -U 'lineside>=" in str(e.value)


def _fake_docker(bin_dir: Path, python: Path, mounts: list[str]) -> None:
    """`docker` with one running container mounting ``mounts``, whose python3 is ``python``."""
    listed = "\\t".join(["c0ffee0123456789", *mounts])
    _script(bin_dir / "docker", "#!/bin/sh\ncase \"$1\" in\n  ps) echo c0ffee012345 ;;\n"
                                f"  inspect) printf '{listed}\\n' ;;\n"
                                f"  exec) shift 4; exec '{python}' \"$@\" ;;\n  *) exit 1 ;;\nesac\n")


def test_a_container_serving_the_target_is_asked(tmp_path, sshd_device, bundle_factory):
    """Dockerfile.jetson's way: no unit, no lineside on the host; the container mounting TARGET decides."""
    host, ssh, bin_dir = sshd_device
    device = tmp_path / "device"
    image_py = fake_device_python(tmp_path / "image" / "bin", lineside=_old_lineside(tmp_path / "old"))
    _fake_docker(bin_dir, image_py, ["/var/lib/other", f"{device}/versions/tiny-abc"])
    a = bundle_factory(tmp_path / "a", 7)
    with pytest.raises(LinesideError) as e:
        push(a, f"{host}:{device}", ssh=ssh)
    msg = str(e.value)
    assert "has lineside 0.1.0 (docker exec -i c0ffee0123456789 python3, the container serving it)" in msg
    assert "docker build -f Dockerfile.jetson -t lineside:jetson ." in msg and "pip install" not in msg

    _fake_docker(bin_dir, image_py, [str(tmp_path / "elsewhere")])  # a container serving another directory
    r = push(a, f"{host}:{device}", ssh=ssh)
    assert r.device and "`lineside` on the ssh PATH" in r.device


def test_rollback_to_a_version_the_upgraded_device_cannot_open_is_refused_and_force_rolls_back(
        tmp_path, sshd_device, bundle_factory):
    """The device's lineside was upgraded past the old version's bundle format: switching back onto it would leave
    the service unable to start, so rollback refuses it as push would, naming the rebuild, until --force."""
    host, ssh, bin_dir = sshd_device
    a, b = bundle_factory(tmp_path / "a", 8, name="model-a"), bundle_factory(tmp_path / "b", 9, name="model-b")
    device = tmp_path / "device"
    target = f"{host}:{device}"
    r1, r2 = push(a, target, ssh=ssh), push(b, target, ssh=ssh)
    rb = rollback(target, ssh=ssh)  # the device can open it: switched, and the runtime it asked is said
    assert rb.current == f"versions/{r1.version}" and rb.device_warning is None and "lineside 0.2.0" in rb.device
    rollback(target, ssh=ssh)  # back on b

    fake_device_python(bin_dir, lineside=_old_lineside(tmp_path / "new", "9.0.0", reads=FORMAT_VERSION + 1))
    p = run_cli("jetson", "rollback", target, "--ssh", ssh)
    line = assert_one_line_error(p, f"cannot roll back to versions/{r1.version}", "has lineside 9.0.0",
                                 f"bundle format {FORMAT_VERSION}, this lineside reads {FORMAT_VERSION + 1}",
                                 "rebuild the bundle with lineside 9.0.0", "nothing was switched", "--force")
    assert "pip install" not in line  # the device is newer than the bundle: upgrading it would not help
    assert os.readlink(device / "current") == f"versions/{r2.version}"

    p = run_cli("jetson", "rollback", target, "--ssh", ssh, "--force")
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("warning: rolled back anyway (--force): ") and "has lineside 9.0.0" in p.stderr
    assert f"current -> versions/{r1.version}; previous -> versions/{r2.version}" in p.stdout
    assert os.readlink(device / "current") == f"versions/{r1.version}"


def test_push_and_rollback_say_the_restart_that_serves_the_switched_version(tmp_path, sshd_device, bundle_factory):
    """lineside.service keeps the bundle it opened: a switch says the exact restart command (over the same ssh)
    and the rollback that undoes it; a push that switched nothing says nothing of a restart."""
    import shlex

    host, ssh, bin_dir = sshd_device
    fake_systemctl(bin_dir, f"{bin_dir / 'lineside'} serve /opt/lineside/current")
    a, b = bundle_factory(tmp_path / "a", 10, name="model-a"), bundle_factory(tmp_path / "b", 11, name="model-b")
    target = f"{host}:{tmp_path / 'device'}"
    restart = f"`{shlex.join([*shlex.split(ssh), host])} sudo systemctl restart lineside`"
    back = f"`{shlex.join(['lineside', 'jetson', 'rollback', target, '--ssh', ssh])}`"

    p = _cli_push(a, target, ssh)
    assert p.returncode == 0, p.stderr
    note = p.stdout.splitlines()[-1]
    assert note == (f"  the running server keeps the old bundle until restarted: {restart}; if it does not come "
                    f"back ready, {back} and restart it again")
    assert "restart" not in _cli_push(a, target, ssh).stdout  # already current: the server already serves it
    assert json.loads(_cli_push(b, target, ssh, "--json").stdout)["restart"] == restart.strip("`")

    p = run_cli("jetson", "rollback", target, "--ssh", ssh)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == (f"  the running server keeps the old bundle until restarted: {restart}; if "
                                         f"it does not come back ready, {back} undoes the rollback")

    device = tmp_path / "device2"  # the Dockerfile.jetson way: the container is restarted, not a unit
    fake_systemctl(bin_dir, "")
    _fake_docker(bin_dir, fake_device_python(tmp_path / "image" / "bin"), [f"{device}/current"])
    p = _cli_push(a, f"{host}:{device}", ssh)
    assert p.returncode == 0, p.stderr
    assert f"{host} docker restart c0ffee012345`;" in p.stdout.splitlines()[-1]

    local = tmp_path / "mounted"  # which server serves a local directory is not known here: said as much
    p = run_cli("jetson", "push", a, local)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1].startswith(f"  the running server keeps the old bundle until restarted: "
                                                f"restart the server that serves {local}/current; ")
