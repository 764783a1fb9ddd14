"""Push / rollback to a local directory and to an ssh target on loopback."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lineside.bundle import open_bundle
from lineside.errors import BundleError, LinesideError
from lineside.jetson.push import push, rollback
from tests.cli.cli_run import run_cli


class Interrupted(Exception):
    pass


def _interrupt_after(limit: int):
    seen = 0

    def progress(n: int) -> None:
        nonlocal seen
        seen += n
        if seen >= limit:
            raise Interrupted

    return progress


def _corrupt(path: Path, offset: int = 100) -> None:
    """Flip one byte, keeping the size (a size check alone would miss it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_local_push_activates_and_keeps_previous(tmp_path, bundle_factory):
    a, b = bundle_factory(tmp_path / "a", 1, name="model-a"), bundle_factory(tmp_path / "b", 2, name="model-b")
    target = tmp_path / "device"
    r1 = push(a, str(target))
    assert not r1.already_installed and r1.bytes_sent == r1.bytes_total and r1.previous is None
    assert os.readlink(target / "current") == f"versions/{r1.version}"
    assert r1.version.startswith("model-a-")
    assert open_bundle(target / "current").config.name == "model-a"  # every sha256 re-checked

    r2 = push(b, str(target))
    assert r2.previous == f"versions/{r1.version}"
    assert os.readlink(target / "current") == f"versions/{r2.version}"
    assert os.readlink(target / "previous") == f"versions/{r1.version}"

    again = push(b, str(target))  # same bundle: nothing copied, stays current
    assert again.already_installed and again.bytes_sent == 0 and again.version == r2.version

    rb = rollback(str(target))
    assert open_bundle(target / "current").config.name == "model-a"
    assert (rb.current, rb.previous) == (f"versions/{r1.version}", f"versions/{r2.version}")
    rollback(str(target))  # rolling back twice returns to the newer one
    assert open_bundle(target / "current").config.name == "model-b"
    assert sorted(p.name for p in (target / "versions").iterdir()) == sorted([r1.version, r2.version])


def test_local_push_resumes_an_interrupted_copy(tmp_path, bundle_factory):
    a = bundle_factory(tmp_path / "a", 3, weight_bytes=6 << 20)
    target = tmp_path / "device"
    with pytest.raises(Interrupted):
        push(a, str(target), progress=_interrupt_after(3 << 20))
    assert not (target / "current").exists()
    staged = list((target / "versions").glob(".incoming-*/model.onnx.data"))
    assert len(staged) == 1 and 0 < staged[0].stat().st_size < 6 << 20
    already = sum(f.stat().st_size for f in staged[0].parent.rglob("*") if f.is_file())

    r = push(a, str(target))
    assert r.resumed_files == 1
    assert r.bytes_sent == r.bytes_total - already  # only the rest was copied
    assert open_bundle(target / "current").config.name == "tiny"
    assert not list((target / "versions").glob(".incoming-*"))


def test_local_push_recopies_a_corrupted_partial_file(tmp_path, bundle_factory):
    a = bundle_factory(tmp_path / "a", 4, weight_bytes=4 << 20)
    target = tmp_path / "device"
    with pytest.raises(Interrupted):
        push(a, str(target), progress=_interrupt_after(2 << 20))
    _corrupt(next((target / "versions").glob(".incoming-*/model.onnx.data")))
    r = push(a, str(target))  # the appended file fails its sha256, is fetched again, then passes
    assert open_bundle(target / "current") is not None
    assert r.bytes_sent > r.bytes_total - (2 << 20)


def test_local_push_refuses_a_corrupt_bundle_and_keeps_current(tmp_path, bundle_factory):
    good, bad = bundle_factory(tmp_path / "good", 5), bundle_factory(tmp_path / "bad", 6, name="bad")
    target = tmp_path / "device"
    r = push(good, str(target))
    _corrupt(bad / "model.onnx.data")
    with pytest.raises(BundleError) as e:
        push(bad, str(target))
    assert "model.onnx.data" in str(e.value) and "nothing was activated" in str(e.value)
    assert os.readlink(target / "current") == f"versions/{r.version}"
    assert [p.name for p in (target / "versions").iterdir() if not p.name.startswith(".")] == [r.version]


def test_rollback_without_previous_and_bad_inputs(tmp_path, bundle_factory):
    target = tmp_path / "device"
    push(bundle_factory(tmp_path / "a", 7), str(target))
    with pytest.raises(LinesideError, match="no previous version"):
        rollback(str(target))
    with pytest.raises(BundleError, match="not a lineside bundle"):
        push(tmp_path, str(target))
    (tmp_path / "file").write_text("x")
    with pytest.raises(LinesideError, match="not a directory"):
        push(tmp_path / "a", str(tmp_path / "file"))


@pytest.mark.parametrize("inside", ["", "graphs"])
def test_a_target_in_the_bundle_is_refused(tmp_path, bundle_factory, inside):
    # the push wrote versions/ (a whole copy) and current into the bundle being pushed
    a = bundle_factory(tmp_path / "a", 9)
    (a / "graphs").mkdir(exist_ok=True)
    before = sorted(p.name for p in a.rglob("*"))
    with pytest.raises(LinesideError, match="inside the bundle") as e:
        push(a, str(a / inside) if inside else str(a))
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in a.rglob("*")) == before
    assert push(a, str(tmp_path)).files > 0  # the bundle's parent is a fine target (versions/ beside it)


@pytest.mark.parametrize("target", ["user@host:", "orin:", "user@:/opt/lineside"])
def test_an_ssh_target_without_a_directory_or_host_is_refused(tmp_path, bundle_factory, target, monkeypatch):
    # "user@host:" (scp's home-directory form) was taken for a local directory of that name: the bundle was
    # pushed into ./user@host: on this machine
    a = bundle_factory(tmp_path / "a", 10)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LinesideError, match="user@host:/opt/lineside") as e:
        push(a, target)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    p = run_cli("jetson", "push", a, target, cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "user@host:/opt/lineside" in p.stderr, p.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_cli_push_and_rollback_errors(tmp_path, bundle_factory):
    a = bundle_factory(tmp_path / "a", 8)
    p = run_cli("jetson", "push", a, tmp_path / "dev")
    assert p.returncode == 0 and "current -> versions/tiny-" in p.stdout, p.stderr
    p = run_cli("jetson", "rollback", tmp_path / "dev")
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and p.stderr.startswith("error: ")


def test_ssh_push_resume_verify_and_rollback(tmp_path, sshd, bundle_factory):
    host, ssh = sshd
    a = bundle_factory(tmp_path / "a", 9, weight_bytes=4 << 20, name="model-a")
    b = bundle_factory(tmp_path / "b", 10, name="model-b")
    device = tmp_path / "device"
    target = f"{host}:{device}"

    # An interrupted rsync --partial leaves the first part of a file in the staging dir; fake that.
    r_probe = push(a, str(tmp_path / "scratch"))  # learn the staging name (manifest hash) locally
    staging = device / "versions" / f".incoming-{r_probe.version.split('-')[-2]}"
    staging.mkdir(parents=True)
    data = (a / "model.onnx.data").read_bytes()
    (staging / "model.onnx.data").write_bytes(data[: len(data) // 2])

    r1 = push(a, target, ssh=ssh)
    assert r1.bytes_sent < r1.bytes_total - len(data) // 3  # the first half was not sent again
    assert os.readlink(device / "current") == f"versions/{r1.version}"
    assert open_bundle(device / "current").config.name == "model-a"

    bad = bundle_factory(tmp_path / "bad", 11, name="bad")
    _corrupt(bad / "model.onnx.data")
    with pytest.raises(BundleError, match="model.onnx.data"):
        push(bad, target, ssh=ssh)
    assert os.readlink(device / "current") == f"versions/{r1.version}"

    r2 = push(b, target, ssh=ssh)
    assert r2.previous == f"versions/{r1.version}"
    assert open_bundle(device / "current").config.name == "model-b"

    rollback(target, ssh=ssh)
    assert open_bundle(device / "current").config.name == "model-a"
    assert os.readlink(device / "previous") == f"versions/{r2.version}"


def test_ssh_unreachable_is_one_line(tmp_path, bundle_factory):
    a = bundle_factory(tmp_path / "a", 12)
    with pytest.raises(LinesideError) as e:
        push(a, "nobody@127.0.0.1:/tmp/x", ssh="ssh -p 1 -o ConnectTimeout=3")
    assert "cannot reach" in str(e.value) and "\n" not in str(e.value)


def test_push_refuses_a_bundle_the_device_disk_cannot_hold(tmp_path, bundle_factory, monkeypatch):
    # rsync filled the device's disk under the running bundle and stopped with "run push again to resume"
    import shutil

    a, b = bundle_factory(tmp_path / "a", 13), bundle_factory(tmp_path / "b", 14, weight_bytes=4 << 20)
    dev = tmp_path / "dev"
    r1 = push(a, str(dev))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=3 << 20))
    with pytest.raises(LinesideError, match="has 3 MiB free but the bundle needs 4 MiB more") as e:
        push(b, str(dev))
    assert "\n" not in str(e.value) and os.readlink(dev / "current") == f"versions/{r1.version}"
    assert not list((dev / "versions").glob(".incoming-*/*"))  # nothing was copied
    with pytest.raises(Interrupted):  # a resume needs room only for what is still missing
        monkeypatch.setattr(shutil, "disk_usage", real)
        push(b, str(dev), progress=_interrupt_after(2 << 20))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=3 << 20))
    assert push(b, str(dev)).previous == f"versions/{r1.version}"


def test_ssh_target_reads_the_device_free_space(tmp_path, sshd):
    import shutil

    from lineside.jetson.targets import SshTarget

    host, ssh = sshd
    (tmp_path / "dev" / "versions" / ".incoming-x").mkdir(parents=True)
    (tmp_path / "dev" / "versions" / ".incoming-x" / "w").write_bytes(b"1" * (1 << 20))
    t = SshTarget(host, str(tmp_path / "dev"), ssh)
    try:
        free, have = t.space(".incoming-x")
        assert abs(free - shutil.disk_usage(tmp_path).free) < 256 << 20 and 1 << 20 <= have < 2 << 20
        assert t.space(".incoming-none")[1] == 0
    finally:
        t.close()


@pytest.mark.parametrize(("target", "host", "root", "rsync_dest"), [
    ("jetson@[fe80::1%eth0]:/opt/lineside", "jetson@fe80::1%eth0", "/opt/lineside", "jetson@[fe80::1%eth0]:"),
    ("[::1]:/opt/lineside", "::1", "/opt/lineside", "[::1]:"),
    ("ssh://jetson@orin-01:2222/opt/my%20dir", "jetson@orin-01", "/opt/my dir", "jetson@orin-01:"),
    ("ssh://jetson@[fe80::1]/opt/lineside", "jetson@fe80::1", "/opt/lineside", "jetson@[fe80::1]:"),
])
def test_ssh_target_forms_with_ipv6_and_ports(target, host, root, rsync_dest):
    # '[v6]:/dir' split at the address's first ':' (ssh to "jetson@[fe80", a directory ":1]:/opt/lineside"), and
    # ssh://host:port/dir ssh'ed to a host named "ssh"
    from lineside.jetson.targets import open_target

    t = open_target(target, "ssh -i key")
    assert (t.host, t.root, t.rsync_host + ":") == (host, root, rsync_dest)
    assert ("-p" in t.ssh and t.ssh[t.ssh.index("-p") + 1] == "2222") == (":2222" in target)
    # the label a push prints is a target the user can paste back (rollback): with its port, and to the same place
    again = open_target(t.label, "ssh -i key")
    assert (again.host, again.root, again.ssh) == (t.host, t.root, t.ssh), t.label


def test_a_port_in_an_scp_style_target_is_refused(tmp_path, bundle_factory):
    # "orin:2222:/opt/lineside" installed into ~/2222:/opt/lineside on the device
    a = bundle_factory(tmp_path / "a", 15)
    for target, hint in (("jetson@orin:2222:/opt/lineside", "ssh://jetson@orin:2222/opt/lineside"),
                         ("jetson@[fe80::1]:2222:/opt/x", "ssh://jetson@[fe80::1]:2222/opt/x"),
                         ("ssh://jetson@orin:22x/opt/x", "not a number")):
        with pytest.raises(LinesideError, match=re.escape(hint)) as e:
            push(a, target)
        assert "\n" not in str(e.value)


def test_ssh_url_target_with_a_port(tmp_path, sshd, bundle_factory):
    host, ssh = sshd
    port = re.search(r"-p (\d+)", ssh).group(1)
    r = push(bundle_factory(tmp_path / "a", 16), f"ssh://{host}:{port}{tmp_path}/dev", ssh=ssh.replace(f"-p {port} ", ""))
    assert os.readlink(tmp_path / "dev" / "current") == f"versions/{r.version}"


def test_a_manifest_path_leaving_the_bundle_writes_nothing_outside(tmp_path, bundle_factory):
    """A bundle copied from elsewhere whose manifest lists ``../x``: push read it beside the bundle and wrote it
    beside the version directories (LocalTarget), outside the version it installs."""
    import hashlib
    import json

    a = bundle_factory(tmp_path / "a", 11)
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the bundle")
    raw = json.loads((a / "manifest.json").read_text())
    raw["files"]["../secret.txt"] = {"size": secret.stat().st_size,
                                     "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    (a / "manifest.json").write_text(json.dumps(raw))
    target = tmp_path / "device"
    with pytest.raises(BundleError, match="'../secret.txt' is not a path inside the bundle"):
        push(a, str(target))
    assert not target.exists() or not any(p.is_file() for p in target.rglob("*"))


def _ssh_parts(ssh: str) -> tuple[str, str]:
    """(port, client key) of the sshd fixture's ssh command."""
    return re.search(r"-p (\d+)", ssh).group(1), re.search(r"-i (\S+)", ssh).group(1)


def test_a_changed_host_key_and_a_refused_login_say_what_to_do(tmp_path, sshd, bundle_factory):
    """Both came out as 'cannot reach HOST over ssh (...); check the address, port and keys': BatchMode turns a
    reinstalled device's new host key and a missing key into a bare failure, and the fix for each is a command."""
    import subprocess

    host, ssh = sshd
    port, key = _ssh_parts(ssh)
    a = bundle_factory(tmp_path / "a", 31, weight_bytes=1000)
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {other.with_suffix('.pub').read_text()}")
    strict = f"ssh -p {port} -i {key} -o StrictHostKeyChecking=yes -o UserKnownHostsFile={known}"
    with pytest.raises(LinesideError) as e:
        push(a, f"{host}:{tmp_path}/dev", ssh=strict)
    msg = str(e.value)
    assert "host key of" in msg and "has changed" in msg and "\n" not in msg
    assert re.search(rf"`ssh-keygen .*-R ['\"]?\[127\.0\.0\.1\]:{port}['\"]?`", msg)  # the command that removes it
    assert f"`{strict} {host}` once" in msg  # how to accept the new key: the user's own ssh, with its port

    known.write_text("")
    with pytest.raises(LinesideError, match=r"is not known here .* run `ssh [^`]+` once") as e:
        push(a, f"{host}:{tmp_path}/dev", ssh=strict)
    assert "\n" not in str(e.value)

    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    with pytest.raises(LinesideError, match=r"login to .* was refused \(.*Permission denied.*ssh-copy-id") as e:
        push(a, f"{host}:{tmp_path}/dev", ssh=ssh.replace(key, str(stranger)) + " -o IdentitiesOnly=yes")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "dev").exists()


@pytest.mark.parametrize("over_ssh", [False, True])
def test_a_second_push_while_one_runs_is_refused_and_copies_nothing(tmp_path, bundle_factory, request, over_ssh):
    """Two pushes to one device at once shared versions/.incoming-<hash> (the first renamed it under the second's
    copy: 'Directory not empty') and raced on current/previous. The second now stops in one line, before copying."""
    import fcntl

    a, b = bundle_factory(tmp_path / "a", 41, weight_bytes=1000), bundle_factory(tmp_path / "b", 42, name="b")
    dev = tmp_path / "dev"
    target, ssh = str(dev), "ssh"
    if over_ssh:
        host, ssh = request.getfixturevalue("sshd")
        target = f"{host}:{dev}"
    r1 = push(a, target, ssh=ssh)
    with open(dev / ".push.lock", "a") as held:  # what the running push holds (the device is this machine)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for op in (lambda: push(b, target, ssh=ssh), lambda: rollback(target, ssh=ssh)):
            with pytest.raises(LinesideError, match="another push or rollback to .* is running") as e:
                op()
            assert "\n" not in str(e.value)
        assert not list((dev / "versions").glob(".incoming-*")) and os.readlink(dev / "current") == \
            f"versions/{r1.version}"
    r2 = push(b, target, ssh=ssh)  # released with the process or fd that held it: nothing stale to remove
    assert r2.previous == f"versions/{r1.version}"
    assert rollback(target, ssh=ssh).current == f"versions/{r1.version}"


@pytest.mark.parametrize("old_rsync", [False, True])
def test_ssh_push_to_a_directory_with_spaces_quotes_and_non_ascii(tmp_path, sshd, bundle_factory, monkeypatch,
                                                                    old_rsync):
    """An rsync before 3.2.4 (Ubuntu 20.04, JetPack 5 hosts) lets the remote shell split the destination, so
    'my dir' became two arguments and the copy landed elsewhere (RSYNC_OLD_ARGS=1 makes today's rsync do that)."""
    host, ssh = sshd
    if old_rsync:
        monkeypatch.setenv("RSYNC_OLD_ARGS", "1")
    a = bundle_factory(tmp_path / "bündle 'a'", 51, weight_bytes=1000)
    dev = tmp_path / "my dir" / "l'usine $HOME é"
    r = push(a, f"{host}:{dev}", ssh=ssh)
    assert os.readlink(dev / "current") == f"versions/{r.version}"
    assert open_bundle(dev / "current").config.name == "tiny"
    assert not (tmp_path / "my").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs at tmp_path/dev (the device's disk); skips where mounting is not allowed."""
    import subprocess

    dev = tmp_path / "dev"
    dev.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(dev)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield dev
    subprocess.run(["umount", str(dev)], check=True)


@pytest.mark.parametrize("over_ssh", [False, True])
def test_a_disk_that_fills_during_the_copy_gets_its_space_back(tmp_path, bundle_factory, small_disk, monkeypatch,
                                                                request, over_ssh):
    """df showed room, then something else took it: rsync stopped with 'No space left on device', the partial copy
    (manifest.json included: rsync goes on with the other files) stayed on the running bundle's full disk, and the
    message said 'run push again to resume', which could only fail again."""
    import shutil

    from lineside.jetson.targets import LocalTarget, SshTarget

    a = bundle_factory(tmp_path / "a", 61, weight_bytes=3 << 20)
    target, ssh = str(small_disk), "ssh"
    if over_ssh:
        host, ssh = request.getfixturevalue("sshd")
        target = f"{host}:{small_disk}"
    monkeypatch.setattr(SshTarget if over_ssh else LocalTarget, "space", lambda self, staging: (1 << 40, 0))
    with pytest.raises(LinesideError, match="ran out of disk space during the copy.*partial copy was removed") as e:
        push(a, target, ssh=ssh)
    assert "\n" not in str(e.value)
    assert not list((small_disk / "versions").iterdir()) and not (small_disk / "current").exists()
    assert shutil.disk_usage(small_disk).used < 64 << 10
